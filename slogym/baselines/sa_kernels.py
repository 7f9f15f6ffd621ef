"""Compiled inner loop of the SA plan search (Huang et al. 2025, §4.3 Algorithm 1; population form in ``sa.py``).

A whole search is one compiled call (Numba, :func:`anneal_population`) that walks the population plan by plan:
the §4.3 moves (:func:`_target` and :func:`_apply` = ``sa._propose``; at ``B_max = 1`` the swap of
:func:`_swap_score` and :func:`_swap_commit`), the objective ``G`` of Eq. 2-12 (:func:`_score` =
``PlanProblem.score``), the Metropolis test and systematic resampling. ``tests/test_sa.py`` checks the compiled
moves, their scores and the resampling against NumPy references.

Random numbers come from a SplitMix64 generator inside the loop (:func:`_next`), seeded with one draw of the
caller's seeded ``numpy.random.Generator``: same seed, same search, and no arrays of draws to fill and pass. A move
is three mixed-radix digits of 32 random bits in fixed point (:func:`_move`, uniform on 3 x N x N up to a bias of
~``3 N^2 2^-32``); each scored move draws one uniform for the Metropolis test (:func:`_accept`, which takes a log
only in the rare band where cheap bounds on ``exp`` do not decide).

Layout. Plans are rows of tables, one row per plan of the population, changed in place: resampling copies only the
rows it replaces (:func:`_regroup`, ~10-20% per level); per plan also its SLOs met, latency sum and ``G``.

* ``B_max > 1``: an int32 row of ``2N``: ``g`` (N,), the batch of each request in ``0..N-1``
  (``sa.PlanProblem``), then the size of each batch, which the squeeze/delay room check reads. A move is applied,
  rescored in full (O(N), :func:`_score`) and undone if rejected.
* ``B_max = 1`` (every batch holds one request; only swaps move): an int32 row, the request at each position, and a
  float row, the completion time of each position. Swapping two uniformly drawn requests is swapping two uniformly
  drawn positions (a plan is a bijection), so the search draws positions; squeeze and delay are no-ops, so a level
  first lists the plans whose move is a swap, then scores only those. Swapping positions ``a < b`` shifts the
  completion times of positions ``a..b-1`` by ``d = e(request at b) - e(request at a)`` and no other: the latency
  sum changes by ``(b - a) d`` and the SLOs met are one pass of comparisons without a prefix sum
  (:func:`_swap_score`). An accepted swap adds ``d`` to those completion times (which may then differ from a fresh
  prefix sum in the last bits); the returned plan's ``G`` is rescored from scratch. The Metropolis outcome is
  applied by selects, not branches: it is unpredictable.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_JIT = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)
_INLINE = dict(_JIT, inline="always")   # helpers of the search loop: no call overhead per move

_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31, _S32 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
_TO_UNIT = 2.0 ** -53


# ============================================================================ random numbers
@njit(**_INLINE)
def _next(s: np.uint64) -> tuple[np.uint64, np.uint64]:
    """SplitMix64 (Steele, Lea & Flood 2014): the next state and 64 random bits."""
    s = s + _GOLDEN
    z = s
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return s, z ^ (z >> _S31)


@njit(**_INLINE)
def _unit(z: np.uint64) -> float:
    """A uniform double in [0, 1) from the top 53 bits (converted as a signed integer: one instruction)."""
    return np.int64(z >> _S11) * _TO_UNIT


@njit(**_INLINE)
def _move(z: np.uint64, n: int) -> tuple[int, int, int]:
    """A move (kind, r, r2), uniform on 3 x N x N: the high 32 bits of ``z`` as a fixed-point fraction, read as
    three mixed-radix digits (3, N, N) by integer products (bias ~ 3 N^2 2^-32)."""
    t = (z >> _S32) * np.uint64(3)
    kind = np.int64(t >> _S32)
    t = (t & _LOW32) * np.uint64(n)
    r = np.int64(t >> _S32)
    t = (t & _LOW32) * np.uint64(n)
    return kind, r, np.int64(t >> _S32)


@njit(**_INLINE)
def _accept(x: float, u: float) -> bool:
    """Metropolis: ``u <= exp(x)`` (``x`` = ``dG * scale / T``). The bounds ``1 + x <= exp(x) <= 1 + x + x^2 / 2``
    (x <= 0) decide without a branch; the log is taken only between them (rare)."""
    low = 1.0 + x
    ok = (x >= 0.0) | (u <= low)
    if (u <= low + 0.5 * x * x) & (not ok):   # bitwise: no branch on ``ok`` itself
        ok = np.log(u) <= x
    return ok


# ======================================================================= objective and moves (B_max > 1, references)
@njit(**_INLINE)
def _score(plans: np.ndarray, q: int, n: int, exec_time: np.ndarray, limit: np.ndarray,
           dur: np.ndarray) -> tuple[float, float]:
    """SLOs met and latency sum (without the offsets) of plan row ``q`` (Eq. 4, 8-12; the ``B_max > 1`` layout,
    at ``B_max = 1`` the second half is the request of each position); ``dur`` (N,) is scratch. Batches run in
    index order, each as long as its longest member. ``limit`` is :func:`_limits`: at ``B_max = 1`` a request meets
    its SLOs iff it completes by its deadline, otherwise iff its wait is at most its latest start at its batch's
    size."""
    met = 0.0
    lat = 0.0
    acc = 0.0
    if exec_time.shape[0] == 1:   # batch b holds request plans[q, n + b]: completion = prefix sum in batch order
        for b in range(n):
            j = plans[q, n + b]
            acc += exec_time[0, j]
            lat += acc
            met += acc <= limit[0, j]
        return met, lat
    dur[:] = 0.0
    for j in range(n):   # a batch lasts as long as its longest member
        b = plans[q, j]
        dur[b] = max(dur[b], exec_time[plans[q, n + b] - 1, j])
    for b in range(n):   # exclusive prefix: the wait of batch b (Eq. 11)
        d = dur[b]
        dur[b] = acc
        acc += d
    for j in range(n):
        s = plans[q, n + plans[q, j]] - 1
        met += dur[plans[q, j]] <= limit[s, j]
        lat += dur[plans[q, j]] + exec_time[s, j]
    return met, lat


@njit(**_INLINE)
def _limits(exec_time: np.ndarray, latest: np.ndarray) -> np.ndarray:
    """What :func:`_score` compares with: at ``B_max = 1`` each request's deadline (latest start + ``e``, as
    ``PlanProblem.score`` computes it), else the latest start per (batch size, request)."""
    return latest + exec_time if exec_time.shape[0] == 1 else latest


@njit(**_INLINE)
def _fill_row(g: np.ndarray, bmax: int, plans: np.ndarray, q: int) -> None:
    """Row ``q`` := plan ``g``, then its inverse permutation (``bmax = 1``) or its batch sizes."""
    n = g.shape[0]
    for j in range(n):
        plans[q, n + j] = 0
    for j in range(n):
        plans[q, j] = g[j]
        if bmax == 1:
            plans[q, n + g[j]] = j
        else:
            plans[q, n + g[j]] += 1


@njit(**_INLINE)
def _target(plans: np.ndarray, q: int, n: int, bmax: int, kind: int, r: int, r2: int) -> int:
    """New batch of request ``r`` under one §4.3 move on plan row ``q``, or -1 when the move is a no-op: ``kind``
    0 = squeeze ``r`` into the previous batch (not from the first, if that batch has room), 1 = delay it into the
    next (if that has room), 2 = swap ``r`` and ``r2`` (``r`` takes ``r2``'s batch)."""
    gr, g2 = plans[q, r], plans[q, r2]
    if bmax == 1:   # every batch is full: squeeze and delay never have room
        return g2 if kind == 2 and g2 != gr else -1
    # selects, not branches (the kind is random): batch gr - 1 (index n - 1 >= 0 when gr = 0, masked) or gr + 1
    prev = gr - 1 if (gr > 0) & (plans[q, n + gr - 1] < bmax) else -1
    nxt = gr + 1 if (gr < n - 1) & (plans[q, n + min(gr + 1, n - 1)] < bmax) else -1
    swap = g2 if g2 != gr else -1
    return prev if kind == 0 else (nxt if kind == 1 else swap)


@njit(**_INLINE)
def _apply(plans: np.ndarray, q: int, n: int, bmax: int, kind: int, r: int, r2: int, to: int) -> None:
    """Move request ``r`` of plan row ``q`` from its batch to batch ``to`` (:func:`_target`; a swap sends ``r2``
    the other way), keeping the row's second half consistent. Applied again with ``to`` = the old batch of ``r``
    it undoes the move."""
    gr = plans[q, r]
    plans[q, r] = to
    if kind == 2:
        plans[q, r2] = gr
        if bmax == 1:
            plans[q, n + gr], plans[q, n + to] = r2, r
    else:
        plans[q, n + gr] -= 1
        plans[q, n + to] += 1


# ============================================================================ B_max = 1: swaps scored incrementally
@njit(**_INLINE)
def _swap_setup(g: np.ndarray, exec_time: np.ndarray, limit: np.ndarray, order: np.ndarray, done: np.ndarray,
                q: int) -> tuple[float, float]:
    """Row ``q`` := plan ``g`` (position of each request) in the ``B_max = 1`` layout: ``order`` (K, N) the request
    at each position, ``done`` (K, N) its completion time. Returns its SLOs met and latency sum (a prefix sum in
    position order, as :func:`_score`)."""
    n = g.shape[0]
    for j in range(n):
        order[q, g[j]] = j
    met = lat = acc = 0.0
    for k in range(n):
        j = order[q, k]
        acc += exec_time[0, j]
        done[q, k] = acc
        lat += acc
        met += acc <= limit[0, j]
    return met, lat


@njit(**_INLINE)
def _swap_score(order: np.ndarray, done: np.ndarray, e: np.ndarray, limit: np.ndarray, q: int, n: int, a: int,
                b: int) -> tuple[float, float]:
    """SLOs met after swapping the requests at positions ``a < b`` of row ``q`` (``e``, ``limit``: execution time
    and deadline per request), and the shift ``d`` of the completion times of positions ``a..b-1`` (the latency sum
    changes by ``(b - a) d``). One pass without branches."""
    x, y = order[q, a], order[q, b]
    d = e[y] - e[x]
    met = 0   # an integer count
    for k in range(n):
        j = y if k == a else (x if k == b else order[q, k])
        met += done[q, k] + (d if a <= k < b else 0.0) <= limit[j]
    return float(met), d


@njit(**_INLINE)
def _swap_commit(order: np.ndarray, done: np.ndarray, q: int, n: int, a: int, b: int, d: float, ok: bool) -> None:
    """If ``ok``, apply the swap of positions ``a < b`` scored by :func:`_swap_score`; with selects instead of
    branches, since the Metropolis outcome is unpredictable."""
    x, y = order[q, a], order[q, b]
    order[q, a], order[q, b] = (y, x) if ok else (x, y)
    shift = d if ok else 0.0
    for k in range(n):
        done[q, k] += shift if a <= k < b else 0.0


# ============================================================================ population
@njit(**_INLINE)
def _boltzmann(x: np.ndarray, w: np.ndarray) -> None:
    """``w = exp(x)`` for ``x <= 0``, vectorizable (no libm call): Taylor to degree 13 on ``x / 2^s`` with
    ``|x| / 2^s <= 1/2`` (truncation < 1e-15 relative), then ``s`` squarings (``s = 0`` unless some weight is
    below ``exp(-1/2)``)."""
    m = x.shape[0]
    lo = 0.0
    for i in range(m):
        lo = min(lo, x[i])
    s, h = 0, 1.0
    while lo * h < -0.5:
        s += 1
        h *= 0.5
    for i in range(m):
        y = x[i] * h
        p = 1.0 / 6227020800.0
        p = p * y + 1.0 / 479001600.0
        p = p * y + 1.0 / 39916800.0
        p = p * y + 1.0 / 3628800.0
        p = p * y + 1.0 / 362880.0
        p = p * y + 1.0 / 40320.0
        p = p * y + 1.0 / 5040.0
        p = p * y + 1.0 / 720.0
        p = p * y + 1.0 / 120.0
        p = p * y + 1.0 / 24.0
        p = p * y + 1.0 / 6.0
        p = p * y + 0.5
        p = p * y + 1.0
        w[i] = p * y + 1.0
    for _ in range(s):
        for i in range(m):
            w[i] *= w[i]


@njit(**_INLINE)
def _resample(g_cur: np.ndarray, coef: float, g_ref: float, u0: float, w: np.ndarray, keep: np.ndarray) -> None:
    """Systematic resampling: ``keep[i]`` = first plan whose cumulative weight ``exp(coef * (G - g_ref))`` reaches
    ``(i + u0) / m`` of the total ``W``, without a search: plan ``j`` whose cumulative weight is ``W_j`` covers the
    ``c_j = floor(m W_j / W - u0) + 1`` first targets, so ``keep[i]`` = the number of plans with ``c_j <= i``
    (a count per ``c_j``, then a prefix sum; no data-dependent branch). ``keep`` is non-decreasing. ``w`` is
    scratch of ``m + 1``."""
    m = g_cur.shape[0]
    for i in range(m):
        w[i] = coef * (g_cur[i] - g_ref)
    _boltzmann(w[:m], w[:m])
    acc = 0.0
    for i in range(m):
        acc += w[i]
        w[i] = acc
    f = m / acc
    for i in range(m + 1):
        keep[i] = 0
    for j in range(m):
        keep[min(int(np.floor(w[j] * f - u0)) + 1, m)] += 1
    run = 0
    for i in range(m):
        run += keep[i]
        keep[i] = run


@njit(**_INLINE)
def _copy_plan(ints: np.ndarray, floats: np.ndarray, scores: np.ndarray, a: int, b: int) -> None:
    """Plan ``b`` := plan ``a`` (its rows and scores)."""
    for j in range(ints.shape[1]):
        ints[b, j] = ints[a, j]
    for j in range(floats.shape[1]):
        floats[b, j] = floats[a, j]
    for j in range(3):
        scores[j, b] = scores[j, a]


@njit(**_INLINE)
def _regroup(ints: np.ndarray, floats: np.ndarray, scores: np.ndarray, keep: np.ndarray) -> None:
    """Plan ``i`` := plan ``keep[i]`` for every ``i``, in place. ``keep`` is non-decreasing, so a source row is
    never overwritten before it is read: copies to lower rows run upward, copies to higher rows downward."""
    m = scores.shape[1]
    for i in range(m):
        if keep[i] > i:
            _copy_plan(ints, floats, scores, keep[i], i)
    for i in range(m - 1, -1, -1):
        if keep[i] < i:
            _copy_plan(ints, floats, scores, keep[i], i)


@njit(**_JIT)
def anneal_population(start: np.ndarray, exec_time: np.ndarray, latest: np.ndarray, offset_sum: float,
                      temps: np.ndarray, scale: float, m: int, seed: int) -> tuple[np.ndarray, float]:
    """Population annealing of ``m`` plans from plan ``start``, random numbers from :func:`_next` seeded with
    ``seed``. At level ``l`` (temperature ``temps[l]``) the population is resampled by the Boltzmann-weight change
    (systematic, offset drawn per level); then each plan makes one uniform random move (:func:`_move`), kept iff
    :func:`_accept` (``G`` does not drop, or ``u <= exp(dG * scale / T)``: Metropolis). Returns the best plan
    seen (checked at every accepted move) and its ``G`` (rescored from scratch)."""
    n = start.shape[0]
    bmax = exec_time.shape[0]
    limit = _limits(exec_time, latest)
    ints = np.empty((m, n if bmax == 1 else 2 * n), np.int32)   # the plans, one row each (module doc)
    floats = np.empty((m, n if bmax == 1 else 0))
    scores = np.empty((3, m))                                     # SLOs met, latency sum, G
    met, lat, g = scores[0], scores[1], scores[2]
    dur = np.empty(n)
    e, lim = exec_time[0], limit[0]
    if bmax == 1:
        met[0], lat[0] = _swap_setup(start, exec_time, limit, ints, floats, 0)
    else:
        _fill_row(start, bmax, ints, 0)
        met[0], lat[0] = _score(ints, 0, n, exec_time, limit, dur)
    g[0] = met[0] / (lat[0] + offset_sum)
    for i in range(1, m):
        _copy_plan(ints, floats, scores, 0, i)
    keep, w = np.empty(m + 1, np.int64), np.empty(m + 1)
    act, pa, pb = np.empty(m, np.int64), np.empty(m, np.int64), np.empty(m, np.int64)
    best, best_row, g_best = start.copy(), ints[0].copy(), g[0]
    s = np.uint64(seed)
    for lvl in range(temps.shape[0]):
        t = temps[lvl]
        if lvl:
            s, z = _next(s)
            _resample(g, (1.0 / t - 1.0 / temps[lvl - 1]) * scale, g_best, _unit(z), w, keep)
            _regroup(ints, floats, scores, keep)
        beta = scale / t
        if bmax == 1:
            # a swap of requests r, r2 (uniform) is a swap of positions (uniform: a plan is a bijection); squeeze
            # and delay are no-ops. First the plans whose move is a swap of two positions, then those moves.
            cnt = 0
            for i in range(m):
                s, z = _next(s)
                kind, r, r2 = _move(z, n)
                act[cnt] = i
                pa[cnt] = min(r, r2)
                pb[cnt] = max(r, r2)
                cnt += (kind == 2) & (r != r2)
            for c in range(cnt):
                i, a, b = act[c], pa[c], pb[c]
                m_new, d = _swap_score(ints, floats, e, lim, i, n, a, b)
                l_new = lat[i] + (b - a) * d
                g_new = m_new / (l_new + offset_sum)
                s, z = _next(s)
                ok = _accept((g_new - g[i]) * beta, _unit(z))
                _swap_commit(ints, floats, i, n, a, b, d, ok)
                met[i], lat[i], g[i] = (m_new, l_new, g_new) if ok else (met[i], lat[i], g[i])
                if (g_new > g_best) & ok:   # bitwise: no branch on ``ok`` itself
                    g_best = g_new
                    best_row[:] = ints[i]
            continue
        for i in range(m):
            s, z = _next(s)
            kind, r, r2 = _move(z, n)
            to = _target(ints, i, n, bmax, kind, r, r2)
            if to < 0:
                continue
            was = ints[i, r]
            _apply(ints, i, n, bmax, kind, r, r2, to)
            m_new, l_new = _score(ints, i, n, exec_time, limit, dur)
            g_new = m_new / (l_new + offset_sum)
            s, z = _next(s)
            if _accept((g_new - g[i]) * beta, _unit(z)):
                met[i], lat[i], g[i] = m_new, l_new, g_new
                if g_new > g_best:
                    g_best = g_new
                    best[:] = ints[i, :n]
            else:   # rejected: undo
                _apply(ints, i, n, bmax, kind, r, r2, was)
    if bmax == 1:
        for k in range(n):
            best[best_row[k]] = k
    m_best, l_best = score_plans(best[None], exec_time, latest)
    return best, m_best[0] / (l_best[0] + offset_sum)


# ============================================================================ references for the tests
@njit(**_JIT)
def score_plans(g: np.ndarray, exec_time: np.ndarray, latest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SLOs met (K,) and latency sums without offsets (K,) of the plans ``g`` (K, N), scored from scratch."""
    k, n = g.shape
    met, lat = np.empty(k), np.empty(k)
    row, dur = np.empty((1, 2 * n), np.int64), np.empty(n)
    limit = _limits(exec_time, latest)
    for i in range(k):
        _fill_row(g[i], exec_time.shape[0], row, 0)
        met[i], lat[i] = _score(row, 0, n, exec_time, limit, dur)
    return met, lat


@njit(**_JIT)
def propose(cur: np.ndarray, exec_time: np.ndarray, latest: np.ndarray, kind: np.ndarray, r: np.ndarray,
            r2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One move per plan of ``cur`` (K, N) as the search makes and scores it: the new plans, their SLOs met and
    latency sums without offsets (at ``B_max = 1`` by :func:`_swap_score`, else by :func:`_score`). The tests
    check them against ``sa._propose`` and ``PlanProblem.score``."""
    k, n = cur.shape
    bmax = exec_time.shape[0]
    limit = _limits(exec_time, latest)
    out, met, lat = cur.copy(), np.empty(k), np.empty(k)
    row, times, dur = np.empty((1, 2 * n), np.int64), np.empty((1, n)), np.empty(n)
    for i in range(k):
        if bmax == 1:
            met[i], lat[i] = _swap_setup(cur[i], exec_time, limit, row, times, 0)
            a, b = min(cur[i, r[i]], cur[i, r2[i]]), max(cur[i, r[i]], cur[i, r2[i]])
            if kind[i] == 2 and a < b:
                met[i], d = _swap_score(row, times, exec_time[0], limit[0], 0, n, a, b)
                lat[i] += (b - a) * d
                _swap_commit(row, times, 0, n, a, b, d, True)
                out[i, row[0, a]], out[i, row[0, b]] = a, b
            continue
        _fill_row(cur[i], bmax, row, 0)
        to = _target(row, 0, n, bmax, kind[i], r[i], r2[i])
        if to >= 0:
            _apply(row, 0, n, bmax, kind[i], r[i], r2[i], to)
            out[i] = row[0, :n]
        met[i], lat[i] = _score(row, 0, n, exec_time, limit, dur)
    return out, met, lat


@njit(**_JIT)
def resample(g: np.ndarray, coef: float, g_ref: float, u0: float) -> np.ndarray:
    """The plan each of ``m`` slots copies under :func:`_resample` (the tests check it against ``searchsorted``)."""
    m = g.shape[0]
    keep, w = np.empty(m + 1, np.int64), np.empty(m + 1)
    _resample(g, coef, g_ref, u0, w, keep)
    return keep[:m]

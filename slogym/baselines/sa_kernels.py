"""Compiled inner loop of the SA plan search (Huang et al. 2025, §4.3 Algorithm 1; population form in ``sa.py``).

The NumPy search spent its time in ~50 small-array calls per temperature level (32 levels); here a whole search
is one compiled call (Numba) that walks the population plan by plan: the same moves (:func:`_target` and
:func:`_apply` = ``sa._propose``), the objective ``G`` of Eq. 2-12 (:func:`_score` = ``PlanProblem.score``), the
same Metropolis test and systematic resampling, from random draws made up front by the caller's seeded
``numpy.random.Generator``. Sums run in a fixed sequential order, so ``G`` can differ from the NumPy (BLAS) value
in the last bits; ``tests/test_sa.py`` checks the compiled objective and moves against the NumPy ones.

Layout. Plans are rows of ``2N`` integers in a table (one row per plan of the population): ``g`` (N,), the batch
index of each request in ``0..N-1`` (``sa.PlanProblem``), then an auxiliary half -- at ``B_max = 1`` the inverse
permutation (the request of each batch), so ``G`` is one pass over the batches in order; at ``B_max > 1`` the
size of each batch, which the squeeze/delay room check reads. The moves keep both halves consistent. Rows are
indexed as ``(table, row)`` pairs and copied element by element: a NumPy view in the loop costs a reference count.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_JIT = dict(cache=True, nogil=True, error_model="numpy", boundscheck=False)
_INLINE = dict(_JIT, inline="always")   # helpers of the search loop: no call overhead per move


@njit(**_INLINE)
def _score(plans: np.ndarray, q: int, n: int, exec_time: np.ndarray, limit: np.ndarray,
           dur: np.ndarray) -> tuple[float, float]:
    """SLOs met and latency sum (without the offsets) of plan row ``q`` (Eq. 4, 8-12); ``dur`` (N,) is scratch.
    Batches run in index order, each as long as its longest member. ``limit`` is :func:`_limits`: at ``B_max = 1``
    a request meets its SLOs iff it completes by its deadline, otherwise iff its wait is at most its latest start
    at its batch's size."""
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
        e = exec_time[plans[q, n + plans[q, j]] - 1, j]
        if e > dur[plans[q, j]]:
            dur[plans[q, j]] = e
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
def _copy_row(src: np.ndarray, a: int, dst: np.ndarray, b: int) -> None:
    """``dst[b] = src[a]``."""
    for j in range(src.shape[1]):
        dst[b, j] = src[a, j]


@njit(**_INLINE)
def _digits(v: float, n: int) -> tuple[int, int, int]:
    """A uniform ``v`` in [0, 1) as a move (kind, r, r2), uniform on 3 x N x N: its first three digits in mixed
    radix (3, N, N), by float products (no integer division in the loop; bias ~ N^2 * 2^-53)."""
    x = v * 3.0
    kind = min(int(x), 2)
    x = (x - kind) * n
    r = min(int(x), n - 1)
    x = (x - r) * n
    return kind, r, min(int(x), n - 1)


@njit(**_INLINE)
def _target(plans: np.ndarray, q: int, n: int, bmax: int, kind: int, r: int, r2: int) -> int:
    """New batch of request ``r`` under one §4.3 move on plan row ``q``, or -1 when the move is a no-op: ``kind``
    0 = squeeze ``r`` into the previous batch (not from the first, if that batch has room), 1 = delay it into the
    next (if that has room), 2 = swap ``r`` and ``r2`` (``r`` takes ``r2``'s batch)."""
    gr = plans[q, r]
    if kind == 2:
        return plans[q, r2] if plans[q, r2] != gr else -1
    if bmax == 1:   # every batch is full: squeeze and delay never have room
        return -1
    if kind == 0 and gr > 0 and plans[q, n + gr - 1] < bmax:
        return gr - 1
    if kind == 1 and gr < n - 1 and plans[q, n + gr + 1] < bmax:
        return gr + 1
    return -1


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


@njit(**_JIT)
def score_plans(g: np.ndarray, exec_time: np.ndarray, latest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SLOs met (K,) and latency sums without offsets (K,) of the plans ``g`` (K, N), as the search scores them."""
    k, n = g.shape
    met, lat = np.empty(k), np.empty(k)
    row, dur = np.empty((1, 2 * n), np.int64), np.empty(n)
    limit = _limits(exec_time, latest)
    for i in range(k):
        _fill_row(g[i], exec_time.shape[0], row, 0)
        met[i], lat[i] = _score(row, 0, n, exec_time, limit, dur)
    return met, lat


@njit(**_JIT)
def propose(cur: np.ndarray, bmax: int, kind: np.ndarray, r: np.ndarray, r2: np.ndarray) -> np.ndarray:
    """One move per plan of ``cur`` (K, N), as the search makes it (the tests check it against ``sa._propose``)."""
    k, n = cur.shape
    out = cur.copy()
    row = np.empty((1, 2 * n), np.int64)
    for i in range(k):
        _fill_row(cur[i], bmax, row, 0)
        to = _target(row, 0, n, bmax, kind[i], r[i], r2[i])
        if to >= 0:
            _apply(row, 0, n, bmax, kind[i], r[i], r2[i], to)
            out[i] = row[0, :n]
    return out


@njit(**_INLINE)
def _resample(g_cur: np.ndarray, coef: float, g_ref: float, u0: float, w: np.ndarray, keep: np.ndarray) -> None:
    """Systematic resampling: ``keep[i]`` = first plan whose cumulative weight ``exp(coef * (G - g_ref))`` reaches
    ``(i + u0) / m`` of the total, i.e. ``searchsorted`` on the cumulative sum."""
    m = g_cur.shape[0]
    acc = 0.0
    for i in range(m):
        acc += np.exp(coef * (g_cur[i] - g_ref))
        w[i] = acc
    j = 0
    for i in range(m):
        target = (i + u0) / m * acc
        while j < m - 1 and w[j] < target:
            j += 1
        keep[i] = j


@njit(**_JIT)
def anneal_population(start: np.ndarray, g_start: float, exec_time: np.ndarray, latest: np.ndarray,
                      offset_sum: float, temps: np.ndarray, scale: float, log_u: np.ndarray, v: np.ndarray,
                      u0: np.ndarray) -> tuple[np.ndarray, float]:
    """Population annealing from plan ``start`` (its ``G`` = ``g_start``) with uniform draws ``v`` (levels, m),
    ``u0`` (levels,) and logs of uniform draws ``log_u`` (levels, m). At level ``l`` (temperature ``temps[l]``)
    the population of ``m`` plans is resampled by the Boltzmann-weight change (systematic, offset ``u0[l]``); then
    plan ``i`` makes the move :func:`_digits` of ``v[l, i]``, kept iff ``G`` does not drop or
    ``dG * scale / T >= log_u[l, i]`` (Metropolis). Returns the best plan seen (checked after each level) and its
    ``G``."""
    n_lvl, m = v.shape
    n = start.shape[0]
    bmax = exec_time.shape[0]
    cur, nxt = np.empty((m, 2 * n), np.int64), np.empty((m, 2 * n), np.int64)   # one row per plan
    _fill_row(start, bmax, cur, 0)
    for i in range(1, m):
        _copy_row(cur, 0, cur, i)
    g_cur, g_nxt = np.full(m, g_start), np.empty(m)
    keep, w = np.arange(m), np.empty(m)
    dur = np.empty(n)
    limit = _limits(exec_time, latest)
    best, g_best = start.copy(), g_start
    for lvl in range(n_lvl):
        t = temps[lvl]
        if lvl:
            _resample(g_cur, (1.0 / t - 1.0 / temps[lvl - 1]) * scale, g_best, u0[lvl], w, keep)
        beta = scale / t
        i_max, g_max = 0, -np.inf
        for i in range(m):
            parent = keep[i]
            _copy_row(cur, parent, nxt, i)
            gp = g_cur[parent]
            if bmax > 1 or v[lvl, i] * 3.0 >= 2.0:   # at B_max = 1 only a swap (kind 2) can move
                kind, r, r2 = _digits(v[lvl, i], n)
                to = _target(nxt, i, n, bmax, kind, r, r2)
                if to >= 0:
                    was = nxt[i, r]
                    _apply(nxt, i, n, bmax, kind, r, r2, to)
                    met, lat = _score(nxt, i, n, exec_time, limit, dur)
                    g_new = met / (lat + offset_sum)
                    if g_new >= gp or (g_new - gp) * beta >= log_u[lvl, i]:   # Metropolis
                        gp = g_new
                    else:   # rejected: undo
                        _apply(nxt, i, n, bmax, kind, r, r2, was)
            g_nxt[i] = gp
            if gp > g_max:
                i_max, g_max = i, gp
        cur, nxt = nxt, cur
        g_cur, g_nxt = g_nxt, g_cur
        if g_max > g_best:
            for j in range(n):
                best[j] = cur[i_max, j]
            g_best = g_max
    return best, g_best

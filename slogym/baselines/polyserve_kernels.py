"""Compiled per-iteration and per-arrival loops of PolyServe (Zhu et al. 2025; the policy is ``polyserve.py``).

As NumPy expressions, PolyServe's bookkeeping was ~30 small-array calls per batch formation (re-reading an
instance's residents, §4.5) and ~60 per arrival (the admission test over every candidate instance, §4.5-4.7),
each with a fixed cost of 1-2 us that dominated a cluster run. Each kernel here is one compiled loop (Numba) that
does, value for value, what the NumPy code of ``polyserve.py`` defines -- the same integer arithmetic and the same
floating-point operations in the same order -- so the policy decides exactly as before
(``tests/test_polyserve_kernels.py`` checks each kernel against its NumPy definition).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from slogym.core.state import I_GEN, I_NC, I_NT

_JIT = dict(cache=True, nogil=True, error_model="numpy")
_INLINE = dict(_JIT, inline="always")
INF = np.inf
NO_HOST = 1 << 20  # host rank of a label that may not host a tier (``Fleet.host_rank``)


# ============================================================================ profile table (§4.5)
@njit(**_JIT)
def _first_above(grid: np.ndarray, x: float) -> int:
    """``searchsorted(grid, x, 'right')``: the first index whose grid value exceeds ``x``."""
    lo, hi = 0, grid.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if grid[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(**_JIT)
def _cell(grid: np.ndarray, x: float) -> int:
    """Index ``i`` of the grid cell holding ``x``: ``searchsorted(grid, x, 'right') - 1`` clipped to
    ``0..size-2`` (flat below the grid, the edge cell's slope above it)."""
    i = _first_above(grid, x) - 1
    if i > grid.size - 2:
        i = grid.size - 2
    return i if i > 0 else 0


@njit(**_INLINE)
def _weight(grid: np.ndarray, x: float) -> tuple[int, float]:
    """Cell of ``x`` on a profile axis (:func:`_cell`) and its interpolation weight (0 below the grid)."""
    i = _cell(grid, x)
    w = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, (w if w >= 0.0 else 0.0)


@njit(**_INLINE)
def _bilinear(tt: np.ndarray, i: int, wi: float, j: int, wj: float) -> float:
    """Bilinear interpolation of ``tt`` in cell (``i``, ``j``) at weights (``wi``, ``wj``)."""
    lo = tt[i, j] + (tt[i, j + 1] - tt[i, j]) * wj
    hi = tt[i + 1, j] + (tt[i + 1, j + 1] - tt[i + 1, j]) * wj
    return lo + (hi - lo) * wi


@njit(**_JIT)
def table_time(tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, tokens: float, kv: float) -> float:
    """``ProfileTable.time`` of one batch: bilinear interpolation of the profile grid (``tg`` token sizes x ``kg``
    KV sizes -> ``tt`` seconds); 0 for an empty batch."""
    if not tokens > 0:
        return 0.0
    i, wi = _weight(tg, tokens)
    j, wj = _weight(kg, kv)
    return _bilinear(tt, i, wi, j, wj)


@njit(**_JIT)
def interp(x: float, xp: np.ndarray, fp: np.ndarray) -> float:
    """``np.interp(x, xp, fp)`` for one ``x`` (NumPy's rules: ends clamp, an exact grid point returns its value)."""
    n = xp.size
    if x < xp[0]:
        return fp[0]
    if x >= xp[n - 1]:
        return fp[n - 1]
    j = _first_above(xp, x) - 1
    if xp[j] == x:
        return fp[j]
    slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j])
    return slope * (x - xp[j]) + fp[j]


@njit(**_JIT)
def token_budget(grid: np.ndarray, curve: np.ndarray, kv: float) -> int:
    """``ProfileTable.token_budget`` of one KV size from its tabulated curve (``grid`` -> ``curve``)."""
    return int(np.floor(interp(kv, grid, curve)))


@njit(**_INLINE)
def attn_extra(pg: np.ndarray, pkv: np.ndarray, pt: np.ndarray, chunk: float, past: float) -> float:
    """Time a prefill chunk of ``chunk`` tokens spends attending ``past`` tokens already in the KV, which the
    (batch size, KV size) table leaves out (§4.5 neglects prefill attention below 10K tokens; §3.5 counts it in
    the co-located iteration time): the prefill profile (``pg`` chunk tokens x ``pkv`` past -> ``pt`` seconds,
    ``polyserve.prefill_profile_table``) at that past less at none. 0 for an empty chunk or no past."""
    if not (chunk > 0 and past > 0):
        return 0.0
    return table_time(pg, pkv, pt, chunk, past) - table_time(pg, pkv, pt, chunk, 0.0)


@njit(**_JIT)
def co_chunk(tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, pg: np.ndarray, pkv: np.ndarray, pt: np.ndarray,
             dec: int, kv: float, hi: int, past: float, tpot: float) -> int:
    """Largest prefill chunk (``0..hi`` tokens) beside ``dec`` decodes at KV size ``kv`` whose iteration -- the
    table's time of ``dec + chunk`` tokens plus the chunk's attention over ``past`` (:func:`attn_extra`) --
    stays within the time the table allows the ``hi``-token chunk (``tpot``, or the table's time of
    ``dec + hi`` when the tabulated budget ``hi`` rounds above it). ``hi`` is the paper's chunk (the table's
    token budget at ``tpot`` less the decodes), returned unchanged without past; the time rises with the chunk,
    so a bisection finds it. The co-located scheduler's budget (``PolyScheduler.next_batch``) and the router's
    chunk prediction (``_admits``, §4.7) both read it."""
    if hi <= 0 or not past > 0:
        return hi
    t_hi = table_time(tg, kg, tt, float(dec + hi), kv)
    limit = t_hi if t_hi > tpot else tpot
    if t_hi + attn_extra(pg, pkv, pt, float(hi), past) <= limit:
        return hi
    # bisection: the KV column of the table and the past columns of the prefill profile stay fixed, so only the
    # token cells are looked up per step (the same values as table_time / attn_extra, operation for operation)
    j, wj = _weight(kg, kv)
    jp, wp = _weight(pkv, past)
    j0, w0 = _weight(pkv, 0.0)
    lo, up = 0, hi  # fits(lo), not fits(up)
    while up - lo > 1:
        mid = (lo + up) >> 1
        i, wi = _weight(tg, float(dec + mid))
        ip, wq = _weight(pg, float(mid))
        extra = _bilinear(pt, ip, wq, jp, wp) - _bilinear(pt, ip, wq, j0, w0)
        if _bilinear(tt, i, wi, j, wj) + extra <= limit:
            lo = mid
        else:
            up = mid
    return lo


@njit(**_JIT)
def co_budget(grid: np.ndarray, curve: np.ndarray, tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, pg: np.ndarray,
              pkv: np.ndarray, pt: np.ndarray, dec: int, kv: float, tpot: float, past: float) -> int:
    """``Fleet.chunk_budget`` in one call: the token budget at KV size ``kv`` (:func:`token_budget` of the
    ``tpot`` curve ``grid`` -> ``curve``) less the ``dec`` decodes, shrunk by :func:`co_chunk` at ``past``."""
    return co_chunk(tg, kg, tt, pg, pkv, pt, dec, kv, token_budget(grid, curve, kv) - dec, past, tpot)


@njit(**_JIT)
def chunks_attention(pg: np.ndarray, pkv: np.ndarray, pt: np.ndarray, toks: np.ndarray, past: np.ndarray) -> float:
    """``Fleet.chunk_attention``: :func:`attn_extra` of each chunk ``toks[m]`` over ``past[m]``, summed in order."""
    total = 0.0
    for m in range(toks.size):
        total += attn_extra(pg, pkv, pt, float(toks[m]), float(past[m]))
    return total


# ============================================================================ batch formation (§2.4, §4.5)
@njit(**_JIT)
def deadline_order(cands: np.ndarray, ready: np.ndarray, stage: np.ndarray, stage_ttft: np.ndarray,
                   be: np.ndarray, arrival: np.ndarray) -> np.ndarray:
    """``cands`` by TTFT deadline (``ready + TTFT`` of the current stage; best effort last), then arrival, then
    their given order: ``np.lexsort((arrival, deadline))``, as a bottom-up stable merge sort."""
    n = cands.size
    dl = np.empty(n)
    arr = np.empty(n)
    for m in range(n):
        r = cands[m]
        dl[m] = INF if be[r] else ready[r] + stage_ttft[stage[r]]
        arr[m] = arrival[r]
    idx = np.arange(n)
    tmp = np.empty(n, np.int64)
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            i, k, out = lo, mid, lo
            while i < mid and k < hi:
                a, b = idx[i], idx[k]
                if dl[b] < dl[a] or (dl[b] == dl[a] and arr[b] < arr[a]):  # the right run only when strictly first
                    tmp[out] = b
                    k += 1
                else:
                    tmp[out] = a
                    i += 1
                out += 1
            tmp[out:out + mid - i] = idx[i:mid]
            out += mid - i
            tmp[out:out + hi - k] = idx[k:hi]
        idx, tmp = tmp, idx
        width *= 2
    res = np.empty(n, np.int64)
    for m in range(n):
        res[m] = cands[idx[m]]
    return res


# ============================================================================ per-instance state
@njit(**_JIT)
def observe_row(I: np.ndarray, res: np.ndarray, rtier: np.ndarray, rtpot: np.ndarray, be: np.ndarray,
                resid: np.ndarray, rem: np.ndarray, csum: np.ndarray, pb: np.ndarray, sa: np.ndarray,
                n_res: np.ndarray, kv_now: np.ndarray, q_pre: np.ndarray, q_slo: np.ndarray, res_tight: np.ndarray,
                j: int, no_tier: int) -> float:
    """Write instance ``j``'s row of the fleet (``Fleet.read``) from its residents ``res`` (running then waiting):
    ``rem[j]`` the predicted remaining tokens (``resid[generated]``, the last entry beyond its end: the
    ``Fleet.remaining`` curve, values >= 1; §4.5) sorted descending (stable), ``csum[j]`` the prefix sums of their
    lengths in that order (and :func:`row_maxima`), ``n_res[j]``, ``kv_now[j]`` (their length sum), ``q_pre[j]``
    (tokens still to compute), ``q_slo[j]`` (those of residents with an SLO, ``be`` false: the prompts the
    scheduler runs before best-effort ones) and ``res_tight[j]`` (the tightest resident tier, ``no_tier - 1`` for
    best effort and demoted requests, ``no_tier`` when empty). Returns the tightest TPOT among the residents with
    an SLO."""
    n = res.size
    top = resid.max()
    last = resid.size - 1
    # counting sort by remaining tokens (1..top), descending: stable, and linear in n + top
    rank = np.empty(n, np.int64)
    start = np.zeros(top + 1, np.int64)
    for m in range(n):
        g = I[res[m], I_GEN]
        rank[m] = top - resid[g if g < last else last]
        start[rank[m] + 1] += 1
    for b in range(1, top + 1):
        start[b] += start[b - 1]
    order = np.empty(n, np.int64)
    for m in range(n):
        order[start[rank[m]]] = m
        start[rank[m]] += 1
    acc = 0
    todo = 0
    todo_slo = 0
    tight = INF
    tier = no_tier
    for m in range(n):
        rem[j, m] = top - rank[order[m]]
        acc += I[res[order[m]], I_NT]
        csum[j, m] = acc
        r = res[m]
        todo += I[r, I_NT] - I[r, I_NC]
        tier_r = no_tier - 1 if be[r] else rtier[r]  # a demoted request is best effort, whatever its TPOT
        if tier_r < tier:
            tier = tier_r
        if not be[r]:
            todo_slo += I[r, I_NT] - I[r, I_NC]
            if rtpot[r] < tight:
                tight = rtpot[r]
    row_maxima(rem, csum, pb, sa, j, n)
    n_res[j] = n
    kv_now[j] = acc
    q_pre[j] = todo
    q_slo[j] = todo_slo
    res_tight[j] = tier
    return tight


@njit(**_JIT)
def row_maxima(rem: np.ndarray, csum: np.ndarray, pb: np.ndarray, sa: np.ndarray, j: int, n: int,
               start: int = 0) -> None:
    """The maxima :func:`future_kv_peak_one` reads, for row ``j`` (``n`` residents sorted by ``rem``
    descending), from position ``start`` on (earlier prefix maxima unchanged). With ``k = rem[m] - 1`` (the
    iteration before resident ``m`` ends, when the first ``m + 1`` residents are alive), the KV size then is
    ``B[m] = csum[m] + (m + 1) k`` without the new request and ``A[m] + c0`` with it (``A[m] = B[m] + k``):
    ``pb[m] = max(B[:m + 1])``, ``sa[m] = max(A[m:])``."""
    for m in range(start, n):
        b = csum[j, m] + (m + 1) * (rem[j, m] - 1)
        pb[j, m] = b if m == 0 or b > pb[j, m - 1] else pb[j, m - 1]
    for m in range(n - 1, -1, -1):
        a = csum[j, m] + (m + 2) * (rem[j, m] - 1)
        sa[j, m] = a if m == n - 1 or a > sa[j, m + 1] else sa[j, m + 1]


@njit(**_JIT)
def place_row(rem: np.ndarray, csum: np.ndarray, pb: np.ndarray, sa: np.ndarray, j: int, n: int, r0: int,
              ctx: int) -> None:
    """Insert a resident predicted to need ``r0`` more tokens, ``ctx`` long, into row ``j`` (``n`` residents,
    sorted by ``rem`` descending): after the residents with ``rem >= r0``, prefix sums shifted by ``ctx``."""
    pos = 0
    while pos < n and rem[j, pos] >= r0:
        pos += 1
    for m in range(n, pos, -1):
        rem[j, m] = rem[j, m - 1]
        csum[j, m] = csum[j, m - 1] + ctx
    rem[j, pos] = r0
    csum[j, pos] = (csum[j, pos - 1] if pos else 0) + ctx
    row_maxima(rem, csum, pb, sa, j, n + 1, pos)


@njit(**_JIT)
def _first_below(rem: np.ndarray, j: int, n: int, x: int) -> int:
    """Residents of row ``j`` with ``rem > x`` (a prefix: the row is sorted descending)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if rem[j, mid] > x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(**_JIT)
def future_kv_peak_one(rem: np.ndarray, csum: np.ndarray, pb: np.ndarray, sa: np.ndarray, j: int, n: int, c0: int,
                       r0: int) -> int:
    """``polyserve.future_kv_peak`` of one instance (row ``j``, ``n`` residents) from its :func:`row_maxima`:
    residents with ``rem > r0`` peak without the new request (``pb``), the others with it (``sa + c0``); the new
    request's own end (``k = r0 - 1``) with the ``u`` residents still alive then. O(log n)."""
    v = _first_below(rem, j, n, r0)          # rem > r0
    u = _first_below(rem, j, n, r0 - 1)      # rem >= r0
    best = pb[j, v - 1] if v > 0 else -1
    if v < n and sa[j, v] + c0 > best:
        best = sa[j, v] + c0
    own = (csum[j, u - 1] if u > 0 else 0) + u * (r0 - 1) + c0 + r0 - 1
    return own if own > best else best


@njit(**_INLINE)
def _fits(tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, batch: int, pk: int, host_tpot: float, cap: int,
          max_seqs: int) -> tuple[bool, float]:
    """The TPOT and KV checks of admission (§4.5): the profile time of the decode ``batch`` at the future KV peak
    ``pk`` within the host TPOT, the peak within KV memory, the batch within ``max_seqs``; and that time."""
    t_dec = table_time(tg, kg, tt, float(batch), float(pk))
    return t_dec <= host_tpot and pk <= cap and batch <= max_seqs, t_dec


@njit(**_INLINE)
def _co_prefill(batch: int, pk: int, host_tpot: float, curve: np.ndarray, grid: np.ndarray, q_ahead: int,
                tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, pg: np.ndarray, pkv: np.ndarray, pt: np.ndarray,
                ctx: int, prompt: int) -> tuple[bool, float]:
    """The prefill prediction of co-located admission (see :func:`_admits`), which does not depend on the time:
    (the chunk is >= 1 token, the predicted time from the end of the host's current iteration to the first
    token)."""
    hi = token_budget(grid, curve, float(pk)) - batch
    last = ctx - (hi if 0 < hi < prompt else prompt)  # the past the prompt's last chunk attends
    chunk = co_chunk(tg, kg, tt, pg, pkv, pt, batch, float(pk), hi, float(last), host_tpot)
    todo = q_ahead + prompt
    step = chunk if chunk > 1 else 1
    s = step if step < todo else todo
    t_iter = table_time(tg, kg, tt, float(batch + s), float(pk)) + attn_extra(pg, pkv, pt, float(s),
                                                                                0.5 * (ctx - prompt + last))
    return chunk >= 1, (-(-todo // step)) * t_iter


@njit(**_INLINE)
def _wait(busy_until: np.ndarray, j: int, now: float) -> float:
    """Time until instance ``j``'s current iteration ends (§4.6), 0 when it has."""
    wait = busy_until[j] - now
    return wait if wait > 0.0 else 0.0


@njit(**_INLINE)
def _admits(decode: bool, j: int, host_tpot: float, curve: np.ndarray, grid: np.ndarray, rem: np.ndarray,
            csum: np.ndarray, pb: np.ndarray, sa: np.ndarray, n_res: np.ndarray, q_ahead: np.ndarray,
            kv_now: np.ndarray, busy_until: np.ndarray, cap: np.ndarray, max_seqs: np.ndarray, tg: np.ndarray,
            kg: np.ndarray, tt: np.ndarray, pg: np.ndarray, pkv: np.ndarray, pt: np.ndarray, ctx: int, prompt: int,
            r0: int, now: float, deadline: float, xfer: float) -> tuple[bool, int, float]:
    """Admission of one request on instance ``j`` (the rules are ``PolyServeRouter.admission`` (co-located) and
    ``decode_admission`` (``decode``)): (admitted, future KV peak, predicted first / next token time).

    ``q_ahead[j]``: prompt tokens queued on ``j`` that the new prompt waits for (``Fleet.q_slo``: those of
    requests with an SLO; the scheduler runs best-effort prompts last). Co-located chunk (§4.7, "maintained
    throughout the prefill"): :func:`co_chunk` at the past the prompt's last
    chunk attends (its length less the attention-free chunk), and each iteration of the prediction is timed with
    the chunk's attention over the mean past of the prompt's chunks (``pg``, ``pkv``, ``pt``: the prefill
    profile)."""
    n = n_res[j]
    pk = future_kv_peak_one(rem, csum, pb, sa, j, n, ctx, r0)
    fits, t_dec = _fits(tg, kg, tt, n + 1, pk, host_tpot, cap[j], max_seqs[j])
    wait = _wait(busy_until, j, now)
    if decode:
        nxt = now + xfer + wait + t_dec
        return fits and nxt <= deadline, pk, nxt
    chunk_ok, ahead = _co_prefill(n + 1, pk, host_tpot, curve, grid, q_ahead[j], tg, kg, tt, pg, pkv, pt, ctx,
                                  prompt)
    first = now + wait + ahead
    return fits and chunk_ok and first <= deadline, pk, first


@njit(**_INLINE)
def _co_admits_memo(j: int, host_tpot: float, curve: np.ndarray, grid: np.ndarray, rem: np.ndarray,
                    csum: np.ndarray, pb: np.ndarray, sa: np.ndarray, n_res: np.ndarray, q_ahead: np.ndarray,
                    busy_until: np.ndarray, cap: np.ndarray, max_seqs: np.ndarray, tg: np.ndarray, kg: np.ndarray,
                    tt: np.ndarray, pg: np.ndarray, pkv: np.ndarray, pt: np.ndarray, memo_key: np.ndarray,
                    memo_val: np.ndarray, ctx: int, prompt: int, r0: int, now: float, deadline: float) -> bool:
    """:func:`_admits`' verdict, co-located, with its time-independent part (:func:`_fits`, :func:`_co_prefill`)
    kept per instance: row ``j`` of ``memo_key`` holds that part's integer inputs (residents, future KV peak,
    queued prompt tokens, context, prompt, KV capacity, batch limit), ``memo_val`` the host TPOT and the result
    (ok 0/1, time to the first token after the wait). A request that pends is offered again at every finish in
    the cluster, and most instances are unchanged in between: the same inputs give the same result, so it is
    reused, and only the wait (the time) is applied again, by the same operations."""
    n = n_res[j]
    pk = future_kv_peak_one(rem, csum, pb, sa, j, n, ctx, r0)
    key, val = memo_key[j], memo_val[j]
    if not (key[0] == n and key[1] == pk and key[2] == q_ahead[j] and key[3] == ctx and key[4] == prompt
            and key[5] == cap[j] and key[6] == max_seqs[j] and val[0] == host_tpot):
        fits, _ = _fits(tg, kg, tt, n + 1, pk, host_tpot, cap[j], max_seqs[j])
        chunk_ok, ahead = _co_prefill(n + 1, pk, host_tpot, curve, grid, q_ahead[j], tg, kg, tt, pg, pkv, pt, ctx,
                                      prompt)
        key[0], key[1], key[2], key[3], key[4], key[5], key[6] = n, pk, q_ahead[j], ctx, prompt, cap[j], max_seqs[j]
        val[0], val[1], val[2] = host_tpot, 1.0 if fits and chunk_ok else 0.0, ahead
    return val[1] == 1.0 and now + _wait(busy_until, j, now) + val[2] <= deadline


@njit(**_INLINE)
def _load(tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, n_res: np.ndarray, kv_now: np.ndarray, j: int) -> float:
    """Load of instance ``j``: the profile time of its current decode batch (0 when empty)."""
    return table_time(tg, kg, tt, float(n_res[j]), float(kv_now[j])) if n_res[j] > 0 else 0.0


@njit(**_JIT)
def verdicts(decode: bool, cand: np.ndarray, curve_of: np.ndarray, host_tpot: np.ndarray, grid: np.ndarray,
             curves: np.ndarray, rem: np.ndarray, csum: np.ndarray, pb: np.ndarray, sa: np.ndarray,
             n_res: np.ndarray, q_ahead: np.ndarray, kv_now: np.ndarray, busy_until: np.ndarray, cap: np.ndarray,
             max_seqs: np.ndarray, tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, pg: np.ndarray, pkv: np.ndarray,
             pt: np.ndarray, ctx: int, prompt: int, r0: int, now: float, deadline: float, xfer: float, ok: np.ndarray,
             load: np.ndarray, peak: np.ndarray, first: np.ndarray) -> None:
    """:func:`_admits` and :func:`_load` of each candidate instance ``cand[m]`` with host TPOT ``host_tpot[m]``
    (token-budget curve: row ``curve_of[m]`` of ``curves``), written to ``ok``, ``load``, ``peak``, ``first``."""
    for m in range(cand.size):
        ok[m], peak[m], first[m] = _admits(
            decode, cand[m], host_tpot[m], curves[curve_of[m]], grid, rem, csum, pb, sa, n_res, q_ahead, kv_now,
            busy_until, cap, max_seqs, tg, kg, tt, pg, pkv, pt, ctx, prompt, r0, now, deadline, xfer)
        load[m] = _load(tg, kg, tt, n_res, kv_now, cand[m])


@njit(**_INLINE)
def _ahead(rank_a: int, load_a: float, rank_b: int, load_b: float) -> bool:
    """Candidate ``a`` comes before ``b`` in the routing rule's preference: a nearer host tier (scale-up last),
    then a higher load (the load gradient). Equal keys keep their instance order (lowest index first)."""
    return rank_a < rank_b or (rank_a == rank_b and load_a > load_b)


@njit(**_JIT)
def place(t: int, n_tiers: int, label: np.ndarray, host_rank: np.ndarray, idle_label: np.ndarray,
          res_tight: np.ndarray, decode: bool, engine_of: np.ndarray, xfer_of: np.ndarray, grid: np.ndarray,
          curves: np.ndarray, row_tpot: np.ndarray, rem: np.ndarray, csum: np.ndarray, pb: np.ndarray,
          sa: np.ndarray, n_res: np.ndarray,
          q_ahead: np.ndarray, kv_now: np.ndarray, busy_until: np.ndarray, cap: np.ndarray, max_seqs: np.ndarray,
          tg: np.ndarray, kg: np.ndarray, tt: np.ndarray, pg: np.ndarray, pkv: np.ndarray, pt: np.ndarray,
          memo_key: np.ndarray, memo_val: np.ndarray, ctx: int, prompt: int, r0: int, now: float,
          deadline: float) -> tuple[int, bool]:
    """Steps 1-3 of PolyServe's routing rule (``PolyServeRouter._place``) for a request of tier ``t`` over all
    instances: returns (instance, scale-up) or (-1, False) when nothing admits.

    Candidates: instances whose label hosts tier ``t`` (``host_rank[label] < NO_HOST``: own tier, then tighter
    ones nearest first -- lazy promotion), else, for a tiered request, idle ones (``idle_label``: pool or
    pending list) whose residents are all of tier >= ``t`` (scale-up, at tier ``t``'s TPOT). Among the admitting
    candidates the nearest host tier wins, scale-up last; within it the highest load (the lowest index on ties):
    the load gradient. So the candidates are put in that order first (the load needs no admission test) and the
    first that admits wins: the admission test, the costly part, runs only until then. ``decode``: decode
    admission, with the KV transfer time ``xfer_of`` of the engine of the first candidate (``engine_of``);
    co-located admission reuses its time-independent part per instance (``memo_key``, ``memo_val``:
    :func:`_co_admits_memo`)."""
    n = label.size
    cand = np.empty(n, np.int64)  # candidate instances, kept sorted by (rank, -load, index): insertion sort
    rank_of = np.empty(n, np.int64)
    load_of = np.empty(n)
    tier_row = t if t < n_tiers - 1 else n_tiers - 1
    xfer = -1.0
    k = 0
    for j in range(n):
        rank = host_rank[label[j]]
        if rank >= NO_HOST and not (t < n_tiers and idle_label[label[j]] and res_tight[j] >= t):
            continue
        if xfer < 0.0:
            xfer = xfer_of[engine_of[j]]
        load = _load(tg, kg, tt, n_res, kv_now, j)
        m = k
        while m > 0 and _ahead(rank, load, rank_of[m - 1], load_of[m - 1]):
            cand[m], rank_of[m], load_of[m] = cand[m - 1], rank_of[m - 1], load_of[m - 1]
            m -= 1
        cand[m], rank_of[m], load_of[m] = j, rank, load
        k += 1
    for m in range(k):
        j = cand[m]
        up = rank_of[m] >= NO_HOST
        row = tier_row if up else (label[j] if label[j] < n_tiers else n_tiers)
        if decode:
            ok, _, _ = _admits(True, j, row_tpot[row], curves[row], grid, rem, csum, pb, sa, n_res, q_ahead, kv_now,
                               busy_until, cap, max_seqs, tg, kg, tt, pg, pkv, pt, ctx, prompt, r0, now, deadline,
                               xfer)
        else:
            ok = _co_admits_memo(j, row_tpot[row], curves[row], grid, rem, csum, pb, sa, n_res, q_ahead, busy_until,
                                 cap, max_seqs, tg, kg, tt, pg, pkv, pt, memo_key, memo_val, ctx, prompt, r0, now,
                                 deadline)
        if ok:
            return j, up
    return -1, False


@njit(**_JIT)
def stale(busy_until: np.ndarray, n_res: np.ndarray, checked: np.ndarray, now: float) -> np.ndarray:
    """Instances whose predicted iteration ended before ``now`` with residents left, not re-read since."""
    out = np.empty(n_res.size, np.int64)
    k = 0
    for j in range(n_res.size):
        if busy_until[j] < now and n_res[j] > 0 and not checked[j]:
            out[k] = j
            k += 1
    return out[:k]


# ============================================================================ disaggregated prefill (§4.2, §4.7)
@njit(**_INLINE)
def dynamic_chunk(remaining: int, budget: int) -> tuple[int, int]:
    """PolyServe's dynamic chunking for disaggregated prefill (§4.7): ``(chunk, budget left)`` of a prompt with
    ``remaining`` tokens to prefill. A prompt that fits takes its remainder and leaves the rest of the budget; one
    whose remainder is below twice the budget is finished in this iteration at once (saving the extra iteration
    of the paper's 1+1024+1024+1 example) and nothing else joins the iteration; a longer one takes one
    budget-sized chunk. (``PolyScheduler._prefill_batch`` forms batches with it, :func:`prefill_finish` predicts
    them with it.)"""
    if remaining <= budget:
        return remaining, budget - remaining
    if remaining < 2 * budget:
        return remaining, 0
    return budget, 0


@njit(**_JIT)
def prefill_finish(left: np.ndarray, past: np.ndarray, budget: int, max_seqs: int, t0: float, tg: np.ndarray,
                   kg: np.ndarray, tt: np.ndarray, fin: np.ndarray) -> None:
    """Predicted prefill end of each queued prompt of a prefill instance (§4.2, §4.7), written to ``fin``.

    ``left[m]`` / ``past[m]``: tokens still to prefill after the iteration in flight / tokens already in the KV,
    of the ``m``-th prompt in the scheduler's order (TTFT deadline first, ``PolyScheduler._deadline_order``).
    From ``t0`` (the end of the iteration in flight) the iterations are formed exactly as
    ``PolyScheduler._prefill_batch`` forms them (dynamic chunking of ``budget``, at most ``max_seqs`` prompts,
    KV memory not limiting), each timed by the prefill profile (``tg`` chunk tokens x ``kg`` past KV the chunk
    attends, token-weighted mean over the batch -> ``tt`` seconds, :func:`table_time`). A prompt ends with the
    iteration that computes its last token."""
    n = left.size
    rem = left.copy()
    done = past.copy()
    t = t0
    for m in range(n):
        if rem[m] == 0:  # its last chunk is in flight
            fin[m] = t0
    first = 0
    while first < n and rem[first] == 0:
        first += 1
    while first < n:
        b, tokens, pairs, seqs, k = budget, 0, 0, 0, first
        while k < n and b > 0 and seqs < max_seqs:
            if rem[k] > 0:
                c, b = dynamic_chunk(rem[k], b)
                tokens += c
                pairs += c * done[k]
                rem[k] -= c
                done[k] += c
                seqs += 1
            k += 1
        t += table_time(tg, kg, tt, float(tokens), pairs / tokens)
        for m in range(first, k):
            if rem[m] == 0 and fin[m] < 0.0:
                fin[m] = t
        while first < n and rem[first] == 0:
            first += 1


@njit(**_JIT)
def prefill_admits(left: np.ndarray, past: np.ndarray, deadline: np.ndarray, new: int, budget: int, max_seqs: int,
                   t0: float, tg: np.ndarray, kg: np.ndarray, tt: np.ndarray) -> tuple[bool, float]:
    """EDF-consistent prefill admission of prompt ``new`` (its index in the scheduler's order of ``left``,
    ``past``, ``deadline``; best-effort prompts carry an infinite deadline and come last): (admitted, its
    predicted first token). It must finish by its TTFT deadline, and every queued prompt predicted on time
    without it must stay on time with it (§4.7 "the highest-load server that can still achieve TTFT"; a prompt
    already predicted late cannot veto). Prompts after the last finite deadline are not simulated."""
    n = left.size
    while n > 0 and deadline[n - 1] == INF and n - 1 != new:
        n -= 1
    with_new = np.full(n, -1.0)
    prefill_finish(left[:n], past[:n], budget, max_seqs, t0, tg, kg, tt, with_new)
    first = with_new[new]
    if first > deadline[new]:
        return False, first
    keep = np.ones(n, np.bool_)
    keep[new] = False
    without = np.full(n - 1, -1.0)
    prefill_finish(left[:n][keep], past[:n][keep], budget, max_seqs, t0, tg, kg, tt, without)
    m = 0
    for k in range(n):
        if k == new:
            continue
        if with_new[k] > deadline[k] and without[m] <= deadline[k]:
            return False, first
        m += 1
    return True, first

"""Compiled per-step work of ``slogym/Batching-v0``: forming the batch from priority scores and building the
candidate features.

A Batching-v0 step looks at up to ``K`` (default ``max_num_seqs + 16`` = 272) candidates. As Python loops
over ``BatchBuilder.take`` and as ~20 small NumPy calls these two jobs cost ~1 ms per step, 10x the
simulator's own work per iteration; each kernel here is one compiled loop over the candidates (Numba,
~1 us to call).

Each kernel reproduces its documented rules exactly (the env's outputs are bit-identical to the
step-by-step Python semantics): integer KV/token arithmetic as in :func:`slogym.core.kernels.take_in_order`,
and every float feature computed in float64 with the same operations, then cast to float32 and clipped.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from slogym.core.kernels import next_deadline
from slogym.core.metrics import verdict
from slogym.core.state import I_GEN, I_KV, I_NC, I_NT, I_SLOT
from slogym.engines.perf_models import analytic_time

_JIT = dict(cache=True, nogil=True, error_model="numpy")  # numpy error model: x/0 gives inf, as in NumPy
RUNNING = 4  # slogym.core.state.Status.RUNNING (a plain int inside compiled code)


@njit(**_JIT)
def form_batch(I: np.ndarray, cands: np.ndarray, sc: np.ndarray, n_run: int, free: int, budget: int,
               block_size: int, preempt_below: float, skip_below: float,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch that scores ``sc`` describe over ``cands`` (the first ``n_run`` of them running); the rules
    are :mod:`slogym.envs.batching`'s. Returns (requests, tokens, preempted) in the order they were chosen.

    1. running candidates scored below ``preempt_below`` are preempted (in candidate order), freeing their KV;
    2. candidates scored ``>= skip_below`` are offered highest score first (ties: candidate order) while the
       token ``budget`` lasts: a prefill gets ``min(remaining, budget left, KV that fits)`` tokens, a decode
       one token; one that gets no token is passed over;
    3. a decode step that needs more KV blocks than are free first preempts, lowest score first, running
       candidates scored in ``[preempt_below, its own score)``.
    """
    n = cands.size
    out = np.zeros(n, np.bool_)  # preempted, by candidate slot
    taken = np.zeros(n, np.bool_)
    pre = np.empty(n, np.int64)
    n_pre = 0
    for i in range(min(n_run, n)):
        if sc[i] < preempt_below:
            out[i] = True
            pre[n_pre] = cands[i]
            n_pre += 1
            free += I[cands[i], I_KV]
    offered = np.nonzero(sc >= skip_below)[0]
    order = offered[np.argsort(-sc[offered], kind="mergesort")]
    victims = np.nonzero(sc[: min(n_run, n)] >= preempt_below)[0]
    victims = victims[np.argsort(sc[victims], kind="mergesort")]
    reqs = np.empty(n, np.int64)
    toks = np.empty(n, np.int64)
    k = 0
    v = 0
    for i in order:
        if budget <= 0:
            break
        if out[i]:
            continue
        r = cands[i]
        nc = I[r, I_NC]
        rem = I[r, I_NT] - nc
        held = I[r, I_KV]
        if rem == 1:
            need = max((nc + block_size) // block_size - held, 0)  # ceil((nc + 1) / block_size) - held
            while need > free and v < victims.size and sc[victims[v]] < sc[i]:
                j = victims[v]
                v += 1
                if not taken[j] and not out[j]:
                    out[j] = True
                    pre[n_pre] = cands[j]
                    n_pre += 1
                    free += I[cands[j], I_KV]
        chunk = min(rem, budget, (free + held) * block_size - nc)
        if chunk < 1:
            continue
        reqs[k] = r
        toks[k] = chunk
        k += 1
        taken[i] = True
        free -= max((nc + chunk + block_size - 1) // block_size - held, 0)
        budget -= chunk
    return reqs[:k], toks[:k], pre[:n_pre]


@njit(**_JIT)
def candidate_features(I: np.ndarray, status: np.ndarray, ready: np.ndarray, cands: np.ndarray, deadline: np.ndarray,
                       now: float, min_tpot: np.ndarray, best_effort: np.ndarray, app: np.ndarray,
                       log_table: np.ndarray, p90_log: np.ndarray, clip: float, out: np.ndarray) -> int:
    """Fill ``out[:n]`` (float32, ``(K, 10)``) with the features of ``Batching-v0``'s ``candidates`` entry.

    Token counts use ``log_table[x]`` (the env's ``log_tokens(x)`` for integer ``x``); when a count is
    beyond the table the kernel stops and returns the table size needed (0 when done).
    """
    size = log_table.size
    for j in range(cands.size):
        r = cands[j]
        nt = I[r, I_NT]
        rem = nt - I[r, I_NC]
        gen = I[r, I_GEN]
        if max(nt, rem, gen) >= size:
            return max(nt, rem, gen) + 1
        if min(nt, rem, gen) < 0:
            raise ValueError("negative token count in the request state")
        slack = deadline[j] - now
        if slack != slack:
            slack = 0.0  # np.nan_to_num(.., posinf=clip): NaN -> 0, +inf -> clip, -inf -> (clipped to) -clip
        elif slack == np.inf:
            slack = clip
        elif slack == -np.inf:
            slack = -clip
        tpot = min_tpot[r] / 0.1
        if tpot == tpot and tpot > clip:  # np.minimum(., clip), NaN kept
            tpot = clip
        feats = (1.0 if status[r] == RUNNING else 0.0, 1.0 if rem == 1 else 0.0, log_table[rem], log_table[nt],
                 log_table[gen], p90_log[app[r]], slack, tpot, now - ready[r], 1.0 if best_effort[r] else 0.0)
        for k in range(10):
            x = np.float32(feats[k])
            out[j, k] = clip if x > clip else -clip if x < -clip else x
    return 0


@njit(**_JIT)
def _clip32(x: float, clip: float) -> np.float32:
    """``np.clip`` of ``x`` cast to float32 (NaN kept)."""
    y = np.float32(x)
    return np.float32(clip) if y > clip else np.float32(-clip) if y < -clip else y


@njit(**_JIT)
def instance_load(I: np.ndarray, run: np.ndarray, wait: np.ndarray, shape: np.ndarray, coef: np.ndarray,
                  memo_nc: np.ndarray, memo_t: np.ndarray, clip: float, out: np.ndarray, stale: np.ndarray) -> int:
    """Fill ``out`` (float32, ``(k, 5)``) with the load features of ``k`` instances (``ServingEnv``'s
    ``INSTANCE_FEATURES``, clipped): instance ``i`` has ``shape[i] = (waiting, running, free KV blocks, total
    KV blocks, max_num_seqs, id)`` at ``shape[6 i: 6 i + 6]``, its waiting requests next in ``wait`` and its
    running ones next in ``run``.

    The decode-step time of instance ``id`` (a pure function of its running count and context) is computed here
    when its perf model has a compiled form: ``coef[id]``, the coefficients of
    :func:`slogym.engines.perf_models.analytic_time` (``Instance.time_coef``; NaN when there is none). Otherwise
    it is remembered in ``memo_nc[id]`` / ``memo_t[id]``: where they no longer match, ``memo_nc`` is updated,
    ``(i, running, context)`` appended to ``stale`` (``(k, 3)``) and ``out[i, 4]`` left for the caller to time.
    Returns how many are stale."""
    n_stale = 0
    w0 = 0
    r0 = 0
    for i in range(shape.size // 6):
        n_wait, n_run, free, total, max_seqs, inst = shape[6 * i: 6 * i + 6]
        queue = 0
        for j in range(w0, w0 + n_wait):
            queue += I[wait[j], I_NT] - I[wait[j], I_NC]
        ctx = n_run
        for j in range(r0, r0 + n_run):
            ctx += I[run[j], I_NC]
        w0 += n_wait
        r0 += n_run
        out[i, 0] = _clip32(queue / 8192.0, clip)
        out[i, 1] = _clip32(n_wait / 64.0, clip)
        out[i, 2] = _clip32(n_run / float(max_seqs), clip)
        out[i, 3] = _clip32(1.0 - free / total if total else 1.0, clip)
        if n_run == 0:
            out[i, 4] = 0.0
        elif coef[inst, 0] == coef[inst, 0]:  # Instance.time_one of BatchFeatures(0, 0, 0, 0, n, n, ctx, ctx, 0)
            out[i, 4] = _clip32(analytic_time(0, 0, 0, n_run, n_run, ctx, coef[inst]) / 0.1, clip)
        elif memo_nc[inst, 0] == n_run and memo_nc[inst, 1] == ctx:
            out[i, 4] = _clip32(memo_t[inst] / 0.1, clip)
        else:
            memo_nc[inst, 0] = n_run
            memo_nc[inst, 1] = ctx
            stale[n_stale, 0] = i
            stale[n_stale, 1] = n_run
            stale[n_stale, 2] = ctx
            n_stale += 1
    return n_stale


@njit(**_JIT)
def resident(status: np.ndarray, I: np.ndarray, lo: int, hi: int, max_scan: int, done: int, waiting: int,
             running: int, shape: np.ndarray, wait: np.ndarray, run: np.ndarray,
             pos: np.ndarray) -> tuple[int, int, int]:
    """What :func:`instance_load` reads, found by scanning the requests ``lo <= r < hi`` (none before ``lo`` is on
    an instance, none from ``hi`` has arrived): each instance's waiting (``status == waiting``) and running
    requests, on instance ``I[r, I_SLOT]`` (its position), grouped by instance into ``wait`` and ``run`` in request
    order (the load features are sums and minima, which the order does not change) and counted into ``shape[6 i]``
    and ``shape[6 i + 1]``; ``pos`` (``2 n`` for ``n`` instances) is scratch. Returns (the first request from ``lo``
    that is not ``done``, where the next scan may start; waiting total; running total), the totals -1 (nothing
    scanned) when more than ``max_scan`` requests would be."""
    while lo < hi and status[lo] == done:
        lo += 1
    if hi - lo > max_scan:
        return lo, -1, -1
    n = shape.size // 6
    pos[:] = 0
    for r in range(lo, hi):
        s = status[r]
        if s == waiting:
            pos[2 * I[r, I_SLOT]] += 1
        elif s == running:
            pos[2 * I[r, I_SLOT] + 1] += 1
    n_wait = n_run = 0
    for i in range(n):  # counts into shape, and pos becomes each instance's first slot in wait / run
        shape[6 * i] = pos[2 * i]
        shape[6 * i + 1] = pos[2 * i + 1]
        pos[2 * i] = n_wait
        pos[2 * i + 1] = n_run
        n_wait += shape[6 * i]
        n_run += shape[6 * i + 1]
    for r in range(lo, hi):
        s = status[r]
        if s == waiting:
            k = 2 * I[r, I_SLOT]
            wait[pos[k]] = r
            pos[k] += 1
        elif s == running:
            k = 2 * I[r, I_SLOT] + 1
            run[pos[k]] = r
            pos[k] += 1
    return lo, n_wait, n_run


@njit(**_JIT)
def arrival_observation(r: int, rows: np.ndarray, app: np.ndarray, tier: np.ndarray, ewma: float, done_frac: float,
                        I: np.ndarray, F: np.ndarray, stage: np.ndarray, ready: np.ndarray, stage_kind: np.ndarray,
                        stage_ttft: np.ndarray, decode: int, slot: np.ndarray, run: np.ndarray, wait: np.ndarray,
                        shape: np.ndarray, coef: np.ndarray, memo_nc: np.ndarray, memo_t: np.ndarray, now: float,
                        clip: float, placed: np.ndarray, out_request: np.ndarray, out_app: np.ndarray,
                        out_tier: np.ndarray, out_recent: np.ndarray, out_instances: np.ndarray, out_slack: np.ndarray,
                        out_since: np.ndarray, stale: np.ndarray) -> int:
    """Fill the arrival observation of request ``r`` (``slogym.envs.arrival``) in one call: ``request``
    (``rows[r]``), one-hot ``app`` and ``tier``, ``recent``, ``instances`` (:func:`instance_load`, whose
    return value this is: instances left to time), ``slack`` (:func:`tier_slack` of the running requests
    ``run`` against their next deadlines, ``RequestState.next_deadline``) and, for Routing-v0, ``placed_since``
    of the ``n`` instances from ``placed`` (``placed[i]``: requests placed when instance ``i`` last received one,
    ``placed[n]``: placed so far; empty for Admission-v0): ``min((placed[n] - placed[i]) / n, clip)`` in float32
    (the count, exact in float32, divided as NumPy divides a float32 array by an int)."""
    out_request[:] = rows[r]
    out_app[:] = 0.0
    out_app[app[r]] = 1.0
    out_tier[:] = 0.0
    out_tier[tier[r]] = 1.0
    out_recent[0] = np.float32(ewma)
    out_recent[1] = np.float32(done_frac)
    out_slack[:] = clip
    if run.size:
        deadline = next_deadline(F, I, stage, ready, stage_kind, stage_ttft, run, decode)
        tier_slack(run, deadline, now, slot, tier, clip, out_slack)
    n = out_since.size
    for i in range(n):
        out_since[i] = min(np.float32(placed[n] - placed[i]) / np.float32(n), np.float32(clip))
    return instance_load(I, run, wait, shape, coef, memo_nc, memo_t, clip, out_instances, stale)


@njit(**_JIT)
def credit(idx: np.ndarray, mode: int, ewma: float, outcome: np.ndarray, arrival: np.ndarray, ttlt: np.ndarray,
           finish: np.ndarray, ttft_slack: np.ndarray, tpot_slack: np.ndarray, dslo_slack: np.ndarray,
           mean_slack: np.ndarray, final_deadline: np.ndarray, no_slo: np.ndarray) -> tuple[int, float]:
    """SLO outcomes of the requests ``idx`` in attainment mode ``mode`` (:func:`slogym.core.metrics.verdict`; the
    arrays are ``verdict_arrays``'): how many met it, and the recent-attainment EWMA (weight 0.05 per outcome)
    after them in time order. ``idx`` is sorted in place by ``finish`` time first (stable: a fast-forwarded or
    piloted instance reports a whole stretch of outcomes at once)."""
    if idx.size > 1:
        idx[:] = idx[np.argsort(finish[idx], kind="mergesort")]
    n_met = 0
    for r in idx:
        m = verdict(r, mode, outcome, arrival, ttlt, finish, ttft_slack, tpot_slack, dslo_slack, mean_slack,
                    final_deadline, no_slo)
        n_met += m
        ewma = 0.95 * ewma + 0.05 * (1.0 if m else 0.0)
    return n_met, ewma


@njit(**_JIT)
def tier_slack(run: np.ndarray, deadline: np.ndarray, now: float, slot: np.ndarray, tier: np.ndarray, clip: float,
               out: np.ndarray) -> None:
    """``out[slot[r], tier[r]]`` = min(itself, float32(clip(deadline - now))) over the running requests ``run``
    (``deadline[j]`` is ``run[j]``'s): each instance's smallest next-token slack per tier, as
    ``np.minimum.at`` (NaN propagates)."""
    for j in range(run.size):
        s = deadline[j] - now
        if s > clip:
            s = clip
        elif s < -clip:
            s = -clip
        x = np.float32(s)
        i, k = slot[run[j]], tier[run[j]]
        o = out[i, k]
        if x != x or o != o:
            out[i, k] = x + o
        elif x < o:
            out[i, k] = x


@njit(**_JIT)
def in_box(a: np.ndarray, bound: float) -> bool:
    """Every entry of ``a`` finite with ``|x| <= bound``."""
    for x in a:
        if not np.isfinite(x) or abs(x) > bound:
            return False
    return True


@njit(**_JIT)
def encode_batch(cands: np.ndarray, members: np.ndarray, preempt: np.ndarray, slot: np.ndarray,
                 out: np.ndarray) -> int:
    """Scores that make :func:`form_batch` rebuild a batch: ``members`` (in batch order) get decreasing
    positive scores ``1 - j * 0.9 / (m + 1)``, ``preempt`` the preempt band ``-1 + j * 0.05 / (p + 1)``, written
    to ``out`` at their candidate slots. ``slot`` (one entry per request, -1 everywhere) is scratch, left as
    found. Returns the position in ``members`` then ``preempt`` of the first request that is no candidate,
    or -1."""
    for i in range(cands.size):
        slot[cands[i]] = i
    missing = -1
    m, p = members.size, preempt.size
    for j in range(m + p):
        r = members[j] if j < m else preempt[j - m]
        if slot[r] < 0:
            missing = j
            break
        if j < m:
            out[slot[r]] = 1.0 - j * (0.9 / (m + 1))
        else:
            out[slot[r]] = -1.0 + (j - m) * (0.05 / (p + 1))
    for i in range(cands.size):
        slot[cands[i]] = -1
    return missing

"""Compiled per-iteration token accounting over the struct-of-arrays request state.

An engine iteration touches a few dozen requests; as NumPy expressions each of these steps is ~20 small-array
calls whose fixed cost (~1-2 us each) dominated the simulator's profile. Each kernel here is one compiled loop
over the batch (Numba, ~0.6 us to call) that updates the ``RequestState`` tables in place.

Every kernel does, per token, exactly the floating-point operations the step-by-step semantics define, in
the same order, so stepping and fast-forwarding (which emits a stretch of tokens with :func:`emit_run`) stay
bit-identical. NaN propagates through min/max as it does in ``np.minimum``/``np.maximum``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, vectorize

from slogym.core.state import (F_DL, F_DSLO, F_FINAL, F_GAP, F_LAST, F_REF, F_SG, F_TPOT, F_TSLACK, I_COMP, I_GEN,
                               I_GEN_STAGE, I_KV, I_NC, I_NT, I_SLEN, I_SLOT)

_JIT = dict(cache=True, nogil=True, error_model="numpy")  # numpy error model: x/0 gives inf, as in NumPy


@njit(**_JIT)
def _fmin(a: float, b: float) -> float:
    if a != a or b != b:
        return a + b  # NaN, as np.minimum
    return a if a <= b else b


@njit(**_JIT)
def _fmax(a: float, b: float) -> float:
    if a != a or b != b:
        return a + b
    return a if a >= b else b


def _decay(ratio: float, alpha: float) -> float:
    if alpha == 1.0:
        return _fmin(ratio, 1.0)
    if alpha == np.inf:
        return 1.0 if ratio >= 1.0 else 0.0
    return _fmin(ratio ** alpha, 1.0)


decay = vectorize(["float64(float64, float64)"], cache=True)(_decay)
"""Tempo's divisive decay f = min{1, (SLO / metric)^alpha} (Eq. 2-3) of ratio = SLO / metric: a ufunc, so
one definition serves the kernels (scalars) and the metrics (arrays)."""
decay_one = njit(**_JIT)(_decay)  # the same, called from Python on one float (a ufunc call costs ~10x more)


@njit(**_JIT)
def _emit_one(F: np.ndarray, I: np.ndarray, r: int, t: float, alpha: float) -> bool:
    """Request ``r`` emits its next output token at ``t``; True when that ends its decode stage."""
    tp = F[r, F_TPOT]
    gap = t - F[r, F_LAST]
    dl = F[r, F_DL] + I[r, I_GEN_STAGE] * tp
    F[r, F_DSLO] = _fmin(F[r, F_DSLO], dl - t)
    F[r, F_FINAL] = dl
    F[r, F_GAP] = _fmax(F[r, F_GAP], gap)
    F[r, F_TSLACK] = _fmin(F[r, F_TSLACK], tp - gap)
    ref = F[r, F_REF]  # Tempo Eq. 3: progress against the deadline line, f = 1 on or ahead of it
    F[r, F_SG] += decay((dl - ref) / (t - ref), alpha)
    F[r, F_LAST] = t
    I[r, I_GEN_STAGE] += 1
    I[r, I_GEN] += 1
    I[r, I_NT] += 1
    return I[r, I_GEN_STAGE] == I[r, I_SLEN]


@njit(**_JIT)
def emit_tokens(F: np.ndarray, I: np.ndarray, dec: np.ndarray, t: float, alpha: float,
                fin: np.ndarray) -> int:
    """Each request of ``dec`` emits a token at ``t``; those ending their stage go to ``fin[:n]``, n returned."""
    n = 0
    for r in dec:
        if _emit_one(F, I, r, t, alpha):
            fin[n] = r
            n += 1
    return n


@njit(**_JIT)
def end_iteration(F: np.ndarray, I: np.ndarray, is_decode_stage: np.ndarray, stage: np.ndarray, idx: np.ndarray,
                  tok: np.ndarray, t: float, alpha: float, fin: np.ndarray, prefilled: np.ndarray,
                  ) -> tuple[int, int, int]:
    """Account a finished iteration: each request computed ``tok`` tokens; those caught up emit a token
    (decode stage) or end their prefill. Returns (tokens computed, n_fin, n_prefilled): ``fin[:n_fin]`` are
    decodes ending their stage and ``prefilled[:n_prefilled]`` prefills caught up, each in batch order."""
    total = 0
    n_fin = 0
    n_pre = 0
    for j in range(idx.size):
        r = idx[j]
        I[r, I_NC] += tok[j]
        I[r, I_COMP] += tok[j]
        total += tok[j]
        if I[r, I_NC] != I[r, I_NT]:
            continue
        if is_decode_stage[stage[r]]:
            if _emit_one(F, I, r, t, alpha):
                fin[n_fin] = r
                n_fin += 1
        else:
            prefilled[n_pre] = r
            n_pre += 1
    return total, n_fin, n_pre


@njit(**_JIT)
def batch_features(I: np.ndarray, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray, block_size: int,
                   blocks: np.ndarray) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """Perf-model features of one batch and its KV: ``blocks[j]`` = blocks request j holds after the
    iteration. ``spec`` has one entry per request (zeros without speculation). Returns (prefill tokens,
    prefill requests, sum chunk*(done+chunk), sum chunk^2, decode requests, decode tokens incl. drafts,
    decode context, total context, spec steps, new blocks needed) -- the fields of ``BatchFeatures`` + 1."""
    p_tok = p_n = p_attn = p_sq = d_n = d_tok = d_ctx = ctx = steps = total = 0
    for j in range(idx.size):
        r = idx[j]
        nc = I[r, I_NC]
        kvb = I[r, I_KV]
        kv_after = nc + tok[j] + spec[j]
        need = (kv_after + block_size - 1) // block_size
        if need < kvb:
            need = kvb
        blocks[j] = need
        total += need - kvb
        ctx += kv_after
        if spec[j] > steps:
            steps = spec[j]
        if I[r, I_NT] - nc == 1:
            d_n += 1
            d_tok += 1 + spec[j]
            d_ctx += kv_after
        else:
            c = tok[j]
            p_tok += c
            p_n += 1
            p_attn += c * (nc + c)
            p_sq += c * c
    return p_tok, p_n, p_attn, p_sq, d_n, d_tok, d_ctx, ctx, steps, total


@njit(**_JIT)
def check_batch(I: np.ndarray, idx: np.ndarray, tok: np.ndarray, inst_id: int, scratch: np.ndarray,
                ) -> tuple[int, int]:
    """Validate a scheduler's batch. Returns (0, 0) if valid, else (code, j) for the first offending
    position j: 1 = not waiting/running on this instance, 2 = tokens outside 1..remaining, 3 = listed twice."""
    for j in range(idx.size):
        r = idx[j]
        if I[r, I_SLOT] != inst_id:
            return 1, j
        if tok[j] < 1 or tok[j] > I[r, I_NT] - I[r, I_NC]:
            return 2, j
        scratch[r] = -1
    for j in range(idx.size):
        r = idx[j]
        if scratch[r] != -1:
            return 3, j
        scratch[r] = j
    return 0, 0


@njit(**_JIT)
def apply_run(F: np.ndarray, I: np.ndarray, idx: np.ndarray, tok: np.ndarray, is_dec: np.ndarray,
              q: np.ndarray, ends: np.ndarray, dts: np.ndarray, busy_time: float, block_size: int, alpha: float,
              ) -> tuple[int, int, float]:
    """Account ``ends.size`` iterations of a steady batch in bulk, exactly as stepping would: prefill chunks
    grow by ``k * tok``; decode request j (in order among the decodes) emits ``q[j]`` tokens at
    ``ends[:q[j]]``; the instance's busy time adds ``dts`` one by one. Returns (tokens computed, new KV blocks,
    busy time)."""
    k = ends.size
    grown = 0
    new_blocks = 0
    jd = 0
    for j in range(idx.size):
        r = idx[j]
        if is_dec[j]:
            g = q[jd]
            jd += 1
            for i in range(g):
                _emit_one(F, I, r, ends[i], alpha)
        else:
            g = k * tok[j]
        I[r, I_NC] += g
        I[r, I_COMP] += g
        grown += g
        need = (I[r, I_NC] + block_size - 1) // block_size - I[r, I_KV]
        if need > 0:
            I[r, I_KV] += need
            new_blocks += need
    for dt in dts:
        busy_time += dt
    return grown, new_blocks, busy_time


@njit(**_JIT)
def admit(status: np.ndarray, first_scheduled: np.ndarray, idx: np.ndarray, t: float, waiting: int, running: int,
          newly: np.ndarray) -> int:
    """Waiting requests of a batch become running (first scheduled at ``t`` if never before); they are
    written to ``newly[:n]`` in batch order, n returned."""
    n = 0
    for r in idx:
        if status[r] == waiting:
            status[r] = running
            if first_scheduled[r] != first_scheduled[r]:  # NaN: never scheduled
                first_scheduled[r] = t
            newly[n] = r
            n += 1
    return n


@njit(**_JIT)
def kv_growth(I: np.ndarray, idx: np.ndarray, tok: np.ndarray, k: int, block_size: int) -> int:
    """KV blocks the requests need beyond what they hold to compute ``k * tok`` more tokens each."""
    total = 0
    for j in range(idx.size):
        r = idx[j]
        need = (I[r, I_NC] + k * tok[j] + block_size - 1) // block_size - I[r, I_KV]
        if need > 0:
            total += need
    return total


@njit(**_JIT)
def steady_stretch(I: np.ndarray, stage: np.ndarray, is_decode_stage: np.ndarray, stage_ptr: np.ndarray,
                   group: np.ndarray, idx: np.ndarray, tok: np.ndarray, through: bool, k_max: int, k_cap: int,
                   is_dec: np.ndarray, q_max: np.ndarray, left: np.ndarray):
    """Plan a fast-forward stretch of a steady batch (the rules are :meth:`Simulator._fast_forward`'s).

    Fills ``is_dec`` (per batch position), and per decode request (in batch order) ``left`` (tokens left in
    its stage) and ``q_max`` (tokens it emits if the stretch runs ``k`` iterations: ``min(left, k)`` when it
    may finish inside the stretch, else ``k``). Returns (k, k_same, n_dec, features): ``k`` < 2 means no
    stretch; a stretch of exactly ``k_same`` iterations is followed by the same batch; ``features`` are the
    nine ``BatchFeatures`` arrays of the ``k`` iterations.
    """
    n_dec = 0
    k_pre = k_max
    for j in range(idx.size):
        r = idx[j]
        rem = I[r, I_NT] - I[r, I_NC]
        in_dec = is_decode_stage[stage[r]]
        if rem == 1 and not in_dec:
            return 0, 0, 0, np.zeros((9, 0), np.int64)  # a prefill's last token: its completion is an event
        is_dec[j] = rem == 1
        if rem == 1:
            left[n_dec] = I[r, I_SLEN] - I[r, I_GEN_STAGE]
            n_dec += 1
        else:
            k_pre = min(k_pre, (rem - 1) // tok[j])
    all_dec = n_dec == idx.size
    k = k_pre
    k_same = 0
    # decodes that may finish inside the stretch: the last stage of a request outside any group
    k_stage = -1
    longest = 0
    jd = 0
    for j in range(idx.size):
        if not is_dec[j]:
            continue
        r = idx[j]
        finishing = through and all_dec and stage[r] == stage_ptr[r + 1] - 1 and group[r] < 0
        q_max[jd] = -1 if finishing else 0  # marker, resolved once k is known
        if not finishing and (k_stage < 0 or left[jd] - 1 < k_stage):
            k_stage = left[jd] - 1
        longest = max(longest, left[jd])
        jd += 1
    if k_stage >= 0:
        if k_stage < k:
            k = k_same = k_stage
    elif n_dec:
        k = min(k, longest)
    k = min(k, k_cap)
    if k < 2:
        return k, k_same, n_dec, np.zeros((9, 0), np.int64)
    feats = np.zeros((9, k), np.int64)
    n_j = feats[4]
    ctx_j = feats[6]
    jd = 0
    for j in range(idx.size):
        if not is_dec[j]:
            continue
        q = min(left[jd], k) if q_max[jd] == -1 else k
        q_max[jd] = q
        c = I[idx[j], I_NC] + 1
        for i in range(q):
            n_j[i] += 1
            ctx_j[i] += c
        jd += 1
    c_sum = c_n = attn0 = csq = kv0 = 0
    for j in range(idx.size):
        if is_dec[j]:
            continue
        c = tok[j]
        p0 = I[idx[j], I_NC]
        c_sum += c
        c_n += 1
        attn0 += c * (p0 + c)
        csq += c * c
        kv0 += p0 + c
    for i in range(k):
        ctx_j[i] += i * n_j[i]
        feats[5, i] = n_j[i]
        feats[7, i] = ctx_j[i]
        if not all_dec:
            feats[0, i] = c_sum
            feats[1, i] = c_n
            feats[2, i] = attn0 + i * csq
            feats[3, i] = csq
            feats[7, i] += kv0 + i * c_sum
    return k, k_same, n_dec, feats


@njit(**_JIT)
def stretch_ends(t: float, dts: np.ndarray, horizon: float) -> tuple[np.ndarray, int]:
    """End times of back-to-back iterations of durations ``dts`` starting at ``t`` (summed one by one, as
    stepping does), and how many end before ``horizon``."""
    ends = np.empty(dts.size)
    k = 0
    for i in range(dts.size):
        t = t + dts[i]
        ends[i] = t
        if t < horizon:
            k = i + 1
    return ends, k


@njit(**_JIT)
def next_deadline(F: np.ndarray, I: np.ndarray, stage: np.ndarray, ready: np.ndarray, stage_kind: np.ndarray,
                  stage_ttft: np.ndarray, idx: np.ndarray, decode: int) -> np.ndarray:
    """:meth:`RequestState.next_deadline`: the next token's deadline in a decode stage, else the TTFT deadline."""
    out = np.empty(idx.size)
    for j in range(idx.size):
        r = idx[j]
        s = stage[r]
        if stage_kind[s] == decode:
            out[j] = F[r, F_DL] + I[r, I_GEN_STAGE] * F[r, F_TPOT]
        else:
            out[j] = ready[r] + stage_ttft[s]
    return out


@njit(**_JIT)
def decode_split(I: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``idx`` split, order kept, into the requests whose next computation is a single token (a decode step,
    prefill caught up) and the rest (still prefilling)."""
    n = 0
    for r in idx:
        n += I[r, I_NT] - I[r, I_NC] == 1
    if n == idx.size:
        return idx, idx[:0]
    dec, pre = np.empty(n, np.int64), np.empty(idx.size - n, np.int64)
    i = j = 0
    for r in idx:
        if I[r, I_NT] - I[r, I_NC] == 1:
            dec[i] = r
            i += 1
        else:
            pre[j] = r
            j += 1
    return dec, pre


@njit(**_JIT)
def decode_kv_growth(I: np.ndarray, idx: np.ndarray, block_size: int) -> int:
    """KV blocks the requests need beyond what they hold to compute one more token each."""
    total = 0
    for r in idx:
        if (I[r, I_NC] + block_size) // block_size > I[r, I_KV]:  # ceil((nc + 1) / bs) > held
            total += (I[r, I_NC] + block_size) // block_size - I[r, I_KV]
    return total


@njit(**_JIT)
def take_in_order(I: np.ndarray, cands: np.ndarray, budget: int, free: int, max_seqs: int, block_size: int,
                  chunked: bool, skip_misfits: bool, n0: int, reqs: np.ndarray, toks: np.ndarray, off: int,
                  whole_prompt_floor: int = -1) -> tuple[int, int, bool, int]:
    """The token-budget loop: give ``cands`` in order tokens within ``budget``, ``free`` KV blocks and
    ``max_seqs`` requests; the rules are :func:`slogym.baselines.common.fill_prefill_chunks`'s. A decode step is
    a chunk of one token. ``n0`` chunks are already in the batch (continuing an earlier call). Writes the n
    requests taken to ``reqs[off:off + n]``/``toks[off:off + n]``; returns (n, blocks used, repeatable, budget
    left). A candidate that does not fit ends the loop, or with ``skip_misfits`` is passed over.

    With ``whole_prompt_floor >= 0`` (chunked only) a prefill is admitted as vLLM v0's block manager admits it
    under Sarathi-Serve: a request holding no KV starts only if the blocks of its whole remaining prefill fit
    with ``whole_prompt_floor`` blocks (the watermark) to spare, and every chunk taken counts its prefill's
    remaining blocks as used, so later candidates of the batch see them reserved."""
    n = 0
    used = 0
    repeatable = False
    for r in cands:
        if budget <= 0 or n >= max_seqs:
            break
        nc = I[r, I_NC]
        rem = I[r, I_NT] - nc
        held = I[r, I_KV]
        fits = (free - used + held) * block_size - nc
        whole = max((nc + rem + block_size - 1) // block_size - held, 0)
        if chunked:
            chunk = min(rem, budget, fits)
            if whole_prompt_floor >= 0 and held == 0 and whole > free - used - whole_prompt_floor:
                chunk = 0
        else:
            chunk = rem if (rem <= budget or n + n0 == 0) and rem <= fits else 0
        if chunk < 1:
            if skip_misfits:
                continue
            break
        repeatable = n + n0 == 0 and chunk == budget and budget < rem and chunk < fits
        reqs[off + n] = r
        toks[off + n] = chunk
        n += 1
        if whole_prompt_floor >= 0:
            used += whole
        else:
            used += max((nc + chunk + block_size - 1) // block_size - held, 0)
        budget -= chunk
    return n, used, repeatable, budget


@njit(**_JIT)
def _pymin(a: float, b: float) -> float:
    return b if b < a else a  # Python's min(a, b), NaN handling included


@njit(**_JIT)
def end_prefill(F: np.ndarray, I: np.ndarray, r: int, t: float, stage: np.ndarray, ready: np.ndarray,
                ttft_slack: np.ndarray, sg_in: np.ndarray, first_token: np.ndarray, stage_t0: np.ndarray,
                stage_ptr: np.ndarray, is_decode_stage: np.ndarray, stage_ttft: np.ndarray,
                stage_tokens: np.ndarray, stage_tpot: np.ndarray, w_in: float, alpha: float, no_tpot: float) -> bool:
    """Request ``r``'s prefill stage caught up at ``t`` (the rules are :meth:`Simulator._end_prefill`'s): TTFT
    slack and input service gain, then the following decode stage's first token. Returns True when a stage
    transition follows (a one-token output, or no decode after the prefill)."""
    s = stage[r]
    due = ready[r] + stage_ttft[s]
    ttft_slack[r] = _pymin(ttft_slack[r], due - t)
    f = decay_one(stage_ttft[s] / (t - ready[r]), alpha)
    sg_in[r] += w_in * stage_tokens[s] * f
    if first_token[r] != first_token[r]:
        first_token[r] = t
    nxt = s + 1
    if nxt >= stage_ptr[r + 1] or not is_decode_stage[nxt]:
        return True
    stage[r] = nxt
    n = stage_tokens[nxt]
    I[r, I_SLEN] = n
    F[r, F_TPOT] = _pymin(stage_tpot[nxt], no_tpot)
    F[r, F_DL] = due
    F[r, F_REF] = ready[r]
    stage_t0[r] = t
    F[r, F_DSLO] = _pymin(F[r, F_DSLO], due - t)
    F[r, F_FINAL] = due
    F[r, F_SG] += f
    F[r, F_LAST] = t
    I[r, I_GEN_STAGE] = 1
    I[r, I_GEN] += 1
    I[r, I_NT] += 1
    return n == 1

"""The compiled pilot: one instance's FCFS-family iterations between events, in one compiled call.

Between two events that can reach an instance (an arrival, a cluster event, another instance's iteration end
when the router is coupled), an instance served by vLLM's or Sarathi-Serve's scheduler only runs iterations:
end the batch in flight, finish requests, form the next batch by the scheduler's token-budget rule, time it,
launch it. Stepping that in Python costs ~25 us per iteration, most of it interpreter overhead around a few
compiled kernels. :func:`run_instance` runs that loop compiled, composed of the same kernels the Python path
calls (:func:`~slogym.core.kernels.end_iteration`, ``end_prefill``, ``take_in_order``, ``decode_kv_growth``,
``batch_features``) in the same order, so the result is bit-identical to stepping (``tests/test_pilot.py``).
It also forms the batch of an instance that is free (a request placed on an idle instance, the scheduler asked
again after a hand-back): ``Simulator._schedule`` calls it with an empty batch in flight and the current time as
the horizon, so it launches exactly the one batch the scheduler would.

The pilot hands control back to the simulator, with the state at a consistent point, whenever the Python
path would do something it does not model: a preemption or an unstick (KV shortage), a request that is not a
plain prompt + decode (tool calls, more stages, collective groups), a waiting queue longer than the head it
was given, or an iteration that ends at or after the horizon (the next event). While the cluster's global queue
waits for a finish, the horizon is the earliest time another instance could finish a request (the floor each
launch reports, :func:`_finish_floor`), and an iteration that may finish one is ended only in the simulator's
heap order (before every other instance's next iteration end).

Parked instances: on a cluster, every busy instance has an iteration end before most arrivals, so an event loop
calling the pilot once per instance pays the call's fixed cost (arguments, results, the heap) several times
per arrival. A launch may instead park the instance (``Simulator._pilot``, :func:`park`): its state stays in
table rows, off the heap, and :func:`run_parked` ends the iteration ends of every parked instance in the heap's
order in one call, each exactly as one pilot call would (same horizon, same next-iteration-end bound). The
simulator unparks an instance when anything else touches it (``slogym.core.instance.ParkedInstance``).

Schedulers opt in with
``pilot_rule`` (:class:`~slogym.baselines.sarathi.SarathiScheduler`, :class:`~slogym.baselines.vllm.VLLMScheduler`),
perf models with ``compiled_time`` (the analytic family).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from slogym.core import kernels
from slogym.core.state import F_TPOT, I_GEN_STAGE, I_KV, I_NC, I_NT, I_SLEN, I_SLOT
from slogym.engines.perf_models import analytic_time

_JIT = dict(cache=True, nogil=True, error_model="numpy")

# rules (``Scheduler.pilot_rule``)
# Sarathi-Serve: every decode first, then prefill chunks in FCFS order within the budget; a request starts when its
# whole prompt fits above the watermark (the fourth entry; -1: when its first chunk fits)
STALL_FREE = 0
PREFILL_FIRST = 1  # vLLM: whole prompts in FCFS order when any fit above the watermark, else one decode step

# results of run_instance
TRANSITIONS = 0  # an iteration ended at ``t``; the stage ends it caused (``buf1[:m]``) are the simulator's to apply
IDLE = 1         # nothing to run: the instance idles at ``t``
SCHEDULE = 2     # the Python scheduler decides the batch at ``t`` (preemption, long queue, bad time)
LAUNCHED = 3     # a batch was launched at ``t`` and ends at ``t_end`` >= horizon

# request status / outcome codes it writes (slogym.core.state.Status / Outcome)
_WAITING, _RUNNING, _DONE = 3, 4, 6
_FINISHED, _BEST_EFFORT = 1, 3


@njit(**_JIT)
def _all_simple(simple: np.ndarray, idx: np.ndarray, n: int) -> bool:
    for j in range(n):
        if not simple[idx[j]]:
            return False
    return True


@njit(**_JIT)
def _remove(running: np.ndarray, n_run: int, r: int) -> int:
    """``running[:n_run]`` without ``r``, order kept (as ``list.remove``); returns the new length."""
    j = 0
    while running[j] != r:
        j += 1
    for k in range(j, n_run - 1):
        running[k] = running[k + 1]
    return n_run - 1


# rows of the int64 work table: running set, finished, batch, its tokens and blocks, stage ends, prefills caught
# up, zeros (no drafts), the waiting head, victims, preemption log (request, tokens thrown away), arrivals
# appended behind the waiting head
W_RUN, W_DONE, W_REQ, W_TOK, W_BLOCKS, W_FIN, W_PRE, W_ZERO, W_WAIT, W_VICT, W_EVR, W_EVNC, W_APP = range(13)
N_ROWS = 13


@njit(**_JIT)
def run_instance(F, I, status, first_scheduled, stage, ready, ttft_slack, sg_in, first_token, stage_t0, mean_slack,
                 outcome, finish, be, recomputed, n_preempt, simple, arrival, group, max_ctx, instance, stage_ptr,
                 is_dec_stage, stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot, idx, tok, running, head,
                 work, ev_t, coef, more_waiting, hand_finishes, free, block_size, inst_id, na, absorb_cap, rule, budget,
                 max_seqs, reserve, t, horizon, busy_time, dt_floor, sync_t, sync_id):
    """End the batch ``idx``/``tok`` in flight at ``t`` and run the instance until the next iteration would end at
    or after ``horizon``, or until the Python path must take over. Scalars travel as arguments (a compiled call
    unboxes a Python int or float in ~35 ns, far less than writing it into an array first).

    ``running`` is the running set in order; ``head`` the first waiting requests (``more_waiting``: the queue is
    longer). Stage ends are applied here only for ``simple`` requests ending their last stage (a plain prompt +
    decode outside any group) and when not ``hand_finishes`` (a finish must wake the cluster's global queue); any
    other makes the iteration end with ``TRANSITIONS`` (the stage ends in ``work[W_FIN, :m]``). With
    ``hand_finishes``, an iteration that may end a stage ends here only if it comes before ``(sync_t, sync_id)``
    (the next iteration end of any other instance, a tie going to the lower instance id as in the simulator's
    heap), so that every instance has reached the finish's time when the simulator acts on it; otherwise it stays
    in flight (``LAUNCHED``) and the simulator ends it in that order. With
    ``absorb_cap`` (the instance's KV capacity in tokens; 0 = off) it also places the arrivals from ``na`` on,
    which the router would send here whatever they are, until one is a group member or too large for the instance
    (the simulator's to route or drop); the horizon then excludes arrivals.

    Returns ``(code, t, t_end, m, n_run, n_wait, n_done, free, iterations, tokens, busy_time, last_dt, n_events, na,
    n_appended, running_changed, same_batch, finish_floor)``: the time it stopped at, the running count
    (``work[W_RUN]``), the new waiting head's length (``work[W_WAIT]``: it replaces ``head``), requests finished
    (``work[W_DONE]``, in order), free KV blocks, iterations ended, tokens computed, preemptions (``ev_t``,
    ``work[W_EVR]``, ``work[W_EVNC]``), the next arrival, arrivals appended behind the head (``work[W_APP]``),
    whether the running set differs from ``running``, whether the launched batch is ``idx``/``tok`` again, and (with
    ``LAUNCHED``) the time before which no request on the instance can finish (:func:`_finish_floor`; ``dt_floor``:
    a lower bound on any iteration's duration). With ``LAUNCHED`` the batch ``work[W_REQ, :m]``/``work[W_TOK, :m]``
    is in flight from ``t`` to ``t_end``.
    """
    run = work[W_RUN]
    run[:running.size] = running
    wq = work[W_WAIT]
    wq[:head.size] = head
    out = _run(F, I, status, first_scheduled, stage, ready, ttft_slack, sg_in, first_token, stage_t0, mean_slack,
               outcome, finish, be, recomputed, n_preempt, simple, arrival, group, max_ctx, instance, stage_ptr,
               is_dec_stage, stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot, idx, tok, run,
               running.size, wq, head.size, more_waiting, hand_finishes, free, block_size, inst_id, rule, budget,
               max_seqs, reserve, na, absorb_cap, coef, t, horizon, sync_t, sync_id, busy_time, work, ev_t)
    m = out[3]
    same = out[0] == LAUNCHED and m == idx.size
    if same:
        for j in range(m):
            if work[W_REQ, j] != idx[j] or work[W_TOK, j] != tok[j]:
                same = False
                break
    floor = -np.inf
    if out[0] == LAUNCHED:
        floor = _finish_floor(I, stage, stage_ptr, is_dec_stage, stage_tokens, work[W_REQ, :m], work[W_TOK, :m],
                              work[W_RUN, :out[4]], out[5] > 0 or more_waiting, out[2], dt_floor)
    return out + (same, floor)


@njit(**_JIT)
def _decode_after(stage, stage_ptr, is_dec_stage, stage_tokens, r) -> int:
    """Output tokens of the decode stage that follows request ``r``'s current prompt (0: none follows)."""
    nxt = stage[r] + 1
    return stage_tokens[nxt] if nxt < stage_ptr[r + 1] and is_dec_stage[nxt] else 0


@njit(**_JIT)
def _tokens_left(I, stage, stage_ptr, is_dec_stage, stage_tokens, r, emits) -> int:
    """Iterations after the one in flight before request ``r`` could end a stage: one per output token it has
    yet to emit (a decode step emits one; a prompt's last chunk emits the first token of the decode after it,
    ``kernels.end_prefill``), a prompt at least one; ``emits``: it emits (or ends its prompt) as the iteration in
    flight ends."""
    if is_dec_stage[stage[r]]:
        return I[r, I_SLEN] - I[r, I_GEN_STAGE] - (1 if emits else 0)
    n = _decode_after(stage, stage_ptr, is_dec_stage, stage_tokens, r)
    return max(n - 1, 0) if emits else max(n, 1)


@njit(**_JIT)
def _may_end_stage(I, stage, stage_ptr, is_dec_stage, stage_tokens, idx, tok) -> bool:
    """Could the batch ``idx``/``tok`` end a request's stage?"""
    for j in range(idx.size):
        if I[idx[j], I_NC] + tok[j] == I[idx[j], I_NT] and _tokens_left(
                I, stage, stage_ptr, is_dec_stage, stage_tokens, idx[j], True) == 0:
            return True
    return False


@njit(**_JIT)
def _finish_floor(I, stage, stage_ptr, is_dec_stage, stage_tokens, req, rtok, running, any_waiting, t_end,
                  dt_floor) -> float:
    """No request on the instance can end a stage before the returned time, whatever happens elsewhere, while
    the batch ``req``/``rtok`` ends at ``t_end`` and every later iteration lasts at least ``dt_floor``
    (:func:`_tokens_left` iterations each; a waiting request needs at least one). Stage ends bound finishes from
    below, so the simulator may run other instances up to this time while the cluster's global queue waits for
    a finish (``Simulator._earliest_finish``)."""
    k = 1 if any_waiting else 1 << 62  # iterations after this one before the earliest stage end
    for j in range(running.size):
        k = min(k, _tokens_left(I, stage, stage_ptr, is_dec_stage, stage_tokens, running[j], False))
    for j in range(req.size):
        if I[req[j], I_NC] + rtok[j] == I[req[j], I_NT]:
            k = min(k, _tokens_left(I, stage, stage_ptr, is_dec_stage, stage_tokens, req[j], True))
    if k == 0:
        return t_end
    if k >= 1 << 62:  # nothing resident (a launched batch always is; kept for safety)
        return np.inf
    # each of the k iteration ends is rounded once (half an ulp of the time): the margin keeps the bound below
    floor = t_end + k * dt_floor
    return floor - (k + 1) * (4.0 * np.finfo(np.float64).eps * floor + 1e-9 * dt_floor)


@njit(**_JIT)
def _run(F, I, status, first_scheduled, stage, ready, ttft_slack, sg_in, first_token, stage_t0, mean_slack, outcome,
         finish, be, recomputed, n_preempt, simple, arrival, group, max_ctx, instance, stage_ptr, is_dec_stage,
         stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot, idx, tok, running, n_run, wq, n_wq,
         more_waiting, hand_finishes, free, block_size, inst_id, rule, budget, max_seqs, reserve, na, absorb_cap, coef,
         t, horizon, sync_t, sync_id, busy_time, work, ev_t):
    """:func:`run_instance`'s event loop; returns ``(code, t, t_end, m, n_run, n_wq, n_done, free, iterations,
    tokens, busy_time, last_dt, n_events, na, n_appended, running_changed)``. With ``absorb_cap`` (the instance's
    KV capacity in tokens; 0 = off) it also takes the arrivals from ``na`` on that the router sends here whatever
    they are."""
    done, req, rtok, blocks = work[W_DONE], work[W_REQ], work[W_TOK], work[W_BLOCKS]
    buf1, buf2, no_spec, vict, app = work[W_FIN], work[W_PRE], work[W_ZERO], work[W_VICT], work[W_APP]
    n_done = iters = tokens = n_ev = n_app = m = 0
    last_dt = 0.0
    run_chg = False  # the running set changed (a finish, a preemption, an admission)
    t_end = t  # the batch idx/tok in flight ends now
    in_flight = True
    while True:
        # ---- the next event: the batch in flight ends (first on a tie), or the next arrival (when absorbing)
        ta = np.inf
        if absorb_cap and na < arrival.size:
            if group[na] >= 0 or max_ctx[na] > absorb_cap:  # a group member or a drop: the simulator's
                horizon = min(horizon, arrival[na])
                absorb_cap = 0
            else:
                ta = arrival[na]
        if in_flight and t_end <= ta:
            if iters and (not t_end < horizon or hand_finishes and not (
                    t_end < sync_t or t_end == sync_t and inst_id < sync_id) and _may_end_stage(
                    I, stage, stage_ptr, is_dec_stage, stage_tokens, idx, tok)):
                return LAUNCHED, t, t_end, m, n_run, n_wq, n_done, free, iters, tokens, busy_time, last_dt, n_ev, \
                    na, n_app, run_chg
            t = t_end
            in_flight = False
            computed, n_tr = _end_iteration(F, I, stage, ready, ttft_slack, sg_in, first_token, stage_t0, stage_ptr,
                                            is_dec_stage, stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot,
                                            idx, tok, t, buf1, buf2)
            iters += 1
            tokens += computed
            if n_tr and (hand_finishes or not _all_simple(simple, buf1, n_tr)):
                return TRANSITIONS, t, t, n_tr, n_run, n_wq, n_done, free, iters, tokens, busy_time, last_dt, \
                    n_ev, na, n_app, run_chg
            for k in range(n_tr):  # each ends its last stage (a plain request): _end_decode_stage, then _done
                r = buf1[k]
                gaps = I[r, I_SLEN] - 1
                if is_dec_stage[stage[r]] and gaps > 0:
                    mean_slack[r] = kernels._pymin(mean_slack[r], F[r, F_TPOT] - (t - stage_t0[r]) / gaps)
                free += _release(I, running, n_run, r)
                n_run -= 1
                run_chg = True
                status[r] = _DONE
                outcome[r] = _BEST_EFFORT if be[r] else _FINISHED
                finish[r] = t
                done[n_done] = r
                n_done += 1
        elif ta < horizon:  # Simulator._begin / _place: the request joins the back of the waiting queue
            t = ta
            r = na
            na += 1
            ready[r] = t
            I[r, I_NT] = I[r, I_SLEN]
            instance[r] = inst_id
            I[r, I_SLOT] = inst_id
            status[r] = _WAITING
            if more_waiting:
                app[n_app] = r
                n_app += 1
            else:
                wq[n_wq] = r
                n_wq += 1
            if in_flight:
                continue
        else:
            return (LAUNCHED if in_flight else IDLE), t, t_end, m, n_run, n_wq, n_done, free, iters, tokens, \
                busy_time, last_dt, n_ev, na, n_app, run_chg
        # ---- the instance is free at t: the next batch (the scheduler's rule; Simulator._schedule)
        while True:
            if n_run == 0 and n_wq == 0:
                m = 0
                if more_waiting:
                    return SCHEDULE, t, t, 0, n_run, n_wq, n_done, free, iters, tokens, busy_time, last_dt, n_ev, \
                        na, n_app, run_chg
                break
            # buf2 and blocks serve as _form's scratch: both are rewritten only after it (end, batch features)
            m, n_vict = _form(I, arrival, running, n_run, wq[:n_wq], more_waiting, free, block_size, rule, budget,
                              max_seqs, reserve, req, rtok, vict, buf2, blocks)
            if m < 0 or n_ev + n_vict > ev_t.size:
                return SCHEDULE, t, t, 0, n_run, n_wq, n_done, free, iters, tokens, busy_time, last_dt, n_ev, \
                    na, n_app, run_chg
            for k in range(n_vict):  # Simulator._preempt: recompute later, back to the front of the queue
                v = vict[k]
                recomputed[v] += I[v, I_NC]
                n_preempt[v] += 1
                ev_t[n_ev] = t
                work[W_EVR, n_ev] = v
                work[W_EVNC, n_ev] = I[v, I_NC]
                n_ev += 1
                free += _release(I, running, n_run, v)
                n_run -= 1
                run_chg = True
                status[v] = _WAITING
                I[v, I_SLOT] = inst_id
                for j in range(n_wq, 0, -1):
                    wq[j] = wq[j - 1]
                wq[0] = v
                n_wq += 1
            if m > 0 or n_vict == 0:
                break
        if m == 0:  # idle until the next event
            continue
        b_req, b_tok = req[:m], rtok[:m]
        p_tok, p_n, p_attn, _, d_n, d_tok, d_ctx, _, _, total = kernels.batch_features(
            I, b_req, b_tok, no_spec[:m], block_size, blocks)
        dt = analytic_time(p_tok, p_n, p_attn, d_n, d_tok, d_ctx, coef)
        if total > free or not dt > 0.0:
            return SCHEDULE, t, t, 0, n_run, n_wq, n_done, free, iters, tokens, busy_time, last_dt, n_ev, na, \
                n_app, run_chg
        # ---- launch (Simulator._launch / _admit): the admitted requests were a prefix of the waiting queue
        # when the batch was formed; this round's victims went in front of them since
        n_adm = 0
        for j in range(m):
            r = b_req[j]
            I[r, I_KV] = blocks[j]
            if status[r] == _WAITING:
                status[r] = _RUNNING
                if first_scheduled[r] != first_scheduled[r]:
                    first_scheduled[r] = t
                running[n_run] = r
                n_run += 1
                n_adm += 1
        if n_adm:
            run_chg = True
            n_wq -= n_adm
            for j in range(n_vict, n_wq):
                wq[j] = wq[j + n_adm]
        free -= total
        busy_time += dt
        last_dt = dt
        t_end = t + dt
        in_flight = True
        idx, tok = b_req, b_tok


@njit(**_JIT)
def _end_iteration(F, I, stage, ready, ttft_slack, sg_in, first_token, stage_t0, stage_ptr, is_dec_stage, stage_ttft,
                   stage_tokens, stage_tpot, w_in, alpha, no_tpot, idx, tok, t, buf1, buf2) -> tuple[int, int]:
    """Simulator._on_iteration_done's accounting: tokens computed, and the stage ends it causes (``buf1``, in the
    order the simulator applies them: decodes, then prefills caught up)."""
    computed, n_fin, n_pre = kernels.end_iteration(F, I, is_dec_stage, stage, idx, tok, t, alpha, buf1, buf2)
    n_tr = n_fin
    for k in range(n_pre):
        r = buf2[k]
        if kernels.end_prefill(F, I, r, t, stage, ready, ttft_slack, sg_in, first_token, stage_t0, stage_ptr,
                               is_dec_stage, stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot):
            buf1[n_tr] = r
            n_tr += 1
    return computed, n_tr


@njit(**_JIT)
def _release(I, running, n_run, r) -> int:
    """``r`` leaves the running set and drops its KV (Simulator._release); returns the blocks freed."""
    kv = I[r, I_KV]
    I[r, I_KV] = 0
    I[r, I_NC] = 0
    I[r, I_SLOT] = -1
    _remove(running, n_run, r)
    return kv


@njit(**_JIT)
def _form(I, arrival, running, n_run, cands, more_waiting, free, block_size, rule, budget, max_seqs, reserve, req,
          rtok, vict, pre, scratch):
    """The next batch into ``req``/``rtok`` by ``rule`` (``cands``: the waiting head) and the running requests it
    preempts first into ``vict`` (``pre``, ``scratch``: work rows). Returns (batch size, victims): an empty batch
    with no victims idles; size -1 means the Python scheduler must decide (it needs waiting requests beyond the
    head)."""
    if n_run == 0 and reserve > 0:  # the watermark protects running requests only (see VLLMScheduler)
        reserve = 0
    n_dec = 0
    n_pre = 0
    for j in range(n_run):  # decode-ready first (in running order), prefilling after (split_running)
        r = running[j]
        if I[r, I_NT] - I[r, I_NC] == 1:
            req[n_dec] = r
            rtok[n_dec] = 1
            n_dec += 1
        else:
            pre[n_pre] = r
            n_pre += 1
    if rule == PREFILL_FIRST and (n_pre or cands.size or more_waiting):
        got = _chunks(I, pre[:n_pre], cands, more_waiting, budget, free - reserve, max_seqs - n_dec, block_size,
                      False, -1, req, rtok, n_dec)
        if got:  # a prefill-only batch (or -1): move it to the front
            for j in range(got):
                req[j] = req[n_dec + j]
                rtok[j] = rtok[n_dec + j]
            return got, 0
    if n_dec == 0 and (rule == PREFILL_FIRST or n_pre == 0 and cands.size == 0 and not more_waiting):
        return _unstick(arrival, running, n_run, vict)
    n_keep, n_vict, free = _make_room(I, arrival, req, n_dec, pre, n_pre, free, block_size, vict, scratch)
    if rule == PREFILL_FIRST:
        return n_keep, n_vict
    if n_vict:  # the victims leave the prefill candidates
        k = 0
        for j in range(n_pre):
            if not _contains(vict, n_vict, pre[j]):
                pre[k] = pre[j]
                k += 1
        n_pre = k
    if n_pre == 0 and cands.size == 0 and not more_waiting:
        return n_keep, n_vict
    got = _chunks(I, pre[:n_pre], cands, more_waiting, budget - n_keep, free, max_seqs - n_keep, block_size, True,
                  reserve, req, rtok, n_keep)
    if got < 0:
        return -1, 0
    if n_keep + got == 0 and n_vict == 0:
        return _unstick(arrival, running, n_run, vict)
    return n_keep + got, n_vict


@njit(**_JIT)
def _contains(a, n, v) -> bool:
    for j in range(n):
        if a[j] == v:
            return True
    return False


@njit(**_JIT)
def _unstick(arrival, running, n_run, vict):
    """Nothing fits: preempt the latest-arrived running request (the first of them in running order), or idle."""
    if n_run == 0:
        return 0, 0
    best = running[0]
    for j in range(1, n_run):
        if arrival[running[j]] > arrival[best]:
            best = running[j]
    vict[0] = best
    return 0, 1


@njit(**_JIT)
def _make_room(I, arrival, dec, n_dec, pre, n_pre, free, block_size, vict, alive):
    """:func:`slogym.baselines.common.make_room_for_decodes` with the arrival time as the victim key: preempt
    running requests, latest arrival first, until every remaining decode of ``dec[:n_dec]`` can grow by one
    token. Compacts the survivors in ``dec`` (order kept; ``alive``: scratch); returns (survivors, victims, KV
    blocks left)."""
    total = kernels.decode_kv_growth(I, dec[:n_dec], block_size)
    if total <= free:
        return n_dec, 0, free - total
    n = n_dec + n_pre
    alive[:n] = 1
    n_vict = 0
    while total > free and n_vict < n:
        # Python's sorted(pool, key=arrival).pop() over pool = decodes + prefilling: the latest arrival, and of
        # equal ones the last in pool order (a few victims per call: selection beats sorting the pool)
        j_best = -1
        for j in range(n):
            if alive[j] and (j_best < 0 or arrival[_pool(dec, pre, n_dec, j)] >= arrival[
                    _pool(dec, pre, n_dec, j_best)]):
                j_best = j
        v = _pool(dec, pre, n_dec, j_best)
        vict[n_vict] = v
        n_vict += 1
        free += I[v, I_KV]
        alive[j_best] = 0
        if j_best < n_dec:
            need = (I[v, I_NC] + block_size) // block_size - I[v, I_KV]
            total -= need if need > 0 else 0
    n_keep = 0
    for j in range(n_dec):
        if alive[j]:
            dec[n_keep] = dec[j]
            n_keep += 1
    return n_keep, n_vict, free - total


@njit(**_JIT)
def _pool(dec, pre, n_dec, j) -> int:
    return dec[j] if j < n_dec else pre[j - n_dec]


@njit(**_JIT)
def _chunks(I, pre, cands, more_waiting, budget, free, max_seqs, block_size, chunked, floor, req, rtok, off) -> int:
    """Prefill chunks for ``pre`` then ``cands`` (in order) at ``req[off:]`` by ``take_in_order``'s rule (``floor``:
    its ``whole_prompt_floor``); -1 when every candidate was taken with budget and slots left and the waiting queue
    goes on beyond ``cands``."""
    got = 0
    used = 0
    left = budget
    for part in (pre, cands):
        if left <= 0 or got >= max_seqs:
            break
        n, u, _, left = kernels.take_in_order(I, part, left, free - used, max_seqs - got, block_size, chunked,
                                              False, got, req, rtok, off + got, floor)
        got += n
        used += u
        if n < part.size:
            return got
    if more_waiting and left > 0 and got < max_seqs:
        return -1
    return got


# ====================================================================== parked instances
# An instance whose batch in flight the pilot launched may stay "parked": its state lives in the rows of the
# tables below (``Simulator._pk_*``) instead of its ``Instance`` object and the simulator's heap, and
# :func:`run_parked` advances every parked instance in one compiled call. Columns of the int table ``pi`` and
# the float table ``pf`` (one row per instance id):
PI_ON, PI_FREE, PI_NRUN, PI_NWAIT, PI_M, PI_SEQ, PI_ITERS, PI_TOKENS, PI_BLOCK, PI_RULE, PI_BUDGET, PI_SEQS, \
    PI_RESERVE = range(13)
PF_TEND, PF_BUSY, PF_LASTDT, PF_FLOOR, PF_AFTER, PF_DTFLOOR = range(6)
N_PI, N_PF = 13, 6


@njit(**_JIT)
def precedes(t, i, t2, i2) -> bool:
    """Iteration end ``(t, i)`` comes before ``(t2, i2)`` in the simulator's heap order (a tie in time goes to the
    lower instance id)."""
    return t < t2 or t == t2 and i < i2


@njit(**_JIT)
def next_parked(pi, pf) -> tuple[float, int]:
    """The earliest iteration end of a parked instance and its id; (inf, -1) when none is parked."""
    t, k = np.inf, -1
    for j in range(pi.shape[0]):
        if pi[j, PI_ON] and (k < 0 or precedes(pf[j, PF_TEND], j, t, k)):
            t, k = pf[j, PF_TEND], j
    return t, k


@njit(**_JIT)
def parked_waiting_tokens(pi, p_wait, I, out) -> None:
    """``out[i]`` = tokens the waiting requests of parked instance ``i`` have yet to compute."""
    for i in range(pi.shape[0]):
        if pi[i, PI_ON]:
            n = 0
            for j in range(pi[i, PI_NWAIT]):
                r = p_wait[i, j]
                n += I[r, I_NT] - I[r, I_NC]
            out[i] = n


@njit(**_JIT)
def parked_finish(pi, pf) -> float:
    """The earliest time a request on a parked instance could finish (``Simulator._earliest_finish``)."""
    h = np.inf
    for j in range(pi.shape[0]):
        if pi[j, PI_ON]:
            h = min(h, max(pf[j, PF_TEND], pf[j, PF_FLOOR]))
    return h


@njit(**_JIT)
def park(pi, pf, coefs, p_run, p_wait, p_req, p_tok, work, i, n_run, n_wait, m, free, seq, iterations, tokens,
         t_end, busy_time, last_dt, floor, dt_floor, coef, block_size, rule, budget, max_seqs, reserve) -> None:
    """Park instance ``i`` after :func:`run_instance` launched ``work[W_REQ/W_TOK, :m]``: its running set
    (``work[W_RUN]``), whole waiting queue (``work[W_WAIT]``), counters and scheduler rule move into row ``i``."""
    p_run[i, :n_run] = work[W_RUN, :n_run]
    p_wait[i, :n_wait] = work[W_WAIT, :n_wait]
    p_req[i, :m] = work[W_REQ, :m]
    p_tok[i, :m] = work[W_TOK, :m]
    coefs[i] = coef
    row = pi[i]
    row[PI_ON], row[PI_FREE], row[PI_NRUN], row[PI_NWAIT], row[PI_M], row[PI_SEQ] = 1, free, n_run, n_wait, m, seq
    row[PI_ITERS], row[PI_TOKENS], row[PI_BLOCK], row[PI_RULE] = iterations, tokens, block_size, rule
    row[PI_BUDGET], row[PI_SEQS], row[PI_RESERVE] = budget, max_seqs, reserve
    f = pf[i]
    f[PF_TEND], f[PF_BUSY], f[PF_LASTDT], f[PF_FLOOR] = t_end, busy_time, last_dt, floor
    f[PF_AFTER], f[PF_DTFLOOR] = t_end + dt_floor, dt_floor


@njit(**_JIT)
def enqueue_parked(pi, pf, p_wait, i, r, cap) -> bool:
    """``Simulator._enqueue`` of request ``r`` (no KV held) at the back of parked instance ``i``'s waiting queue;
    False when its row is full (the simulator unparks it first)."""
    n = pi[i, PI_NWAIT]
    if n + pi[i, PI_NRUN] >= cap:
        return False
    p_wait[i, n] = r
    pi[i, PI_NWAIT] = n + 1
    if pf[i, PF_FLOOR] > pf[i, PF_AFTER]:  # it could finish in the instance's next iteration
        pf[i, PF_FLOOR] = pf[i, PF_AFTER]
    return True


@njit(**_JIT)
def run_parked(F, I, status, first_scheduled, stage, ready, ttft_slack, sg_in, first_token, stage_t0, mean_slack,
               outcome, finish, be, recomputed, n_preempt, simple, arrival, group, max_ctx, instance, stage_ptr,
               is_dec_stage, stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot, pi, pf, coefs, p_run, p_wait,
               p_req, p_tok, work, ev_t, ti, hid, tg, ta, ef_heap, queued, seq):
    """The simulator's event loop over the parked instances' iteration ends, each run by :func:`run_instance`'s
    loop as ``Simulator._pilot`` would run it, in the heap's order, while the earliest comes before the heap's
    next iteration end ``(ti, hid)`` (a tie goes to the lower id), the next cluster event ``tg`` and the next
    arrival ``ta`` (an iteration end comes first on a tie with either). Each gets the horizon and the next other
    iteration end ``Simulator._pilot`` would give it: the next event, and with ``queued`` (the global queue waits
    for a finish) the earliest finish elsewhere (``ef_heap`` on the heap's instances, the floors of the other
    parked ones).

    Returns ``(code, k, t, m, n_done, n_events, iterations, seq, t_next, k_next)``: the finished requests of all of
    them in order (``work[W_RUN, :n_done]``). ``k`` = -1 (code ``LAUNCHED``): every parked instance is past the
    bounds. Else instance ``k`` stopped at ``t``: with a code other than ``LAUNCHED`` (its row holds the state
    after its run; ``TRANSITIONS``: stage ends in ``work[W_FIN, :m]``) the simulator unparks it and takes over;
    with ``LAUNCHED`` it stays parked and logged ``n_events`` preemptions (``ev_t``, ``work[W_EVR/W_EVNC]``).
    ``(t_next, k_next)``: :func:`next_parked` after the call, except when ``k`` is to be unparked."""
    acc = work[W_RUN]  # run_parked passes the rows of p_run to _run, so W_RUN is free to collect finishes
    n_acc = iters_all = 0
    t = np.inf
    n_inst = pi.shape[0]
    while True:
        tk, k = next_parked(pi, pf)
        if k < 0 or not precedes(tk, k, ti, hid) or tk > tg or tk > ta:
            return LAUNCHED, -1, t, 0, n_acc, 0, iters_all, seq, tk, k
        horizon = min(ta, tg)
        sync_t, sync_id, ef = ti, hid, ef_heap
        for j in range(n_inst):
            if j != k and pi[j, PI_ON]:
                tj = pf[j, PF_TEND]
                if precedes(tj, j, sync_t, sync_id):
                    sync_t, sync_id = tj, j
                ef = min(ef, max(tj, pf[j, PF_FLOOR]))
        if queued:
            horizon = min(horizon, ef)
        row, f = pi[k], pf[k]
        m = row[PI_M]
        out = _run(F, I, status, first_scheduled, stage, ready, ttft_slack, sg_in, first_token, stage_t0, mean_slack,
                   outcome, finish, be, recomputed, n_preempt, simple, arrival, group, max_ctx, instance, stage_ptr,
                   is_dec_stage, stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot, p_req[k, :m],
                   p_tok[k, :m], p_run[k], row[PI_NRUN], p_wait[k], row[PI_NWAIT], False, queued, row[PI_FREE],
                   row[PI_BLOCK], k, row[PI_RULE], row[PI_BUDGET], row[PI_SEQS], row[PI_RESERVE], 0, 0, coefs[k], tk,
                   horizon, sync_t, sync_id, f[PF_BUSY], work, ev_t)
        code, t, t_end, m, n_run, n_wq, n_done, free, iters, tokens, busy_time, last_dt, n_ev = out[:13]
        acc[n_acc:n_acc + n_done] = work[W_DONE, :n_done]
        n_acc += n_done
        iters_all += iters
        row[PI_FREE], row[PI_NRUN], row[PI_NWAIT] = free, n_run, n_wq
        row[PI_ITERS] += iters
        row[PI_TOKENS] += tokens
        f[PF_BUSY] = busy_time
        row[PI_M] = m
        if code != LAUNCHED:  # the Python path takes over (Simulator._pilot's tail)
            if iters > 1:
                f[PF_LASTDT] = last_dt
            return code, k, t, m, n_acc, n_ev, iters_all, seq, np.inf, -1
        p_req[k, :m] = work[W_REQ, :m]
        p_tok[k, :m] = work[W_TOK, :m]
        seq += 1
        row[PI_SEQ] = seq
        f[PF_TEND], f[PF_LASTDT], f[PF_AFTER] = t_end, last_dt, t_end + f[PF_DTFLOOR]
        f[PF_FLOOR] = _finish_floor(I, stage, stage_ptr, is_dec_stage, stage_tokens, p_req[k, :m], p_tok[k, :m],
                                    p_run[k, :n_run], n_wq > 0, t_end, f[PF_DTFLOOR])
        if n_ev:
            tk, k2 = next_parked(pi, pf)
            return code, k, t, m, n_acc, n_ev, iters_all, seq, tk, k2

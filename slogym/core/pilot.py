"""The compiled pilot: one instance's FCFS-family iterations between events, in one compiled call.

Between two events that can reach an instance (an arrival, a cluster event, another instance's iteration end
when the router is coupled), an instance served by vLLM's or Sarathi-Serve's scheduler only runs iterations:
end the batch in flight, finish requests, form the next batch by the scheduler's token-budget rule, time it,
launch it. Stepping that in Python costs ~25 us per iteration, most of it interpreter overhead around a few
compiled kernels. :func:`run_instance` runs that loop compiled, composed of the same kernels the Python path
calls (:func:`~slogym.core.kernels.end_iteration`, ``end_prefill``, ``take_in_order``, ``decode_kv_growth``,
``batch_features``) in the same order, so the result is bit-identical to stepping (``tests/test_pilot.py``).

The pilot hands control back to the simulator, with the state at a consistent point, whenever the Python
path would do something it does not model: a preemption or an unstick (KV shortage), a request that is not a
plain prompt + decode (tool calls, more stages, collective groups), a waiting queue longer than the head it
was given, or an iteration that ends at or after the horizon (the next event). Schedulers opt in with
``pilot_rule`` (:class:`~slogym.baselines.sarathi.SarathiScheduler`, :class:`~slogym.baselines.vllm.VLLMScheduler`),
perf models with ``compiled_time`` (the analytic family).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from slogym.core import kernels
from slogym.core.state import F_TPOT, I_KV, I_NC, I_NT, I_SLEN, I_SLOT
from slogym.engines.perf_models import analytic_time

_JIT = dict(cache=True, nogil=True, error_model="numpy")

# rules (``Scheduler.pilot_rule``)
STALL_FREE = 0    # Sarathi-Serve: every decode first, then prefill chunks in FCFS order within the budget
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
def _pymin(a: float, b: float) -> float:
    return b if b < a else a  # Python's min(a, b)


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


@njit(**_JIT)
def run_instance(F, I, status, first_scheduled, stage, ready, ttft_slack, sg_in, first_token, stage_t0, mean_slack,
                 outcome, finish, be, simple, stage_ptr, is_dec_stage, stage_ttft, stage_tokens, stage_tpot,
                 w_in, alpha, no_tpot, idx, tok, running, n_run, head, more_waiting, hand_finishes, free, block_size,
                 rule, budget, max_seqs, reserve, coef, t, horizon, busy_time, done, req, rtok, blocks, buf1, buf2,
                 no_spec):
    """End the batch ``idx``/``tok`` in flight at ``t`` and run the instance until the next iteration would end
    at or after ``horizon``, or until the Python path must take over.

    ``running[:n_run]`` is the running set in order (updated in place); ``head`` the first waiting requests
    (``more_waiting``: the queue is longer). Stage ends are applied here only for ``simple`` requests ending
    their last stage (a plain prompt + decode outside any group) and when not ``hand_finishes`` (a finish must
    wake the cluster's global queue); any other makes the iteration end with ``TRANSITIONS``.
    Returns ``(code, t, t_end, m, n_run, n_admitted, n_done, free, iterations, tokens, busy_time, last_dt)``:
    ``done[:n_done]`` finished in order, ``n_admitted`` requests left the front of the waiting queue, and with
    ``LAUNCHED`` the batch ``req[:m]``/``rtok[:m]`` is in flight from ``t`` to ``t_end``.
    """
    n_adm = n_done = iters = tokens = 0
    last_dt = 0.0
    while True:
        # ---- the iteration in flight ends at t (Simulator._on_iteration_done)
        iters += 1
        computed, n_fin, n_pre = kernels.end_iteration(F, I, is_dec_stage, stage, idx, tok, t, alpha, buf1, buf2)
        tokens += computed
        n_tr = n_fin
        for k in range(n_pre):
            r = buf2[k]
            if kernels.end_prefill(F, I, r, t, stage, ready, ttft_slack, sg_in, first_token, stage_t0, stage_ptr,
                                   is_dec_stage, stage_ttft, stage_tokens, stage_tpot, w_in, alpha, no_tpot):
                buf1[n_tr] = r
                n_tr += 1
        if n_tr and (hand_finishes or not _all_simple(simple, buf1, n_tr)):
            return TRANSITIONS, t, t, n_tr, n_run, n_adm, n_done, free, iters, tokens, busy_time, last_dt
        for k in range(n_tr):  # each ends its last stage (a plain request): _end_decode_stage, then _done
            r = buf1[k]
            gaps = I[r, I_SLEN] - 1
            if is_dec_stage[stage[r]] and gaps > 0:
                mean_slack[r] = _pymin(mean_slack[r], F[r, F_TPOT] - (t - stage_t0[r]) / gaps)
            free += I[r, I_KV]
            I[r, I_KV] = 0
            I[r, I_NC] = 0
            I[r, I_SLOT] = -1
            n_run = _remove(running, n_run, r)
            status[r] = _DONE
            outcome[r] = _BEST_EFFORT if be[r] else _FINISHED
            finish[r] = t
            done[n_done] = r
            n_done += 1
        # ---- the next batch (the scheduler's rule)
        cands = head[n_adm:]
        if n_run == 0 and cands.size == 0:
            return (SCHEDULE if more_waiting else IDLE), t, t, 0, n_run, n_adm, n_done, free, iters, tokens, \
                busy_time, last_dt
        m = _form(I, running, n_run, cands, more_waiting, free, block_size, rule, budget, max_seqs, reserve, req,
                  rtok)
        if m <= 0:
            return (IDLE if m == 0 else SCHEDULE), t, t, 0, n_run, n_adm, n_done, free, iters, tokens, busy_time, \
                last_dt
        b_req, b_tok = req[:m], rtok[:m]
        p_tok, p_n, p_attn, _, d_n, d_tok, d_ctx, _, _, total = kernels.batch_features(
            I, b_req, b_tok, no_spec[:m], block_size, blocks)
        dt = analytic_time(p_tok, p_n, p_attn, d_n, d_tok, d_ctx, coef)
        if total > free or not dt > 0.0:
            return SCHEDULE, t, t, 0, n_run, n_adm, n_done, free, iters, tokens, busy_time, last_dt
        # ---- launch (Simulator._launch / _admit)
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
        free -= total
        busy_time += dt
        last_dt = dt
        t_end = t + dt
        if not t_end < horizon:
            return LAUNCHED, t, t_end, m, n_run, n_adm, n_done, free, iters, tokens, busy_time, last_dt
        t = t_end
        idx, tok = b_req, b_tok


@njit(**_JIT)
def _form(I, running, n_run, cands, more_waiting, free, block_size, rule, budget, max_seqs, reserve, req, rtok):
    """The next batch into ``req``/``rtok`` by ``rule`` (``cands``: the waiting head). Returns its size, 0 to
    idle, -1 when the Python scheduler must decide (it preempts, or needs waiting requests beyond the head)."""
    n_dec = 0
    n_pre = 0
    pre = np.empty(n_run, np.int64)
    for j in range(n_run):  # decode-ready first (in running order), prefilling after (split_running)
        r = running[j]
        if I[r, I_NT] - I[r, I_NC] == 1:
            req[n_dec] = r
            rtok[n_dec] = 1
            n_dec += 1
        else:
            pre[n_pre] = r
            n_pre += 1
    dec = req[:n_dec]
    if rule == STALL_FREE:
        growth = kernels.decode_kv_growth(I, dec, block_size) if n_dec else 0
        if growth > free:
            return -1  # make_room_for_decodes preempts
        if n_pre == 0 and cands.size == 0 and not more_waiting:
            return n_dec
        got = _chunks(I, pre[:n_pre], cands, more_waiting, budget - n_dec, free - growth, max_seqs - n_dec,
                      block_size, True, req, rtok, n_dec)
        if got < 0:
            return -1
        if n_dec + got == 0:
            return -1 if n_run else 0  # unstick preempts a running request; with none it idles
        return n_dec + got
    if n_pre or cands.size or more_waiting:
        got = _chunks(I, pre[:n_pre], cands, more_waiting, budget, free - reserve, max_seqs - n_dec, block_size,
                      False, req, rtok, n_dec)
        if got < 0:
            return -1
        if got:  # a prefill-only batch: move it to the front
            for j in range(got):
                req[j] = req[n_dec + j]
                rtok[j] = rtok[n_dec + j]
            return got
    if not n_dec:
        return -1 if n_run else 0
    if kernels.decode_kv_growth(I, dec, block_size) > free:
        return -1
    return n_dec


@njit(**_JIT)
def _chunks(I, pre, cands, more_waiting, budget, free, max_seqs, block_size, chunked, req, rtok, off) -> int:
    """Prefill chunks for ``pre`` then ``cands`` (in order) at ``req[off:]`` by ``take_in_order``'s rule; -1 when
    every candidate was taken with budget and slots left and the waiting queue goes on beyond ``cands``."""
    got = 0
    used = 0
    left = budget
    for part in (pre, cands):
        if left <= 0 or got >= max_seqs:
            break
        n, u, _, left = kernels.take_in_order(I, part, left, free - used, max_seqs - got, block_size, chunked,
                                              False, got, req, rtok, off + got)
        got += n
        used += u
        if n < part.size:
            return got
    if more_waiting and left > 0 and got < max_seqs:
        return -1
    return got

"""Sarathi-Serve (Agrawal et al., OSDI'24): chunked prefills with stall-free, decode-first batching.

Each iteration has a fixed token budget (the chunk size, e.g. 512). Every running decode gets its token first;
the budget left is filled with prefill chunks -- requests already mid-prefill first, then waiting requests in
FCFS order -- so decodes never stall behind a long prompt (Sarathi-Serve §4.2-4.3). KV shortage preempts the
most recently arrived running request by recompute, as vLLM does. Reproduction papers tune the budget to the
tightest TPOT SLO (SLOs-Serve §5.1); ``token_budget`` is that knob.

Deviation: the best-effort flag is ignored (FCFS knows no tiers).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from slogym.baselines.common import (TokenBudgetScheduler, decode_batch, decodes_and_chunks, make_room_for_decodes,
                                     split_running, unstick)
from slogym.core.batch import Batch
from slogym.core.instance import Instance
from slogym.core.pilot import STALL_FREE


class SarathiScheduler(TokenBudgetScheduler):
    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        arrival = inst.sim.w.arrival
        victims: list[int] = []
        free = inst.free_blocks
        if dec.size:
            dec, victims, free = make_room_for_decodes(inst, dec, lambda r: arrival[r])
            if victims:
                pre = np.array([r for r in pre.tolist() if r not in victims], dtype=np.int64)
        if not (pre.size or inst.waiting) and (dec.size or victims):
            return decode_batch(dec, victims, steady=not victims)
        # lazily: the budget runs out after a few candidates, the waiting queue may be long
        cands = chain(pre.tolist(), (r for r in inst.waiting if r not in victims) if victims else inst.waiting)
        req, tok, repeatable = decodes_and_chunks(inst, dec, cands, self.token_budget - dec.size, free,
                                                  self.max_num_seqs - dec.size)
        if not req.size and not victims:
            return unstick(inst, lambda r: arrival[r])
        # decodes alone repeat; with prefill chunks, only a single chunk cut by the budget does
        steady = (repeatable or req.size == dec.size) and not victims
        return Batch(req=req, tokens=tok, preempt=tuple(victims), steady=steady)

    def pilot_rule(self, inst: Instance) -> tuple[int, int, int, int] | None:
        """The compiled pilot's stall-free rule is this ``next_batch`` (a subclass that changes it opts out)."""
        if type(self).next_batch is not SarathiScheduler.next_batch:
            return None
        return STALL_FREE, self.token_budget, self.max_num_seqs, 0

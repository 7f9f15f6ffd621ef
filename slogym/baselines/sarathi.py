"""Sarathi-Serve (Agrawal et al., OSDI'24): chunked prefills with stall-free, decode-first batching.

Each iteration has a fixed token budget (the chunk size, e.g. 512). Every running decode gets its token first;
the budget left is filled with prefill chunks -- requests already mid-prefill first, then waiting requests in
FCFS order -- so decodes never stall behind a long prompt (Sarathi-Serve §4.2-4.3). KV shortage preempts the
most recently arrived running request by recompute, as vLLM does. Reproduction papers tune the budget to the
tightest TPOT SLO (SLOs-Serve §5.1); ``token_budget`` is that knob.

Admission follows the vLLM v0 block manager that Sarathi-Serve is built on (and Vidur's Sarathi replica
scheduler): a waiting request starts only when the KV blocks of its whole prompt fit with a ``watermark``
fraction of the instance's blocks to spare, and head-of-line blocking is kept (FCFS). ``whole_prompt=False``
admits a request as soon as its first chunk fits (vLLM v1's chunk-by-chunk allocation), which admits more
requests under memory pressure and then preempts more of them.

Deviations: blocks are allocated chunk by chunk as the prefill computes them, and the whole-prompt reservation
is checked at admission and within a batch only, so decode growth between chunks may still take blocks a running
prefill will need (vLLM v0 allocates them at admission; either way KV shortage then preempts by recompute); a
waiting request that still holds KV (back from a tool call) continues chunk by chunk without the check; the
watermark is kept free only while the instance runs something, as in :mod:`slogym.baselines.vllm` (so no prompt
that fits the KV is stranded); the best-effort flag is ignored (FCFS knows no tiers).
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
    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256, whole_prompt: bool = True,
                 watermark: float = 0.01) -> None:
        super().__init__(token_budget, max_num_seqs)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark={watermark} must be in [0, 1)")
        self.whole_prompt = whole_prompt
        self.watermark = watermark

    def _watermark(self, inst: Instance) -> int:
        """Blocks a starting prompt must leave free while requests run (-1: no whole-prompt check)."""
        return int(self.watermark * inst.total_blocks) if self.whole_prompt else -1

    def _floor(self, inst: Instance) -> int:
        """The watermark while requests run; with none, a prompt that fits the free blocks starts (0)."""
        w = self._watermark(inst)
        return w if inst.running or w < 0 else 0

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        arrival = inst.sim.w.arrival
        victims: list[int] = []
        free = inst.free_blocks
        if dec.size:
            dec, victims, free = make_room_for_decodes(inst, dec, arrival[inst.running_array()])
            if victims:
                pre = np.array([r for r in pre.tolist() if r not in victims], dtype=np.int64)
        if not (pre.size or inst.waiting) and (dec.size or victims):
            return decode_batch(dec, victims, steady=not victims)
        # lazily: the budget runs out after a few candidates, the waiting queue may be long
        cands = chain(pre.tolist(), (r for r in inst.waiting if r not in victims) if victims else inst.waiting)
        req, tok, repeatable = decodes_and_chunks(inst, dec, cands, self.token_budget - dec.size, free,
                                                  self.max_num_seqs - dec.size, self._floor(inst))
        if not req.size and not victims:
            return unstick(inst, lambda r: arrival[r])
        # decodes alone repeat; with prefill chunks, only a single chunk cut by the budget does
        steady = (repeatable or req.size == dec.size) and not victims
        return Batch(req=req, tokens=tok, preempt=tuple(victims), steady=steady)

    def pilot_rule(self, inst: Instance) -> tuple[int, int, int, int] | None:
        """The compiled pilot's stall-free rule is this ``next_batch`` (a subclass that changes it opts out)."""
        if type(self).next_batch is not SarathiScheduler.next_batch:
            return None
        return STALL_FREE, self.token_budget, self.max_num_seqs, self._watermark(inst)

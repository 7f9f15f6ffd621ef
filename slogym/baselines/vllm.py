"""vLLM-style FCFS scheduling (Kwon et al., SOSP'23; the v0 default scheduler the reference papers compare to).

Each iteration: if waiting requests can be admitted (first come, first served, within ``max_num_seqs``,
``max_num_batched_tokens`` and KV memory above a ``watermark``), run a prefill-only batch of whole prompts;
otherwise run one decode step of every running request, preempting by recompute the most recently arrived
running requests when KV blocks run out. Prefill-first maximizes throughput and gives low TTFT at low load but
stalls decodes (large TPOT gaps) when prompts keep arriving -- the behaviour Sarathi-Serve fixes.

Deviations: a prompt longer than ``max_num_batched_tokens`` is admitted alone rather than rejected (vLLM
requires the budget to exceed the model length); the watermark is kept free only while the instance runs
something, so a prompt that fits the KV but not above the watermark starts once the instance is empty (vLLM
v0 would refuse it for good, ``AllocStatus.NEVER``; holding it at the head of the FCFS queue would strand every
request behind it); the best-effort flag is ignored (FCFS knows no tiers).
"""

from __future__ import annotations

from itertools import chain

from slogym.baselines.common import (batch_of, decode_batch, fill_prefill_chunks, make_room_for_decodes,
                                     positive_count, split_running, unstick)
from slogym.core.batch import Batch
from slogym.core.instance import Instance
from slogym.core.pilot import PREFILL_FIRST
from slogym.core.policy import Scheduler


class VLLMScheduler(Scheduler):
    steady_through_finish = True

    def __init__(self, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 watermark: float = 0.01) -> None:
        if not 0.0 <= watermark < 1.0:  # also refuses NaN
            raise ValueError(f"watermark={watermark!r}; must be a fraction of the KV blocks in [0, 1)")
        self.max_num_seqs = positive_count("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = positive_count("max_num_batched_tokens", max_num_batched_tokens)
        self.watermark = float(watermark)

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        arrival = inst.sim.w.arrival
        if inst.waiting or pre.size:
            reserve = int(self.watermark * inst.total_blocks) if inst.running else 0
            cands = chain(pre.tolist(), inst.waiting)  # drawn lazily: the waiting queue may be long
            slots = self.max_num_seqs - dec.size
            reqs, toks, _, _ = fill_prefill_chunks(inst, cands, self.max_num_batched_tokens,
                                                inst.free_blocks - reserve, slots, chunked=False)
            if reqs:
                return batch_of(reqs, toks)
        if not dec.size:
            return unstick(inst, lambda r: arrival[r])
        keep, victims, _ = make_room_for_decodes(inst, dec, arrival[inst.running_array()])
        return decode_batch(keep, victims, steady=not victims)

    def pilot_rule(self, inst: Instance) -> tuple[int, int, int, int] | None:
        """The compiled pilot's prefill-first rule is this ``next_batch`` (a subclass that changes it opts out)."""
        if type(self).next_batch is not VLLMScheduler.next_batch:
            return None
        return PREFILL_FIRST, self.max_num_batched_tokens, self.max_num_seqs, int(self.watermark * inst.total_blocks)

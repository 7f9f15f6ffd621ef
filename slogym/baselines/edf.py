"""Earliest-deadline-first on SLO deadline lines, in a Sarathi-style token-budget loop.

Every candidate (running or waiting) has a deadline: a decode step's is its next token's deadline
``dl_base + k * tpot``; a prefill's is its TTFT deadline ``t_ref + ttft``. Candidates take tokens in deadline
order -- one for a decode, a chunk for a prefill -- until the token budget is spent. Requests without an SLO
(best-effort) sort last. On KV shortage the running request with the latest deadline is preempted by recompute.
This is the classic deadline baseline the multi-SLO papers contrast with (e.g. SLOs-Serve §2, PolyServe §3).
"""

from __future__ import annotations

import numpy as np

from slogym.baselines.common import (batch_of, fill_prefill_chunks, make_room_for_decodes, split_running,
                                     unstick)
from slogym.core.batch import Batch
from slogym.core.instance import Instance
from slogym.core.policy import Scheduler


def next_deadline(inst: Instance, reqs: np.ndarray) -> np.ndarray:
    """Deadline of each request's next output (inf for best-effort requests)."""
    rs = inst.sim.rs
    return np.where(rs.be[reqs], np.inf, rs.next_deadline(inst.sim.w, reqs))


class EDFScheduler(Scheduler):
    steady_through_finish = True

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256) -> None:
        if token_budget < 1 or max_num_seqs < 1:
            raise ValueError(f"token_budget={token_budget} and max_num_seqs={max_num_seqs} must be >= 1")
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        victims: list[int] = []
        running = np.array(inst.running, dtype=np.int64)
        dl_of = dict(zip(inst.running, next_deadline(inst, running).tolist())) if running.size else {}
        if dec.size:
            dec, victims, _ = make_room_for_decodes(inst, dec, lambda r: dl_of[r])
        cands = np.array(dec.tolist() + [r for r in pre.tolist() + inst.waiting if r not in victims],
                         dtype=np.int64)
        dl = next_deadline(inst, cands)
        order = np.argsort(dl, kind="stable")
        n_dec = dec.size
        budget, slots = self.token_budget, self.max_num_seqs
        free = inst.free_blocks + sum(int(inst.sim.rs.kv_blocks[v]) for v in victims)
        reqs: list[int] = []
        toks: list[int] = []
        for j in order.tolist():
            if budget <= 0 or len(reqs) >= slots:
                break
            r = int(cands[j])
            if j < n_dec:  # a decode step: one token if its KV can grow
                need = int(inst.blocks_needed([r], 1)[0])
                if need > free:
                    continue
                reqs.append(r)
                toks.append(1)
                free -= need
                budget -= 1
                continue
            got, chunks, used, _ = fill_prefill_chunks(inst, [r], budget, free, 1)
            if got:  # a prefill that does not fit waits; later deadlines may still run
                reqs.append(r)
                toks.append(chunks[0])
                free -= used
                budget -= chunks[0]
        if not reqs and not victims:
            return unstick(inst, lambda r: dl_of.get(r, np.inf))
        all_running = not inst.waiting and not pre.size and len(reqs) == len(inst.running)
        return batch_of(reqs, toks, victims, steady=all_running and not victims and all(t == 1 for t in toks))

"""Earliest-deadline-first on SLO deadline lines, in a Sarathi-style token-budget loop.

Every candidate (running or waiting) has a deadline: a decode step's is its next token's deadline
``dl_base + k * tpot``; a prefill's is its TTFT deadline ``t_ref + ttft``. Candidates take tokens in deadline
order -- one for a decode, a chunk for a prefill -- until the token budget is spent. Requests without an SLO
(best-effort) sort last. On KV shortage the running request with the latest deadline is preempted by recompute.
This is the classic deadline baseline the multi-SLO papers contrast with (e.g. SLOs-Serve §2, PolyServe §3).

Known behaviour, kept (it is EDF's, not a slogym artefact): under KV pressure it thrashes -- a preempted request
falls behind its deadline line, so it becomes the earliest deadline, is re-admitted with prefill chunks that take the
KV the running decodes need, and forces the next preemption (the "domino effect" of EDF in overload). E.g. 40
reasoning requests at 4.8 req/s on ``llama2-70b-a100-tp2`` (18,461 KV tokens): 35,090 preemptions and 119.6M
recomputed tokens against Sarathi's 186 and 285k; every request still ends in one outcome. No admission hysteresis
is added: that would be a different policy.
"""

from __future__ import annotations

import numpy as np

from slogym.baselines.common import (BatchBuilder, TokenBudgetScheduler, batch_of, make_room_for_decodes,
                                     split_running, unstick)
from slogym.core.batch import Batch
from slogym.core.instance import Instance


def next_deadline(inst: Instance, reqs: np.ndarray) -> np.ndarray:
    """Deadline of each request's next output (inf for best-effort requests)."""
    rs = inst.sim.rs
    return np.where(rs.be[reqs], np.inf, rs.next_deadline(inst.sim.w, reqs))


class EDFScheduler(TokenBudgetScheduler):
    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        victims: list[int] = []
        dl_run = next_deadline(inst, inst.running_array())
        if dec.size:
            dec, victims, _ = make_room_for_decodes(inst, dec, dl_run)
        rest = np.concatenate([pre, np.asarray(inst.waiting, dtype=np.int64)])
        cands = np.concatenate([dec, rest[~np.isin(rest, victims)] if victims else rest])
        dl = next_deadline(inst, cands)
        order = np.argsort(dl, kind="stable")
        b = BatchBuilder(inst, self.token_budget, inst.free_blocks + int(inst.sim.rs.kv_blocks[victims].sum()),
                         self.max_num_seqs)
        b.take_all(cands[order])  # a candidate that does not fit waits; later deadlines may still run
        reqs, toks = b.reqs, b.toks
        if not reqs and not victims:
            return unstick(inst, dict(zip(inst.running, dl_run.tolist())).__getitem__)
        all_running = not inst.waiting and not pre.size and len(reqs) == len(inst.running)
        return batch_of(reqs, toks, victims, steady=all_running and not victims and all(t == 1 for t in toks))

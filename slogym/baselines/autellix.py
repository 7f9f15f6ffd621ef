"""Autellix PLAS: program-level least attained service (Luo et al. 2025, "Autellix: An Efficient Serving Engine
for LLM Agents as General Programs", arXiv:2502.13965), the program-aware baseline of Tempo (§6.1).

Reconstructed from the paper's public description and Tempo's account of it (no copy of the paper is in this
repository); the choices made here are listed in ``docs/baselines/autellix_sjf.md``.

* **Program.** A collective request (Tempo's DAG: every request of one ``group``) is one program; a standalone
  request is its own program. Each LLM call of a program inherits the program's priority, so the later calls of
  a program that already received much service do not jump ahead of short programs (program-level head-of-line
  blocking, the paper's motivation).
* **Attained service** of a program = tokens computed for its requests (``rs.computed_total``: prefill + decode
  tokens, recomputation after a preemption included) -- those of its finished, external and held requests and of
  its requests on the deciding instance. A sibling running on *another* instance counts once it finishes: reading
  another instance mid-iteration would make the decision depend on how far the simulator fast-forwarded it.
* **Discretized priority queues.** Service is mapped to ``n_levels`` queues with geometric bounds (``quantum``,
  ``quantum * multiplier``, ...); lower queue first, first-come-first-served (program arrival) within a queue.
* **Anti-starvation.** A program whose total waiting time ``W`` (seconds its requests sat on an instance
  without being scheduled) reaches ``starvation_ratio`` times its total service time ``T`` (seconds its requests
  were in a running batch) is promoted to the top queue until ``W / T`` drops below the ratio again.
* **Preemption.** A request of a better queue that does not fit in KV evicts (recompute) running requests of
  worse queues, worst first; see :class:`~slogym.baselines.sjf.PriorityScheduler` for the shared loop.

``W`` and ``T`` are integer nanoseconds accumulated over segments whose ends are scheduling decisions or a
request's last token, so they are identical whether the simulator steps or fast-forwards.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import numpy as np

from slogym.baselines.sjf import PriorityScheduler, policy_factory, service_level
from slogym.core.instance import Instance
from slogym.core.policy import Policy
from slogym.core.state import Status


_RUNNING = int(Status.RUNNING)


def _ns(t: float) -> int:
    return int(round(t * 1e9))


class AutellixScheduler(PriorityScheduler):
    """PLAS with discretized queues and W/T anti-starvation, on the token-budget loop."""

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256, preemptive: bool = True,
                 quantum: int = 1024, multiplier: float = 2.0, n_levels: int = 10,
                 starvation_ratio: float = 2.0) -> None:
        super().__init__(token_budget, max_num_seqs, preemptive)
        if quantum < 1 or multiplier <= 1.0 or n_levels < 1 or not starvation_ratio > 0:
            raise ValueError(f"quantum={quantum} >= 1, multiplier={multiplier} > 1, n_levels={n_levels} >= 1 and "
                             f"starvation_ratio={starvation_ratio} > 0 needed")
        self.quantum, self.multiplier, self.n_levels = quantum, multiplier, n_levels
        self.starvation_ratio = starvation_ratio

    def reset(self, sim: Any) -> None:
        self.sim = sim
        w = sim.w
        n = len(w)
        grouped = np.flatnonzero(w.group >= 0)
        self.program = np.where(w.group >= 0, n + w.group, np.arange(n))
        by_group = grouped[np.argsort(w.group[grouped], kind="stable")]
        cuts = np.flatnonzero(np.diff(w.group[by_group])) + 1
        self.members: dict[int, np.ndarray] = {n + int(w.group[m[0]]): m for m in np.split(by_group, cuts) if m.size}
        self.waited: dict[int, int] = defaultdict(int)   # closed waiting time per program (ns)
        self.served: dict[int, int] = defaultdict(int)   # closed service time per program (ns)
        self.segments: dict[int, dict[int, tuple[bool, int]]] = defaultdict(dict)  # inst -> r -> (running, since)

    def program_service(self, inst: Instance, reqs: np.ndarray) -> np.ndarray:
        """Attained service (tokens) of each request's program, as seen from ``inst`` (one sum per program)."""
        rs = self.sim.rs
        service = rs.computed_total[reqs].copy()
        prog = self.program[reqs]
        grouped = np.flatnonzero(prog >= len(self.sim.w))
        if grouped.size:
            progs, pos = np.unique(prog[grouped], return_inverse=True)
            parts = [self.members[p] for p in progs.tolist()]
            m = np.concatenate(parts)
            owner = np.repeat(np.arange(progs.size), [x.size for x in parts])
            here = (rs.status[m] != _RUNNING) | (rs.slot[m] == inst.id)
            total = np.zeros(progs.size, dtype=service.dtype)
            np.add.at(total, owner[here], rs.computed_total[m[here]])
            service[grouped] = total[pos]
        return service

    def priorities(self, inst: Instance, reqs: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        level = service_level(self.program_service(inst, reqs), self.quantum, self.multiplier, self.n_levels)
        wait, busy = self._times(inst, reqs, _ns(now))
        starving = (wait > 0) & (wait >= self.starvation_ratio * busy)
        return np.where(starving, 0, level), self.sim.w.arrival[reqs]

    def _times(self, inst: Instance, reqs: np.ndarray, now: int) -> tuple[np.ndarray, np.ndarray]:
        """Program waiting and service time up to ``now`` (ns): closed segments plus this instance's open ones,
        after closing the segments of requests that left the instance and opening those of newcomers."""
        rs, segs = self.sim.rs, self.segments[inst.id]
        present = set(reqs.tolist())
        for r in sorted(set(segs) - present):
            running, since = segs.pop(r)
            end = now if np.isnan(rs.last_token[r]) else min(now, _ns(float(rs.last_token[r])))
            (self.served if running else self.waited)[int(self.program[r])] += max(end - since, 0)
        for r in reqs.tolist():
            if r not in segs:
                segs[r] = (False, _ns(float(rs.ready[r])))
        open_wait: dict[int, int] = defaultdict(int)
        open_busy: dict[int, int] = defaultdict(int)
        for r, (running, since) in segs.items():
            (open_busy if running else open_wait)[int(self.program[r])] += now - since
        progs = self.program[reqs].tolist()
        wait = np.array([self.waited.get(p, 0) + open_wait[p] for p in progs], dtype=np.float64)
        busy = np.array([self.served.get(p, 0) + open_busy[p] for p in progs], dtype=np.float64)
        return wait, busy

    def observe(self, inst: Instance, scheduled: set[int], now: float) -> None:
        t = _ns(now)
        segs = self.segments[inst.id]
        for r, (running, since) in list(segs.items()):
            if (r in scheduled) != running:
                (self.served if running else self.waited)[int(self.program[r])] += t - since
                segs[r] = (not running, t)


POLICIES: dict[str, Callable[..., Policy]] = {"autellix": policy_factory("autellix", AutellixScheduler)}

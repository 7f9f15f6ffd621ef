"""Baseline routers: round-robin, seeded random, least-load. They admit everything."""

from __future__ import annotations

import numpy as np

from slogym.core.policy import Router
from slogym.core.simulator import Simulator


class RoundRobinRouter(Router):
    """Requests go to instances in turn."""

    def reset(self, sim: Simulator) -> None:
        self._next = 0

    def route(self, req: int, sim: Simulator, now: float) -> int:
        i = self._next % len(sim.instances)
        self._next += 1
        return i


class RandomRouter(Router):
    """Uniformly random instance, from a generator seeded by the run's seed."""

    def reset(self, sim: Simulator) -> None:
        self._rng = np.random.default_rng(sim.seed + 7919)

    def route(self, req: int, sim: Simulator, now: float) -> int:
        return int(self._rng.integers(len(sim.instances)))


def outstanding_tokens(sim: Simulator) -> np.ndarray:
    """Per instance: KV tokens in use plus prompt tokens still waiting to be computed."""
    rs = sim.rs
    out = np.empty(len(sim.instances), dtype=np.int64)
    for i, inst in enumerate(sim.instances):
        used = (inst.total_blocks - inst.free_blocks) * inst.block_size
        waiting = int((rs.num_tokens[inst.waiting] - rs.num_computed[inst.waiting]).sum()) if inst.waiting else 0
        out[i] = used + waiting
    return out


class LeastLoadRouter(Router):
    """The instance with the fewest outstanding tokens (ties: lowest index)."""

    def route(self, req: int, sim: Simulator, now: float) -> int:
        return int(np.argmin(outstanding_tokens(sim)))

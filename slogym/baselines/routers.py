"""Baseline routers: round-robin, seeded random, least-load. They admit everything.

They choose among the instances that take new requests (ACTIVE, colocated or prefill role), so they work under
P/D disaggregation and scaling; on a static colocated cluster that is every instance, in index order. With none
accepting (all still starting) they DEFER: the simulator offers the request again when an instance becomes ready.
"""

from __future__ import annotations

import numpy as np

from slogym.core.instance import ENTRY_ROLES
from slogym.core.policy import DEFER, Router, SingleOrRoundRobin
from slogym.core.simulator import Simulator


def entry_instances(sim: Simulator) -> list[int]:
    """Instances that accept newly arriving requests."""
    return sim.accepting_instances(ENTRY_ROLES)


class RoundRobinRouter(SingleOrRoundRobin):
    """Requests go to the accepting entry instances in turn (the core's default router, by its baseline name)."""


class RandomRouter(Router):
    """Uniformly random instance, from a generator seeded by the run's seed."""

    pd_aware = True

    def reset(self, sim: Simulator) -> None:
        self._rng = np.random.default_rng(sim.seed + 7919)

    def route(self, req: int, sim: Simulator, now: float) -> int:
        cands = entry_instances(sim)
        return cands[int(self._rng.integers(len(cands)))] if cands else DEFER


def outstanding_tokens(sim: Simulator) -> np.ndarray:
    """Per instance: KV tokens in use plus prompt tokens still waiting to be computed (read without unparking
    an instance: ``Simulator.free_blocks`` / ``waiting_tokens``)."""
    insts = sim.instances
    total = np.array([i.total_blocks for i in insts], np.int64)
    block = np.array([i.block_size for i in insts], np.int64)
    return (total - sim.free_blocks()) * block + sim.waiting_tokens()


class LeastLoadRouter(Router):
    """The instance with the fewest outstanding tokens (ties: lowest index)."""

    pd_aware = True

    def route(self, req: int, sim: Simulator, now: float) -> int:
        cands = entry_instances(sim)
        if not cands:
            return DEFER
        return cands[int(np.argmin(outstanding_tokens(sim)[cands]))]

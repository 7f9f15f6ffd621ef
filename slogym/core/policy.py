"""Policy interfaces: :class:`Router`, :class:`Scheduler`, :class:`Scaler`, bundled as :class:`Policy`.

Baselines implement the pieces their paper has; the simulator calls them at these points:

* ``Router.route(req, sim, now)`` when a request arrives (or returns from a tool call, or leaves the global
  queue). Returns an instance index, or :data:`DEFER` (keep it in the cluster's global queue; it is offered
  again whenever a request finishes), :data:`REJECT` (outcome ``rejected``), or :data:`BEST_EFFORT` (demote
  to the best-effort tier; ``best_effort_instance`` then picks where it runs).
* ``Scheduler.next_batch(inst, now)`` whenever an instance is free: returns the next iteration's
  :class:`~slogym.core.batch.Batch` or ``None`` to idle until the next event that reaches the instance.
* ``Router.route_decode(req, sim, now)`` when a request's prefill completes on a PREFILL instance: the
  DECODE instance its KV moves to (default: the accepting one with the most free KV blocks), or DEFER
  (keep the KV where it is and ask again when an instance becomes ready or a request finishes).
* ``Scaler.decide(sim, now)`` every ``Scaler.interval`` seconds: cluster-shape changes through
  ``sim.add_instance``, ``drain_instance``, ``switch_role``, ``set_pool`` (docs/cluster.md).

A policy keeps its own state and must reset it in ``reset(sim)``; it must not mutate simulator arrays
directly -- decisions go through return values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slogym.core.batch import Batch
from slogym.core.instance import ENTRY_ROLES, Role

if TYPE_CHECKING:
    from slogym.core.instance import Instance
    from slogym.core.simulator import Simulator

DEFER = -1
REJECT = -2
BEST_EFFORT = -3


class Router(ABC):
    """Decides where an arriving request goes (admission is part of routing: reject / best-effort)."""

    #: True if this router's decisions depend on other instances' per-iteration progress between arrivals;
    #: the simulator then never fast-forwards one instance past another's events.
    coupled: bool = False
    #: True if ``route`` only returns accepting instances of the entry roles (COLOCATED, PREFILL), so the
    #: router works on disaggregated and scaling clusters (``slogym simulate --pd`` replaces other routers).
    pd_aware: bool = False

    def reset(self, sim: "Simulator") -> None:
        """Called once before a run."""

    @abstractmethod
    def route(self, req: int, sim: "Simulator", now: float) -> int:
        """Instance index, or DEFER / REJECT / BEST_EFFORT."""

    def pilot_target(self, sim: "Simulator") -> int:
        """The instance every arriving request goes to, whatever the request and the cluster's state (e.g. the
        only accepting one), so the simulator's compiled pilot may place arrivals itself and report them with
        :meth:`pilot_routed`; -1 (the default) when ``route`` must be asked for each."""
        return -1

    def pilot_routed(self, n: int) -> None:
        """``n`` arrivals were placed on :meth:`pilot_target` without calling ``route``."""

    def best_effort_instance(self, req: int, sim: "Simulator", now: float) -> int:
        """Where a demoted request runs; default: the accepting entry instance with the fewest resident
        requests (DEFER when none accepts)."""
        cands = sim.accepting_instances(ENTRY_ROLES)
        return min(cands, key=lambda i: sim.instances[i].n_resident) if cands else DEFER

    def route_decode(self, req: int, sim: "Simulator", now: float) -> int:
        """The DECODE instance that receives ``req``'s KV after its prefill on a PREFILL instance, DEFER (asked
        again when a request finishes or an instance becomes ready), or BEST_EFFORT (``req`` is demoted to best
        effort, then asked again); default: the accepting DECODE instance with the most free KV blocks (lowest
        index on ties), DEFER if none."""
        cands = sim.accepting_instances(Role.DECODE)
        return max(cands, key=lambda i: (sim.instances[i].free_blocks, -i)) if cands else DEFER


class Scheduler(ABC):
    """Forms each iteration's batch on one instance (iteration-level scheduling).

    ``steady_through_finish``: when this scheduler returns a steady all-decode batch of every running request
    and nothing waits, a request finishing does not change its rule (the next batch is the remaining running
    requests), so the simulator may fast-forward through finishes.
    """

    steady_through_finish: bool = False

    def reset(self, sim: "Simulator") -> None:
        """Called once before a run."""

    @abstractmethod
    def next_batch(self, inst: "Instance", now: float) -> Batch | None:
        """The next iteration's batch, or None to idle."""

    def pilot_rule(self, inst: "Instance") -> tuple[int, int, int, int] | None:
        """``(rule, token budget, max_num_seqs, watermark KV blocks)`` when ``next_batch`` is exactly one of the
        compiled pilot's rules (``slogym.core.pilot``; the watermark applies while the instance runs something:
        PREFILL_FIRST admits whole prompts into the blocks above it, STALL_FREE starts a prompt only when all of it
        fits above it, -1 turning that check off) on ``inst``, so the simulator may run its iterations
        compiled; None (the default) keeps every decision in ``next_batch``. A scheduler with a rule never
        speculates (no draft tokens): the pilot's lower bound on an iteration's duration, from which the simulator
        bounds the earliest finish (``Instance.dt_floor``), counts one token per decode step. The rule must not
        change while the instance is busy: a parked instance keeps the rule it was parked with
        (``Simulator._setup_parking``)."""
        return None


class Scaler(ABC):
    """Changes the cluster's shape every ``interval`` seconds."""

    interval: float = 1.0

    def reset(self, sim: "Simulator") -> None:
        """Called once before a run."""

    @abstractmethod
    def decide(self, sim: "Simulator", now: float) -> None:
        """Apply scaling actions through the simulator's cluster API."""


class SingleOrRoundRobin(Router):
    """The documented default router: everything to instance 0, or round-robin over several instances --
    the accepting ones of the entry roles (on a static colocated cluster: all of them); DEFER when none is."""

    pd_aware = True

    def reset(self, sim: "Simulator") -> None:
        self._next = 0

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        cands = sim.accepting_instances(ENTRY_ROLES)
        if not cands:
            return DEFER
        i = cands[self._next % len(cands)]
        self._next += 1
        return i

    def pilot_target(self, sim: "Simulator") -> int:
        if type(self).route is not SingleOrRoundRobin.route:  # a subclass deciding otherwise is asked each time
            return -1
        cands = sim.accepting_instances(ENTRY_ROLES)
        return cands[0] if len(cands) == 1 else -1

    def pilot_routed(self, n: int) -> None:
        self._next += n


@dataclass
class Policy:
    """A named bundle of router, scheduler and (optional) scaler, plus the parameters it was built with."""

    name: str
    scheduler: Scheduler
    router: Router = field(default_factory=SingleOrRoundRobin)
    scaler: Scaler | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def reset(self, sim: "Simulator") -> None:
        self.router.reset(sim)
        self.scheduler.reset(sim)
        if self.scaler is not None:
            self.scaler.reset(sim)

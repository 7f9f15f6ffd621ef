"""Decisions taken per arriving request: ``slogym/Admission-v0`` and ``slogym/Routing-v0``.

Observation (``Dict``; every entry ``float32``, clipped to [-10, 10]):

=============  ======================  ===========================================================================
key            shape                   features
=============  ======================  ===========================================================================
``request``    (8,)                    input tokens (log scale, see ``log_tokens``), predicted output tokens p50
                                       and p90 (per-app history of the pool's training part, log scale),
                                       TTFT SLO (s), tightest TPOT SLO (/100 ms), TTLT SLO (/30 s), no-SLO flag,
                                       priority / 4
``app``        (n_apps,)               one-hot application
``tier``       (n_tiers,)              one-hot SLO tier
``instances``  (n_instances, 5)        per instance: waiting prefill tokens / 8192, waiting / 64,
                                       running / max_num_seqs, KV utilization, predicted decode-step time / 100 ms
``slack``      (n_instances, n_tiers)  smallest next-token slack (s) of the running requests of each tier
``recent``     (2,)                    EWMA (0.95) of recent SLO outcomes, fraction of the episode done
=============  ======================  ===========================================================================

Routing-v0 adds ``placed_since`` (n_instances,): requests placed on other instances since the last placement on
this one, / n_instances (round-robin places on the largest).

Unbounded values (a TTFT SLO of ``inf``) appear as the clip value 10.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from slogym.core.instance import ENTRY_ROLES, Instance
from slogym.core.policy import BEST_EFFORT, DEFER, REJECT
from slogym.core.simulator import Simulator
from slogym.envs.base import CLIP, ServingEnv, _box


class ArrivalEnv(ServingEnv):
    """Steps at each arrival (and each return of a deferred request): the agent's router decision."""

    decision = "route"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.observation_space = self._arrival_space()

    def _configure(self, sim: Simulator) -> None:
        sim.agent_route = True

    def _observe(self) -> dict[str, np.ndarray]:
        _, r, now = self._msg
        return self._arrival_obs(r, now)

    def _fits(self, r: int, inst: Instance) -> bool:
        """Can ``inst`` ever hold request ``r``'s largest context in KV?"""
        return self.sim._max_ctx[r] <= inst.total_blocks * inst.block_size

    def _check(self, action: Any) -> int:
        """The action as an int; one integer (a Python or NumPy int, or an integer array of shape () or (1,)),
        else a ValueError naming the space and the value (floats, NaN, strings and bools are not actions)."""
        if type(action) is int or isinstance(action, np.integer):
            a = int(action)
        else:
            arr = np.asarray(action)
            if arr.shape not in ((), (1,)) or arr.dtype.kind not in "iu":
                raise ValueError(f"action {action!r} is not in {self.action_space}: expected one integer, got "
                                 f"dtype {arr.dtype}, shape {arr.shape}")
            a = int(arr.reshape(-1)[0])
        if not 0 <= a < self._n_actions:
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        return a


class AdmissionEnv(ArrivalEnv):
    """``slogym/Admission-v0``: admit, serve best-effort, or reject each arriving request.

    Action ``Discrete(3)``: 0 = admit (placed by the ``policy``'s router; if that router would not place it,
    on the instance with the fewest resident requests), 1 = best-effort tier, 2 = reject.
    ``action_masks()`` excludes admit and best-effort when no instance can ever hold the request.
    Baselines expressible: admit-all (every baseline router); SLOs-Serve soft admission and HyperFlexis'
    TTFT-probability admission through ``expert_action()`` once those baselines exist.
    """

    ADMIT, BEST_EFFORT, REJECT = 0, 1, 2
    render_label = "admit"  # its decisions are the simulator's "route" decisions

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.action_space = spaces.Discrete(3)
        self._n_actions = 3
        self._expert: tuple[tuple, int] | None = None  # (decision message, the router's answer)

    def action_masks(self) -> np.ndarray:
        ok = self._fits_somewhere(self._decision()[1])
        return np.array([ok, ok, True])

    def _fits_somewhere(self, r: int) -> bool:
        """Can any instance ever hold request ``r`` (admit and best-effort allowed)?"""
        return any(self._fits(r, inst) for inst in self.sim.instances)

    def expert_action(self) -> int:
        """The ``policy`` router's admission decision for the current request (asked once per request: calling
        again returns the same answer and leaves the router's state as one call did)."""
        msg = self._decision()
        if self._expert is None or self._expert[0] is not msg:
            _, r, now = msg
            self._expert = (msg, int(self.sim.policy.router.route(r, self.sim, now)))
        placed = self._expert[1]
        return self.BEST_EFFORT if placed == BEST_EFFORT else self.REJECT if placed == REJECT else self.ADMIT

    def _to_sim_action(self, action: Any) -> int:
        a = self._check(action)
        if a == self.REJECT:
            return REJECT
        if not self._fits_somewhere(self._msg[1]):  # action_masks()[a]
            raise ValueError(f"action {a} is masked out for request {self._msg[1]} (it fits on no instance)")
        if a == self.BEST_EFFORT:
            return BEST_EFFORT
        _, r, now = self._msg
        router = self.sim.policy.router
        expert = self._expert
        placed = expert[1] if expert and expert[0] is self._msg else int(router.route(r, self.sim, now))
        return placed if placed >= 0 else router.best_effort_instance(r, self.sim, now)


class RoutingEnv(ArrivalEnv):
    """``slogym/Routing-v0``: choose the instance for each arriving request, or defer it.

    Action ``Discrete(n_instances + 1)``: ``i < n_instances`` places the request on instance ``i``;
    ``n_instances`` defers it to the cluster's global queue (it is offered again, as a new step, whenever a
    request finishes). ``action_masks()`` excludes instances that can never hold the request and, on a P/D
    cluster (``pd=``), the decode instances (they receive requests only by KV transfer).
    Baselines expressible (``expert_action()``): round-robin, random, least-load (the ``policy=`` names of
    the same routers), and later PolyServe, SLOs-Serve sequential routing, HyperFlexis' dispatcher.

    Its observation adds ``placed_since`` (see the module table): how many requests went elsewhere since each
    instance last received one. Load features alone cannot express round-robin (its counter is hidden), the
    strongest router on identical replicas; with this feature it is "the instance with the largest value".
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.action_space = spaces.Discrete(self.n_instances + 1)
        self._n_actions = self.n_instances + 1
        self.observation_space = spaces.Dict(self.observation_space.spaces | {
            "placed_since": _box(self.n_instances, low=0.0, high=CLIP)})
        # placed_since's counts: _placed[i] = requests placed when instance i last received one, _placed[-1] =
        # requests placed so far (since the episode began)
        self._placed = np.zeros(self.n_instances + 1, np.int64)
        self._expert: tuple[tuple, int] | None = None  # (decision message, the router's answer)

    def _bind(self, sim: Simulator) -> None:
        super()._bind(sim)
        self._placed = np.zeros(self.n_instances + 1, np.int64)

    def _observe(self) -> dict[str, np.ndarray]:
        _, r, now = self._msg
        return self._arrival_obs(r, now, self._placed)

    def action_masks(self) -> np.ndarray:
        r = self._decision()[1]
        need = int(self.sim._max_ctx[r])  # _fits, inlined: MaskablePPO asks at every step
        return np.array([i.accepting and i.role in ENTRY_ROLES and need <= i.total_blocks * i.block_size
                         for i in self.sim.instances] + [True])

    def expert_action(self) -> int:
        """The ``policy`` router's placement for the current request (defer for anything else); asked once per
        decision: calling again returns the same answer and leaves a stateful router (round-robin) as one call
        did."""
        msg = self._decision()
        if self._expert is None or self._expert[0] is not msg:
            _, r, now = msg
            self._expert = (msg, int(self.sim.policy.router.route(r, self.sim, now)))
        placed = self._expert[1]
        return placed if placed >= 0 else self.n_instances

    def _to_sim_action(self, action: Any) -> int:
        a = self._check(action)
        if a == self.n_instances:
            return DEFER
        inst = self.sim.instances[a]
        if not (self._fits(self._msg[1], inst) and inst.accepting and inst.role in ENTRY_ROLES):  # action_masks()[a]
            raise ValueError(f"action {a} is masked out for request {self._msg[1]}: instance {a} can never "
                             f"hold it or does not take new requests (a decode instance)")
        placed = self._placed
        placed[-1] += 1
        placed[a] = placed[-1]
        return a

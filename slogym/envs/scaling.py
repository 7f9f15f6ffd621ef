"""``slogym/Scaling-v0``: how many instances each pool runs, decided every ``control_interval`` seconds.

The cluster is split into *pools* (``pools="single"``: one colocated pool; ``pools="tiers"``: one pool per SLO
tier, each request served by its tier's pool -- PolyServe's per-tier layout; ``pools="roles"``: a prefill pool
(0) and a decode pool (1) of a P/D-disaggregated cluster, initially ``pd=(P, D)`` instances, default
``(n_instances, n_instances)``). Every ``control_interval`` simulated seconds the agent picks a delta per pool;
the router and scheduler of the episode are fixed.

Action ``MultiDiscrete([2k + 1] * n_pools)`` (``k = max_delta``): entry ``a`` asks for ``a - k`` instances
in that pool. Positive deltas start instances (``add_instance`` with the pool's role -- COLOCATED, or PREFILL /
DECODE in role pools -- and a cold start of ``cold_start``: a HyperFlexis Table 2 method, ``"disk"`` by default,
or seconds); negative deltas first cancel instances still joining the pool (newest first), then drain the active
ones with the least outstanding work (``drain_instance``: they take no new requests, finish what they hold, then
stop). The pool size (active + joining) is clipped to ``[min_instances, max_instances]``; ``action_masks()``
marks the deltas that the clip leaves unchanged. Every pool always keeps an active instance (``min_instances >=
1`` and joining instances are cancelled before active ones are drained).

Role pools (HyperFlexis §6 role reconfiguration): opposite deltas after the clip (one pool shrinks, the other
grows) are first carried out as ``min(shrink, grow)`` *role switches*: the instances the shrinking pool would
give up (same order as above) move to the other pool by ``switch_role`` -- at once when empty or still starting
(no new cold start, no new instance cost), else they drain their requests first and take the new role when
empty. Such a draining instance is *joining* its new pool (counted in its size and ``starting`` feature). The
remainder of the deltas adds or drains instances as above. New requests enter the prefill pool; decode instances
receive requests only by KV transfer (the core's ``_send_kv`` / ``route_decode``).

Observation (``Dict``; every entry ``float32``, clipped to [-10, 10]):

=============  ==================  ================================================================================
key            shape               features
=============  ==================  ================================================================================
``pools``      (n_pools, 8)        per pool: active / max_instances, joining (starting, or draining to switch into
                                   the pool's role) / max_instances, draining (to stop) / max_instances,
                                   utilization (busy seconds of its instances over the last interval / (interval x
                                   active)), queue tokens / (8192 x active), queued requests / (64 x active),
                                   running / (max_num_seqs x active), mean KV utilization of its active instances.
                                   Queue: the waiting requests of its instances and their prompt tokens still to
                                   prefill; for the decode pool of ``roles``: the KV hand-offs waiting for it
                                   (KV arrived on one of its instances and not yet in a decode batch, KV in flight
                                   to one of them, or prefilled with no decode instance to take it yet) and their
                                   context tokens (``num_tokens``: the KV to admit)
``arrivals``   (n_tiers, 3)        per SLO tier: arrival rate over the last interval, and its EWMAs with weights
                                   0.5 and 0.1 per interval, each divided by the tier's mean rate in the pool
``recent``     (2,)                EWMA (0.95) of recent SLO outcomes, fraction of the episode's requests done
=============  ==================  ================================================================================

Reward (credited when known, as in every slogym env): the base reward (``goodput``: +1 per request finishing
within its SLO, ...) of the requests reaching an outcome during the step, minus ``lam`` x the instance-seconds
the cluster accrued during the step (STARTING and DRAINING time included). The episode return is therefore
``goodput_requests - lam * cost_instance_seconds`` of the run's summary. A scale-up pays its cost from the
moment it is asked for and its goodput only when the requests it serves finish, one or more steps later.

Baselines expressible (``expert_action(name)``): ``static`` (all zeros: the cluster ``n_instances`` per pool
never changes), ``threshold`` (:class:`ThresholdScaler`, a reference threshold scaler after HyperFlexis §6),
or ``policy``: the ``policy``'s own scaler when it exposes ``deltas(sim, now)`` -- PolyServe's tier autoscaling
(``policy="polyserve-co"``, ``pools="tiers"``: :meth:`slogym.baselines.polyserve.PolyServeScaler.deltas`),
HyperFlexis' threshold scaler (``policy="hyperflexis-scaling"``, ``pools="single"``; with ``pools="roles"`` and
``policy="hyperflexis-pd-scaling"`` its P/D form, one delta per stage). Served natively,
``baseline_policy("policy")`` (:class:`DeltasScaler`) gives the same run as replaying that expert.

HyperFlexis' P/D scaler replayed in role pools (:class:`~slogym.baselines.hyperflexis.HyperFlexisScaler`,
§6 Algorithm 3): its per-stage +1 / -1 / 0 are the role pools' deltas, and its (-1, +1) role switch is the env's
role switch; pass ``cold_start="d2d"`` for its Fast Scaling. The replay differs from the native
``hyperflexis-pd-scaling`` run (its own ``decide``) in four stated ways: (1) a (-1, +1) whose shrinking stage is
at its minimum: HyperFlexis switches nothing and adds nothing, the env clips the -1 away and adds an instance to
the growing pool; (2) bounds: HyperFlexis caps all instances together (``max_instances`` 8) and adds none to a
stage with an instance still starting, the env bounds each pool by ``[min_instances, max_instances]``; (3) the
instance given up: HyperFlexis takes the active one with the fewest resident requests (newest on ties), the env
a joining one first, then the active one with the fewest outstanding tokens (lowest index on ties); (4)
HyperFlexis cold-starts from disk when no instance is active, never the case in role pools. Where (1), (2) and (4)
do not arise and (3) only picks another idle instance, the replay is the native run (per-request records; the run's
cost up to where the last scaler tick ends it); where (3) drains another busy instance it still takes the same
decisions at the same times (``tests/test_scaling_env.py``).

Routing: :class:`PoolRouter` (least outstanding tokens among the accepting instances of the request's pool)
routes the requests of ``single`` and ``tiers`` pools. Deviation: not the ``policy``'s router there (baseline
routers are not pool-aware). Role pools are the roles a P/D-aware router routes by, so they keep the ``policy``'s
router when it is P/D-aware (``distserve``'s shortest queue and least-loaded decode instance, HyperFlexis'
Dispatcher and Migrator, ``rr-pd``'s round robin, ...), else :class:`PoolRouter`. The ``policy`` supplies the
scheduler of every instance. Refused, with a ``ValueError``: a policy that disaggregates its cluster
(``rr-pd``, ``hyperflexis-pd``, ...) with colocated pools (at reset), and PolyServe's policies with role pools
(its fleet model grows only by colocated instances).
"""

from __future__ import annotations

import heapq
import inspect
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
from gymnasium import spaces

from slogym.baselines import make_policy
from slogym.baselines.routers import outstanding_tokens
from slogym.core.cluster import cold_start_of
from slogym.core.instance import Instance, InstanceState, Role
from slogym.core.policy import Policy, Router, Scaler
from slogym.core.simulator import Simulator
from slogym.envs.base import CLIP, ServingEnv, _box

POOLINGS = ("single", "tiers", "roles")
ROLE_POOLS = (Role.PREFILL, Role.DECODE)
"""The role of each pool of ``pools="roles"`` (pool 0: prefill, pool 1: decode)."""
ROLE_POOLS_REFUSED = ("polyserve",)
"""Policies (name prefixes) that cannot serve role pools: PolyServe's fleet grows only by colocated instances and
its routers track the fleet they were built on (``polyserve.Fleet.grow`` raises on a P/D instance)."""
POOL_FEATURES = ("active", "starting", "draining", "utilization", "queue_tokens", "waiting", "running",
                 "kv_utilization")
ARRIVAL_EWMA = (1.0, 0.5, 0.1)
"""Weights of the per-interval arrival-rate EWMAs (1.0 = the last interval alone)."""

# ================================================================================ generator scaler ticks
_TICK = -1
"""Payload of the release event that re-enters the event loop as a generator for a scaler tick."""


class _GeneratorTicks:
    """Generator scaler ticks (until the core supports them): a Scaler whose ``decide`` is a generator
    yields its decision through :meth:`Simulator.decisions`. Mixed in only while the core lacks it. The core
    calls timer callbacks as plain functions, so the tick re-enters the loop as a *release* event with the
    payload ``_TICK`` (release events run through the generator ``_begin``) at the same time."""

    def _scaler_tick(self, sim: Simulator, t: float) -> None:
        from slogym.core.simulator import _RELEASE

        self._seq += 1
        heapq.heappush(self._glob, (t, self._seq, _RELEASE, _TICK))

    def _begin(self, r: int, t: float) -> Generator:
        if r != _TICK:
            yield from super()._begin(r, t)
            return
        scaler = self.policy.scaler
        out = scaler.decide(self, t)
        if out is not None:
            yield from out
        if self._ticks_go_on():  # as the core's tick
            self.add_timer(t + scaler.interval, self._scaler_tick)


_MIXINS = () if inspect.isgeneratorfunction(Simulator._scaler_tick) else (_GeneratorTicks,)
_PROTOTYPES: dict[type, type] = {}


def ensure_cluster_api(sim: Simulator) -> None:
    """Give ``sim`` generator scaler ticks (a prototype subclass while the core lacks them; a no-op once it has
    them). Called from the scaler's ``reset``, before the event loop starts."""
    if not _MIXINS or any(isinstance(sim, m) for m in _MIXINS):
        return
    cls = type(sim)
    if cls not in _PROTOTYPES:
        _PROTOTYPES[cls] = type(f"Scaling{cls.__name__}", (*_MIXINS, cls), {})
    sim.__class__ = _PROTOTYPES[cls]


def cluster_cost(sim: Simulator, t: float) -> float:
    """Instance-seconds accrued up to ``t`` (STARTING and DRAINING included), as the summary's cost."""
    return float(sum(min(t if i.stopped_at is None else i.stopped_at, t) - i.started_at
                     for i in sim.instances if i.started_at <= t))


# ================================================================================ pools
class PoolLayout:
    """Which pool serves which request, and the per-pool bounds, initial sizes and cold start of a Scaling-v0
    cluster. ``init`` is the initial size of every pool (an int), or one size per pool (``pools="roles"``:
    ``(P, D)``)."""

    def __init__(self, pooling: str, n_tiers: int, init: int | tuple[int, ...], min_instances: int,
                 max_instances: int, cold_start: float | str) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pools={pooling!r}; known: {', '.join(POOLINGS)}")
        self.pooling, self.n_tiers = pooling, n_tiers
        self.roles = pooling == "roles"
        self.n_pools = n_tiers if pooling == "tiers" else 2 if self.roles else 1
        sizes = (int(init),) * self.n_pools if np.ndim(init) == 0 else tuple(int(n) for n in init)
        if len(sizes) != self.n_pools:
            raise ValueError(f"initial sizes {sizes}: pools={pooling!r} has {self.n_pools} pools")
        for n in sizes:
            if not 1 <= min_instances <= n <= max_instances:
                what = "pd" if self.roles else "n_instances"
                raise ValueError(f"need 1 <= min_instances ({min_instances}) <= {what} ({n}) <= "
                                 f"max_instances ({max_instances})")
        self.init: tuple[int, ...] = sizes
        self.min, self.max = min_instances, max_instances
        self.cold_start = cold_start

    def pool_of(self, sim: Simulator, r: int) -> int:
        """The pool a new request enters: its tier's, or the prefill pool (0) of role pools."""
        return int(sim.w.tier[r]) if self.pooling == "tiers" else 0

    def role_of(self, pool: int) -> Role:
        """The role of every instance of ``pool``: PREFILL (pool 0) / DECODE (pool 1) in role pools."""
        return ROLE_POOLS[pool] if self.roles else Role.COLOCATED

    def router(self, own: Router) -> Router:
        """The episode's router: the ``policy``'s own (``own``) in role pools when it is P/D-aware (its ``route``
        picks a prefill instance, its ``route_decode`` the decode instance: the role pools are the roles it routes
        by), else :class:`PoolRouter`."""
        return own if self.roles and own.pd_aware else PoolRouter(self)

    def setup(self, sim: Simulator) -> None:
        """Give ``sim`` the cluster API and ``init[p]`` active instances in every pool ``p`` (its first ones are
        relabelled -- and, in role pools, given the pool's role -- missing ones added without cold start)."""
        ensure_cluster_api(sim)
        if not self.roles and any(i.role != Role.COLOCATED for i in sim.instances):
            raise ValueError(f"Scaling-v0's pools={self.pooling!r} are colocated, but the policy made instances "
                             f"{[i.id for i in sim.instances if i.role != Role.COLOCATED]} prefill/decode ones; "
                             f"a policy that disaggregates its cluster (rr-pd, hyperflexis-pd, ...) needs "
                             f"pools='roles'")
        i = 0
        for p, n in enumerate(self.init):
            role = self.role_of(p)
            for _ in range(n):
                if i < len(sim.instances):
                    sim.set_pool(i, p)
                    if sim.instances[i].role != role:
                        sim.switch_role(i, role)
                else:
                    sim.add_instance(role=role, pool=p)
                i += 1
        if len(sim.instances) > i:
            raise ValueError(f"simulator has {len(sim.instances)} instances; the layout wants pools of "
                             f"{list(self.init)}")

    def members(self, sim: Simulator, pool: int) -> list[Instance]:
        return [i for i in sim.instances if i.pool == pool and i.state != InstanceState.STOPPED]

    def live(self, sim: Simulator, pool: int) -> list[Instance]:
        """The instances the pool's size counts: active and joining (:func:`joining`) ones."""
        return [i for i in self.members(sim, pool) if i.state == InstanceState.ACTIVE or joining(i)]

    def sizes(self, sim: Simulator) -> np.ndarray:
        """Active + joining instances of every pool (what the bounds apply to)."""
        return np.array([len(self.live(sim, p)) for p in range(self.n_pools)], np.int64)

    def deltas_of(self, scaler: Scaler, sim: Simulator, now: float) -> np.ndarray:
        """``scaler.deltas(sim, now)``; in role pools only a scaler of this layout or one whose ``stages`` are
        ``[PREFILL, DECODE]`` (HyperFlexis' P/D scaler) has one delta per role pool."""
        if self.roles and getattr(scaler, "layout", None) is not self and \
                [Role(s) for s in getattr(scaler, "stages", ())] != list(ROLE_POOLS):
            raise ValueError(f"{type(scaler).__name__}'s deltas are not per prefill/decode role "
                             f"(stages {getattr(scaler, 'stages', None)}); pools='roles' cannot carry them")
        return scaler.deltas(sim, now)

    def clip(self, sim: Simulator, deltas: Any, max_delta: int) -> np.ndarray:
        """A scaler's per-pool ``deltas`` as the env carries them out: clipped to the pool bounds and to
        ``-max_delta..max_delta`` (the same effect as :meth:`apply` of the raw deltas, within the action space).
        The shape must be one delta per pool."""
        d = np.asarray(deltas, np.int64)
        if d.shape != (self.n_pools,):
            raise ValueError(f"scaler deltas {d.tolist()} (shape {d.shape}); pools={self.pooling!r} has "
                             f"{self.n_pools} pools")
        n = self.sizes(sim)
        return np.clip(np.clip(d, self.min - n, self.max - n), -max_delta, max_delta)

    def _leaving(self, sim: Simulator, pool: int, load: np.ndarray) -> list[Instance]:
        """The pool's instances in the order a negative delta takes them: joining ones (newest first), then the
        active ones with the fewest outstanding tokens."""
        live = self.live(sim, pool)
        active = sorted((i for i in live if i.state == InstanceState.ACTIVE), key=lambda i: load[i.id])
        return [i for i in live if joining(i)][::-1] + active

    def apply(self, sim: Simulator, deltas: np.ndarray) -> None:
        """Change each pool's size by its delta (clipped to the bounds). Role pools first turn opposite deltas
        into role switches (``min(-d_src, d_dst)`` instances of the shrinking pool, taken in :meth:`_leaving`
        order, ``switch_role`` to the growing pool's role). Then per pool: cancel joining instances (newest
        first) and drain the active ones with the fewest outstanding tokens, or start new ones."""
        load = outstanding_tokens(sim)
        n = self.sizes(sim)
        d = np.clip(n + np.asarray(deltas, dtype=np.int64), self.min, self.max) - n
        if self.roles and d.min() < 0 < d.max():
            src, dst = int(np.argmin(d)), int(np.argmax(d))
            k = int(min(-d[src], d[dst]))
            for inst in self._leaving(sim, src, load)[:k]:
                sim.set_pool(inst.id, dst)
                sim.switch_role(inst.id, self.role_of(dst))
            d[src] += k
            d[dst] -= k
        for p, x in enumerate(d.tolist()):
            for _ in range(x):
                sim.add_instance(engine=sim.engines[0], role=self.role_of(p), cold_start=self.cold_start, pool=p)
            if x < 0:
                for inst in self._leaving(sim, p, load)[:-x]:
                    sim.drain_instance(inst.id)


def joining(inst: Instance) -> bool:
    """On its way into its pool: STARTING (cold start), or draining to switch into the pool's role."""
    return inst.state == InstanceState.STARTING or (inst.state == InstanceState.DRAINING
                                                    and inst.switch_to is not None)


def handoffs(sim: Simulator, members: list[Instance]) -> list[int]:
    """Prefilled requests waiting for the decode instances ``members``: their KV arrived and waits for a decode
    batch, or is in flight to one of them; plus the hand-offs no decode instance could take yet (DEFER)."""
    ids = {i.id for i in members}
    return ([r for i in members for r in i.waiting] + [r for r, d in sim._xfer_dst.items() if d in ids]
            + list(sim._handoff_wait))


class PoolMonitor:
    """Per-pool load features (``POOL_FEATURES``) over the interval since the previous ``sample``."""

    def __init__(self, layout: PoolLayout) -> None:
        self.layout = layout
        self._busy: dict[int, float] = {}
        self._t = 0.0

    def sample(self, sim: Simulator, now: float) -> np.ndarray:
        lay, rs = self.layout, sim.rs
        out = np.zeros((lay.n_pools, len(POOL_FEATURES)), np.float32)
        dt = max(now - self._t, 1e-9)
        for p in range(lay.n_pools):
            members = lay.members(sim, p)
            active = [i for i in members if i.state == InstanceState.ACTIVE]
            n = max(len(active), 1)
            busy = sum(i.busy_time - self._busy.get(i.id, 0.0) for i in active)
            if lay.role_of(p) == Role.DECODE:  # KV hand-offs waiting: their context tokens
                wait = handoffs(sim, members)
                queued = float(rs.num_tokens[wait].sum()) if wait else 0.0
            else:
                wait = [r for i in members for r in i.waiting]
                queued = float((rs.num_tokens[wait] - rs.num_computed[wait]).sum()) if wait else 0.0
            out[p] = (len(active) / lay.max, sum(joining(i) for i in members) / lay.max,
                      sum(i.state == InstanceState.DRAINING and i.switch_to is None for i in members) / lay.max,
                      busy / (dt * n), queued / (8192.0 * n), len(wait) / (64.0 * n),
                      sum(len(i.running) for i in members) / (sim.engines[0].max_num_seqs * n),
                      float(np.mean([i.kv_utilization for i in active])) if active else 0.0)
        self._busy = {i.id: i.busy_time for i in sim.instances}
        self._t = now
        return np.clip(out, -CLIP, CLIP)


class PoolRouter(Router):
    """The accepting instance of the request's pool with the fewest outstanding tokens (KV in use plus
    prompt tokens still waiting; the least-load router's measure), lowest index on ties. In role pools new
    requests enter the prefill pool, and a prefilled request's KV goes to the decode instance with the most free
    KV blocks (the default :meth:`~slogym.core.policy.Router.route_decode`; every DECODE instance is in the
    decode pool)."""

    pd_aware = True

    def __init__(self, layout: PoolLayout) -> None:
        self.layout = layout

    def route(self, req: int, sim: Simulator, now: float) -> int:
        ok = sim.accepting_instances(pool=self.layout.pool_of(sim, req))
        load = outstanding_tokens(sim)
        return min(ok, key=lambda i: (load[i], i))

    def best_effort_instance(self, req: int, sim: Simulator, now: float) -> int:
        return self.route(req, sim, now)


# ================================================================================ scalers
class ThresholdScaler(Scaler):
    """Reference threshold scaler after HyperFlexis §6 (Algorithm 3's shape; its thresholds lost their symbols
    in the text, the values here are ours): every ``interval`` s, per pool, if utilization > ``up_util`` or the
    waiting prompt tokens per active instance exceed ``up_queue`` (a proxy for wait time relative to the TTFT
    SLO), add one instance (two when the queue is over 4x the threshold); if utilization < ``down_util`` with
    an empty queue for ``patience`` consecutive intervals, drain one.
    Deviation: no input-rate vs processing-rate test. In role pools (-1, +1) is carried out as a role switch
    (:meth:`PoolLayout.apply`), HyperFlexis' reconfiguration."""

    def __init__(self, layout: PoolLayout, interval: float = 5.0, up_util: float = 0.85, down_util: float = 0.35,
                 up_queue: float = 2048.0, patience: int = 3) -> None:
        self.layout, self.interval = layout, float(interval)
        self.up_util, self.down_util, self.up_queue, self.patience = up_util, down_util, up_queue, patience

    def reset(self, sim: Simulator) -> None:
        self.layout.setup(sim)
        self.start()

    def start(self) -> None:
        """Fresh measurement state (the env calls this when it uses the scaler as an expert)."""
        self.monitor = PoolMonitor(self.layout)
        self._calm = np.zeros(self.layout.n_pools, np.int64)

    def deltas(self, sim: Simulator, now: float) -> np.ndarray:
        f = self.monitor.sample(sim, now)
        util, queue = f[:, POOL_FEATURES.index("utilization")], f[:, POOL_FEATURES.index("queue_tokens")] * 8192
        up = (util > self.up_util) | (queue > self.up_queue)
        calm = (util < self.down_util) & (queue == 0)
        self._calm = np.where(calm, self._calm + 1, 0)
        down = self._calm >= self.patience
        self._calm[down] = 0
        return np.where(up, np.where(queue > 4 * self.up_queue, 2, 1), np.where(down, -1, 0)).astype(np.int64)

    def decide(self, sim: Simulator, now: float) -> None:
        self.layout.apply(sim, self.deltas(sim, now))


class StaticScaler(Scaler):
    """Keeps ``n_instances`` per pool for the whole run (the static-provisioning baseline)."""

    def __init__(self, layout: PoolLayout, interval: float = 5.0) -> None:
        self.layout, self.interval = layout, float(interval)

    def reset(self, sim: Simulator) -> None:
        self.layout.setup(sim)

    def deltas(self, sim: Simulator, now: float) -> np.ndarray:
        return np.zeros(self.layout.n_pools, np.int64)

    def decide(self, sim: Simulator, now: float) -> None:
        """Nothing to change."""


class DeltasScaler(Scaler):
    """A baseline scaler that exposes ``deltas(sim, now)`` (PolyServe's tier autoscaling, HyperFlexis') served
    the way Scaling-v0 replays it as an expert: every ``interval`` s its deltas, clipped as
    :meth:`ScalingEnv.expert_action` clips them (:meth:`PoolLayout.clip`), applied to the pools."""

    def __init__(self, layout: PoolLayout, inner: Scaler, interval: float, max_delta: int) -> None:
        self.layout, self.inner, self.interval, self.max_delta = layout, inner, float(interval), int(max_delta)

    def reset(self, sim: Simulator) -> None:
        self.inner.reset(sim)  # before the pools exist, as the env's _configure resets its expert
        self.layout.setup(sim)

    def decide(self, sim: Simulator, now: float) -> None:
        lay = self.layout
        lay.apply(sim, lay.clip(sim, lay.deltas_of(self.inner, sim, now), self.max_delta))


class _AgentScaler(Scaler):
    """Inside the env: hands each tick's decision to the agent (``("scale", None, now)``), which applies it."""

    def __init__(self, layout: PoolLayout, interval: float) -> None:
        self.layout, self.interval = layout, interval

    def reset(self, sim: Simulator) -> None:
        self.layout.setup(sim)

    def decide(self, sim: Simulator, now: float) -> Generator[tuple, Any, None]:
        yield ("scale", None, now)


class EnvScaler(Scaler):
    """A trained agent as a Scaler: each tick, ``act`` on the attached env's observation picks the deltas."""

    def __init__(self, env: "ScalingEnv", act: Callable[[Any], Any]) -> None:
        self.env, self.act = env, act
        self.interval = env.control_interval

    def reset(self, sim: Simulator) -> None:
        self.env.layout.setup(sim)
        self.env.attach(sim)

    def decide(self, sim: Simulator, now: float) -> None:
        self.env._to_sim_action(self.act(self.env.observe(("scale", None, now))))


# ================================================================================ the environment
class ScalingEnv(ServingEnv):
    """``slogym/Scaling-v0`` (see the module docstring).

    Keyword arguments beyond the common ones (``n_instances`` is the initial size of every pool):
        pools             ``single`` | ``tiers`` | ``roles`` (initial sizes ``pd=(P, D)``, default
                          ``(n_instances, n_instances)``)
        control_interval  seconds between decisions (> 0)
        max_delta         k: deltas in -k..k per pool
        min_instances, max_instances   bounds of every pool's size (active + starting)
        cold_start        seconds, or a HyperFlexis Table 2 method (``disk``, ``cpu_offload``, ``d2d``)
        lam               reward cost per instance-second (in units of the base reward)
    """

    decision = "scale"

    def __init__(self, pools: str = "single", control_interval: float = 5.0, max_delta: int = 2,
                 min_instances: int = 1, max_instances: int = 8, cold_start: float | str = "disk",
                 lam: float = 0.1, n_instances: int = 2, episode: int | float = 300.0,
                 pool_requests: int | None = 20000, **kw: Any) -> None:
        if not (control_interval > 0 and np.isfinite(control_interval)):
            raise ValueError(f"control_interval={control_interval!r}; must be > 0 seconds")
        if int(max_delta) < 1:
            raise ValueError(f"max_delta={max_delta!r}; must be >= 1")
        if not (lam >= 0 and np.isfinite(lam)):
            raise ValueError(f"lam={lam!r}; must be >= 0")
        pd = kw.pop("pd", None)
        if pools == "roles":
            pd = (n_instances, n_instances) if pd is None else pd
            if str(kw.get("policy", "")).startswith(ROLE_POOLS_REFUSED):
                raise ValueError(f"policy={kw['policy']!r} cannot serve pools='roles': PolyServe's fleet grows only "
                                 f"by colocated instances; use a P/D policy (distserve, hyperflexis-pd(-scaling), "
                                 f"rr-pd) or a colocated scheduler")
        elif pd is not None:
            raise ValueError(f"pd={pd!r} needs pools='roles' (Scaling-v0's pools={pools!r} are colocated)")
        super().__init__(n_instances=n_instances, episode=episode, pool_requests=pool_requests, pd=pd, **kw)
        self.control_interval, self.max_delta, self.lam = float(control_interval), int(max_delta), float(lam)
        self.layout = PoolLayout(pools, self.n_tiers, n_instances if self.pd is None else self.pd,
                                 int(min_instances), int(max_instances), cold_start)
        cold_start_of(self.engine, cold_start)  # validate now, not at the first scale-up
        n_pools = self.layout.n_pools
        self.action_space = spaces.MultiDiscrete(np.full(n_pools, 2 * self.max_delta + 1))
        self.observation_space = spaces.Dict({
            "pools": _box(n_pools, len(POOL_FEATURES)), "arrivals": _box(self.n_tiers, len(ARRIVAL_EWMA)),
            "recent": _box(2, low=0.0, high=1.0),
        })
        span = max(float(self.pool.arrival[-1] - self.pool.arrival[0]), 1e-9)
        counts = np.bincount(self.pool.tier, minlength=self.n_tiers).astype(np.float64)
        self._mean_rate = np.maximum(counts / span, 1e-9)
        self._experts: dict[str, Scaler] = {}

    # ------------------------------------------------------------------ hooks
    def _configure(self, sim: Simulator) -> None:
        sim.policy.router = self.layout.router(sim.policy.router)
        sim.policy.scaler = _AgentScaler(self.layout, self.control_interval)
        threshold = ThresholdScaler(self.layout, self.control_interval)
        threshold.start()
        self._experts = {"static": StaticScaler(self.layout, self.control_interval), "threshold": threshold}
        self._asked: tuple[Any, dict[str, np.ndarray]] = (None, {})  # (decision message, expert actions)
        own = make_policy(self.policy_name, self.engine).scaler
        if own is not None and hasattr(own, "deltas"):
            own.reset(sim)
            self._experts["policy"] = own

    def _bind(self, sim: Simulator) -> None:
        super()._bind(sim)
        self._start_stats(sim)

    def _start_stats(self, sim: Simulator) -> None:
        self._cost = 0.0
        self._n_arrived = 0
        self._rates = np.zeros((self.n_tiers, len(ARRIVAL_EWMA)))
        self._t_obs = 0.0
        self._monitor = PoolMonitor(self.layout)

    def _credit(self) -> float:
        gain = super()._credit()
        sim = self.sim
        cost = cluster_cost(sim, getattr(sim, "end_time", sim.now))
        spent, self._cost = cost - self._cost, cost
        return gain - self.lam * spent

    def _observe(self) -> dict[str, np.ndarray]:
        sim = self.sim
        now = self._msg[2]
        dt = max(now - self._t_obs, 1e-9)
        new = sim.w.tier[self._n_arrived:sim._na]
        rate = np.bincount(new, minlength=self.n_tiers) / dt / self._mean_rate
        w = np.array(ARRIVAL_EWMA)
        self._rates = (1.0 - w) * self._rates + w * rate[:, None]
        self._n_arrived, self._t_obs = sim._na, now
        return {"pools": self._monitor.sample(sim, now),
                "arrivals": np.clip(self._rates, -CLIP, CLIP).astype(np.float32), "recent": self._recent()}

    def _check(self, action: Any) -> np.ndarray:
        a = np.asarray(action)
        ok = a.shape == self.action_space.shape and np.isfinite(a).all() and (a == np.round(a)).all()
        if not (ok and self.action_space.contains(a.astype(np.int64))):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        return a.astype(np.int64)

    def _to_sim_action(self, action: Any) -> None:
        self.layout.apply(self.sim, self._check(action) - self.max_delta)

    # ------------------------------------------------------------------ masks and experts
    def action_masks(self) -> np.ndarray:
        """Per pool (concatenated), which deltas change the pool's size after clipping to the bounds (delta 0
        always allowed); MaskablePPO's MultiDiscrete layout."""
        self._decision()
        lay, d = self.layout, np.arange(-self.max_delta, self.max_delta + 1)
        return np.concatenate([(d == 0) | ((n + d >= lay.min) & (n + d <= lay.max)) for n in lay.sizes(self.sim)])

    def expert_action(self, name: str | None = None) -> np.ndarray:
        """The action scaler ``name`` would take now: ``static``, ``threshold``, or ``policy`` (the ``policy``
        baseline's scaler, when it exposes ``deltas(sim, now)``); default ``policy`` if available, else
        ``static``. A scaler is asked at most once per step (calling again returns the same action): scalers
        measure the interval since their previous call."""
        name = name or ("policy" if "policy" in self._experts else "static")
        if name not in self._experts:
            raise ValueError(f"unknown expert {name!r}; known: {', '.join(self._experts)}")
        msg = self._decision()
        if self._asked[0] is not msg:
            self._asked = (msg, {})
        if name not in self._asked[1]:
            lay = self.layout
            d = lay.clip(self.sim, lay.deltas_of(self._experts[name], self.sim, msg[2]), self.max_delta)
            self._asked[1][name] = d + self.max_delta  # the same effect as the scaler's deltas, never masked
        return self._asked[1][name].copy()

    # ------------------------------------------------------------------ serving and baselines as Policies
    def agent_policy(self, name: str, act: Callable[[Any], Any]) -> Policy:
        """A Policy whose scaling decisions come from ``act`` (on this env's observations), with this env's
        router and the ``policy`` baseline's scheduler."""
        base = make_policy(self.policy_name, self.engine)
        return Policy(name=name, scheduler=base.scheduler, router=self.layout.router(base.router),
                      scaler=EnvScaler(self, act), params={"agent": name, "decision": self.decision,
                                                           "base_policy": self.policy_name})

    def baseline_policy(self, name: str, n_instances: int | None = None) -> Policy:
        """``static``, ``threshold`` or ``policy`` (the ``policy`` baseline's own scaler, when it exposes
        ``deltas``: :class:`DeltasScaler`, the run that replaying ``expert_action("policy")`` gives) as a Policy
        (this env's router, the ``policy``'s scheduler), starting from ``n_instances`` per pool (default: the
        env's); run it with :meth:`run_scaler` (``Simulator(..., n_instances)``; role pools: ``pd=``)."""
        scalers = {"static": StaticScaler, "threshold": ThresholdScaler, "policy": None}
        if name not in scalers:
            raise ValueError(f"unknown scaling baseline {name!r}; known: {', '.join(scalers)}")
        lay = self.layout
        init = lay.init if n_instances is None else (int(n_instances),) * lay.n_pools
        layout = PoolLayout(lay.pooling, lay.n_tiers, init, min(lay.min, *init), max(lay.max, *init),
                            lay.cold_start)
        base = make_policy(self.policy_name, self.engine)
        if name == "policy":
            if base.scaler is None or not hasattr(base.scaler, "deltas"):
                raise ValueError(f"policy {self.policy_name!r} has no scaler with deltas(sim, now)")
            scaler: Scaler = DeltasScaler(layout, base.scaler, self.control_interval, self.max_delta)
            return Policy(name=f"{self.policy_name}-scaler", scheduler=base.scheduler,
                          router=layout.router(base.router), scaler=scaler)
        label = "-".join(map(str, sorted(set(init))))
        return Policy(name=f"{name}-{label}" if name == "static" else name, scheduler=base.scheduler,
                      router=layout.router(base.router), scaler=scalers[name](layout, self.control_interval))

    def run_scaler(self, policy: Policy, window: tuple[Any, int], n_instances: int | None = None) -> dict[str, float]:
        """Run ``policy`` on one episode window (``slogym.agents.evaluation.windows``) through the plain
        Simulator, ``n_instances`` per pool (default: the env's initial sizes): ``reward`` = base reward - ``lam`` x
        instance-seconds over the whole run, ``gain`` the base reward (SLO-meeting requests for ``goodput``),
        ``instance_seconds``, attainment and goodput (req/s)."""
        from slogym.agents.evaluation import episode_reward

        w, seed = window
        if self.layout.roles:
            shape: dict[str, Any] = {"pd": self.pd if n_instances is None else (n_instances, n_instances)}
        else:
            shape = {"n_instances": self.n_instances if n_instances is None else n_instances}
        sim = Simulator(w, self.engine, policy, seed=seed, attainment=self.attainment, transfer=self.transfer,
                        **shape).run()
        s = sim.result().summary
        gain, cost = episode_reward(sim, self.reward_name), float(s["cost_instance_seconds"])
        return {"reward": gain - self.lam * cost, "gain": gain, "instance_seconds": cost,
                "attainment": float(s["attainment"]), "goodput": float(s["goodput"])}

    def evaluate(self, make: Callable[[int], Policy], wins: list[tuple[Any, int]],
                 n_instances: int | None = None) -> dict[str, float]:
        """Mean and std over ``wins`` of :meth:`run_scaler` with a fresh ``make(i)`` per window (the scaling
        counterpart of ``slogym.agents.evaluation.evaluate``, whose reward has no cost term)."""
        rows = [self.run_scaler(make(i), win, n_instances) for i, win in enumerate(wins)]
        out: dict[str, float] = {}
        for k in rows[0]:
            v = np.array([r[k] for r in rows])
            out[k], out[f"{k}_std"] = float(v.mean()), float(v.std())
        return out

    def comparison_table(self, agent: str | None, wins: list[tuple[Any, int]]) -> str:
        """Markdown table, mean (std) over ``wins``: the shipped agent ``agent`` (if given), uniformly random
        deltas, the threshold scaler, the ``policy``'s own scaler (when it has ``deltas``; needs a reset first)
        and static provisioning with every pool size ``1..max_instances``."""
        from slogym.agents import env_policy, load

        rng = np.random.default_rng(0)
        nvec = self.action_space.nvec
        rows: list[tuple[str, Callable[[], Policy], int | None]] = []  # None: the env's initial pool sizes
        if agent:
            rows.append((f"**{agent}** (agent)", lambda: load(agent), None))
        rows.append(("random deltas", lambda: env_policy("random", self, lambda o: rng.integers(0, nvec)), None))
        rows.append(("threshold (HyperFlexis-style)", lambda: self.baseline_policy("threshold"), None))
        if "policy" in self._experts:
            rows.append((f"{self.policy_name}'s scaler", lambda: self.baseline_policy("policy"), None))
        rows += [(f"static-{n}", lambda n=n: self.baseline_policy("static", n), n)
                 for n in range(1, self.layout.max + 1)]
        keys = ("reward", "gain", "instance_seconds", "attainment", "goodput")
        lines = [f"| policy | reward ({self.reward_name} - {self.lam:g} x inst-s) | {self.reward_name} | "
                 f"instance-seconds | attainment | goodput (req/s) |", "|---|---|---|---|---|---|"]
        for label, make, n in rows:
            r = self.evaluate(lambda i: make(), wins, n)
            lines.append(f"| {label} | " + " | ".join(f"{r[k]:.3f} ({r[k + '_std']:.3f})" for k in keys) + " |")
        return "\n".join(lines)

"""The discrete-event simulator: arrivals, engine iterations, tool calls, collective groups, policy timers.

Events are processed in time order; at equal times an iteration end comes before other events (so resources
it frees are visible), and cluster events (tool returns, group releases, timers) before arrivals. The per-request
state lives in :class:`~slogym.core.state.RequestState` arrays and every iteration's token accounting, deadline
and KV bookkeeping is vectorized over the batch.

Fast-forward. When a scheduler marks an all-decode batch ``steady`` it promises to return it unchanged until
something it can see happens. The simulator then builds the integer features of the next ``m`` decode
iterations at once, evaluates their times in one vectorized perf-model call, and applies every iteration that
ends before the next event that could reach the instance (next arrival, cluster event, a stage end in the
batch, a KV-block shortage; also other instances' iteration ends when the router is ``coupled``). The result
is bit-identical to stepping: the same integer features give the same float times, times are accumulated in
the same order (``cumsum``), and every per-token metric is computed with the same expressions.

Interactive use (the Gymnasium environments): with ``agent_route`` / ``agent_schedule`` set,
:meth:`Simulator.decisions` is a generator that yields ``("route", req, now)`` or ``("schedule", inst, now)``
and takes the decision back through ``send``. With ``defer_timing`` it also yields ``("time", inst, features)``
for every iteration it starts and takes the iteration time back, so a driver can evaluate the batches of many
simulators in one vectorized perf-model call (the native vector env).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Generator
from typing import Any

import numpy as np

from slogym.core import kernels, pilot
from slogym.core.batch import Batch, BatchFeatures
from slogym.core.errors import SchedulerError
from slogym.core.cluster import KVTransfer, cold_start_of
from slogym.core.instance import Instance, InstanceState, ParkedInstance, Role
from slogym.core.metrics import MODES, RunResult
from slogym.core.policy import BEST_EFFORT, DEFER, REJECT, Policy
from slogym.core.request import StageKind, Workload
from slogym.core.state import NO_TPOT, Outcome, RequestState, Status

INF = math.inf
_PREFILL, _DECODE, _EXTERNAL = int(StageKind.PREFILL), int(StageKind.DECODE), int(StageKind.EXTERNAL)
_EXT_DONE, _RELEASE, _TIMER, _XFER_DONE, _READY = 0, 1, 2, 3, 4
# plain ints of the enums the hot paths compare against (enum attribute lookups cost ~1 us each)
_QUEUED, _WAITING, _RUNNING, _EXTERNAL, _DONE, _TRANSFER = (int(s) for s in (
    Status.QUEUED, Status.WAITING, Status.RUNNING, Status.EXTERNAL, Status.DONE, Status.TRANSFER))
_FINISHED, _BEST_EFFORT = int(Outcome.FINISHED), int(Outcome.BEST_EFFORT)
_FF_MAX = 4096
_PILOT_HEAD = 64  # waiting requests the pilot sees; it hands back to Python when it would need more
_NONE = np.zeros(0, np.int64)
_NO_PILOT = -1  # Simulator._pilot: the compiled pilot does not apply
MAX_PREEMPTIONS = 10_000  # preemptions of one request that mean a livelock (raise, rather than hang)
_PARK_CAP = 512  # resident requests (running + waiting) a parked instance's table rows hold
_PILOT_REPLACES = ("on_kv_freed", "on_request_placed", "log_event", "_on_arrival", "_begin", "_route", "_place",
                   "_enqueue", "_dequeue", "_schedule", "_apply_side_actions", "_preempt", "_release", "_drop_kv",
                   "_launch", "_admit", "_transition", "_end_decode_stage", "_next_stage_after", "_done",
                   "_on_iteration_done")
# fewer iterations to the next event than this are stepped: a bulk call costs about as much as ~4 steps
FF_MIN_STRETCH = 4
_Gen = Generator[tuple, Any, None]

ATTAINMENT_MODES = MODES  # the verdict modes, numbered in this order by metrics.verdict


def _no_op(sim: "Simulator", t: float) -> None:
    """A timer that only offers idle instances work (:meth:`Simulator.add_timer`)."""


class Simulator:
    """Replays ``workload`` on ``n_instances`` replicas of ``engine`` under ``policy``.

    engine        an engine preset (``slogym.engines.get_engine(name)``) or a list, one per instance
    attainment    SLO judging mode: ``strict`` (TTFT and every inter-token gap within TPOT), ``dslo`` (every
                  token before its deadline line), ``mean_tpot`` (TTFT and mean TPOT per stage), ``ttlt``
    sg_weights    Tempo service-gain weights (w_i, w_o), Eq. 1; ``sg_alpha`` the divisive-decay exponent
    spec_acceptance  per-token acceptance probability of speculative drafts (SLOs-Serve App. D)
    fast_forward  allow the vectorized decode fast-forward (results are identical either way)
    pilot         let FCFS-family schedulers run between events compiled (``slogym.core.pilot``; identical
                  results either way; off in subclasses that override a method it replaces, and under
                  ``defer_timing``)
    pd            ``(P, D)``: a disaggregated cluster, instances 0..P-1 PREFILL and P..P+D-1 DECODE
                  (``n_instances`` = P + D or omitted); None = every instance COLOCATED
    transfer      the KV-transfer time model of disaggregation (:class:`~slogym.core.cluster.KVTransfer`;
                  default: bytes per token from the engine preset, 100 Gb/s, 0.1 ms)

    Cluster API (docs/cluster.md): :meth:`add_instance`, :meth:`drain_instance`, :meth:`switch_role`,
    :meth:`set_pool`, :meth:`accepting_instances`.

    Backend hooks: a live-engine subclass sets ``live = True`` and overrides :meth:`iteration_time`; it may
    also override :meth:`on_kv_freed` and :meth:`on_request_placed` to mirror KV residency.
    """

    live: bool = False  # True in subclasses whose iteration_time runs a real engine (no fast-forward)

    def __init__(
        self,
        workload: Workload,
        engine: Any,
        policy: Policy,
        n_instances: int | None = None,
        *,
        pd: tuple[int, int] | None = None,
        transfer: KVTransfer | None = None,
        seed: int = 0,
        attainment: str = "dslo",
        sg_weights: tuple[float, float] = (1.0, 2.0),
        sg_alpha: float = 1.0,
        spec_acceptance: float = 0.7,
        fast_forward: bool = True,
        pilot: bool = True,
        validate: bool = True,
        progress: bool = False,
    ) -> None:
        if attainment not in ATTAINMENT_MODES:
            raise ValueError(f"attainment={attainment!r}; expected one of {ATTAINMENT_MODES}")
        roles, n_instances = self._roles(pd, n_instances, engine)
        if not 0.0 <= spec_acceptance < 1.0:
            raise ValueError(f"spec_acceptance={spec_acceptance}; must be in [0, 1)")
        if not sg_alpha > 0:
            raise ValueError(f"sg_alpha={sg_alpha}; must be > 0 (inf reduces service gain to goodput)")
        self.w = workload
        self.policy = policy
        self.seed = seed
        self.attainment = attainment
        self.sg_weights = (float(sg_weights[0]), float(sg_weights[1]))
        self.sg_alpha = float(sg_alpha)
        self.spec_acceptance = spec_acceptance
        # a backend timing iterations itself cannot be fast-forwarded through the vectorized perf model
        self._timed_here = not self.live and type(self).iteration_time is Simulator.iteration_time
        self.fast_forward = fast_forward and self._timed_here
        # the pilot replaces these methods' work for the iterations it runs: a subclass changing any is stepped
        self.pilot = pilot and self._timed_here and all(
            getattr(type(self), m) is getattr(Simulator, m) for m in _PILOT_REPLACES)
        self.validate = validate
        self.progress = progress
        engines = list(engine) if isinstance(engine, (list, tuple)) else [engine] * n_instances
        if len(engines) != n_instances:
            raise ValueError(f"{len(engines)} engines given for n_instances={n_instances}")
        self.engines = engines
        self.roles = roles
        self.pd = None if pd is None else (roles.count(Role.PREFILL), roles.count(Role.DECODE))
        self.transfer = KVTransfer() if transfer is None else transfer
        if pd is not None:
            self.transfer.bytes_for(engines[0])  # fail now, naming the engine, if its KV size is unknown
        self.agent_route = False
        self.agent_schedule = False
        self.defer_timing = False  # yield ("time", instance, features) for a driver to answer with seconds
        self._reset_state()

    @staticmethod
    def _roles(pd: tuple[int, int] | None, n_instances: int | None, engine: Any) -> tuple[list[Role], int]:
        """Initial roles (and the instance count) from ``pd`` / ``n_instances`` / an engine list."""
        if pd is None:
            n = n_instances if n_instances is not None else (
                len(engine) if isinstance(engine, (list, tuple)) else 1)
            if n < 1:
                raise ValueError(f"n_instances={n}; must be >= 1")
            return [Role.COLOCATED] * n, n
        try:
            p, d = (int(x) for x in pd)
        except (TypeError, ValueError):
            raise ValueError(f"pd={pd!r}; expected (prefill instances, decode instances)") from None
        if p < 1 or d < 1:
            raise ValueError(f"pd={pd!r}; needs at least one prefill and one decode instance")
        if n_instances is not None and n_instances != p + d:
            raise ValueError(f"n_instances={n_instances} but pd={pd!r} makes {p + d} instances")
        return [Role.PREFILL] * p + [Role.DECODE] * d, p + d

    # ================================================================== public API
    def run(self) -> "Simulator":
        """Run to completion (every request reaches an outcome). Returns self; see :meth:`result`."""
        for msg in self.decisions():
            raise SchedulerError(f"decision {msg[0]!r} requested but no agent is attached")
        return self

    def decisions(self) -> _Gen:
        """Generator over the run; yields decision requests when an agent is attached (see module doc)."""
        self._wall0 = time.perf_counter()
        self.policy.reset(self)
        self._coupled = self.policy.router.coupled  # read by every _ff_horizon
        # a driver that times iterations itself (defer_timing: the vector env's batch_timing=True) sees them all
        self._pilot_on = self.pilot and not self.agent_schedule and not self.defer_timing
        self._setup_parking()
        if self.policy.scaler is not None:
            self.add_timer(self.policy.scaler.interval, self._scaler_tick)
        yield from self._loop()
        self._finalize()
        self.wall_seconds = time.perf_counter() - self._wall0

    def result(self) -> RunResult:
        return RunResult.from_simulator(self)

    def add_timer(self, t: float, callback: Any) -> None:
        """Call ``callback(sim, t)`` at time ``t`` (a cluster event; idle instances are offered work after)."""
        self._seq += 1
        heapq.heappush(self._glob, (t, self._seq, _TIMER, callback))

    def log_event(self, t: float, kind: str, req: int, inst: int, detail: int = 0) -> None:
        self.events.append((t, kind, req, inst, detail))

    # ================================================================== backend hooks (live engines override)
    def iteration_time(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray | None,
                       features: BatchFeatures) -> float:
        """Seconds of the iteration about to launch on ``inst``: batch members ``idx`` computing ``tok`` tokens
        each (plus ``spec`` drafts, or None), with integer ``features``. Default: the engine's perf model.
        A live backend overrides it to run the batch on a real engine (fast-forward is then disabled)."""
        return inst.time_one(features)

    def on_kv_freed(self, r: int, inst: Instance) -> None:
        """Request ``r``'s KV was dropped from ``inst`` (finish, preemption, drop, transfer-out). No-op here."""

    def on_request_placed(self, r: int, inst: Instance) -> None:
        """Request ``r`` joined ``inst``'s waiting list (routing, tool return, preemption, KV arrival). No-op."""

    # ================================================================== cluster API (lifecycle and scaling)
    def add_instance(self, engine: Any = None, role: Role = Role.COLOCATED, cold_start: float | str = 0.0,
                     pool: int = 0) -> int:
        """Start a new instance now; it is STARTING for ``cold_start`` seconds (or a HyperFlexis Table 2
        method: ``disk``, ``cpu_offload``, ``d2d``; see :func:`~slogym.core.cluster.cold_start_seconds`), then
        ACTIVE. Its cost clock starts now. Returns its index. ``engine`` defaults to instance 0's."""
        eng = self.engines[0] if engine is None else engine
        t = self.now
        ready = t + cold_start_of(eng, cold_start)
        i = len(self.instances)
        inst = Instance(i, eng, self, Role(role), started_at=t, ready_at=ready, pool=int(pool))
        self.instances.append(inst)
        self._start_lifecycle()
        self._pd |= inst.role == Role.PREFILL
        self.log_event(t, "instance_start", -1, i, int(inst.role))
        if inst.accepting:
            self.log_event(t, "instance_ready", -1, i)
        self._push(ready, _READY, i)  # becomes ACTIVE then; deferred requests and KV hand-offs are retried
        return i

    def _start_lifecycle(self) -> None:
        """Instances may now start, stop or switch roles: the pilot steps aside (and parks no instance)."""
        self._lifecycle = True
        self._park_ok = False
        self._unpark_all()

    def drain_instance(self, i: int) -> None:
        """Stop instance ``i`` gracefully: DRAINING (accepts nothing new) until every request resident, parked
        or arriving there is done, then STOPPED. A STARTING instance stops at once; a STOPPED one is left."""
        inst = self._instance(i)
        if inst.state == InstanceState.STOPPED:
            return
        self._start_lifecycle()
        inst.switch_to = None
        if inst.state == InstanceState.STARTING:
            self._retire(inst, self.now)
            return
        if inst.state == InstanceState.ACTIVE:
            inst.state = InstanceState.DRAINING
            self.log_event(self.now, "instance_drain", -1, inst.id)
        self._check_drained(inst, self.now)

    def switch_role(self, i: int, role: Role) -> None:
        """Give instance ``i`` a new role: at once when it holds nothing (or is still starting), else it
        drains first and returns to ACTIVE with ``role`` when empty (cancelling a pending stop)."""
        inst = self._instance(i)
        role = Role(role)
        if inst.state == InstanceState.STOPPED:
            raise SchedulerError(f"cannot switch the role of instance {i}: it is STOPPED")
        self._start_lifecycle()
        self._pd |= role == Role.PREFILL
        if inst.state == InstanceState.STARTING or (inst.state == InstanceState.ACTIVE and inst.empty):
            if role != inst.role:
                inst.role = role
                self.log_event(self.now, "role_switch", -1, i, int(role))
                if inst.accepting:
                    self._push(self.now, _READY, i)
            return
        if inst.state == InstanceState.ACTIVE and role == inst.role:
            return
        inst.switch_to = role
        if inst.state == InstanceState.ACTIVE:
            inst.state = InstanceState.DRAINING
            self.log_event(self.now, "instance_drain", -1, i)
        self._check_drained(inst, self.now)

    def set_pool(self, i: int, pool: int) -> None:
        """Label instance ``i`` with ``pool`` (a tier or pool index policies choose)."""
        self._instance(i).pool = int(pool)

    def accepting_instances(self, role: Role | tuple[Role, ...] | None = None, pool: int | None = None) -> list[int]:
        """Indices of ACTIVE instances, optionally of the given role(s) and pool."""
        roles = None if role is None else ((role,) if isinstance(role, int) else tuple(role))
        return [x.id for x in self.instances if x.state == InstanceState.ACTIVE
                and (roles is None or x.role in roles) and (pool is None or x.pool == pool)]

    def _instance(self, i: int) -> Instance:
        if not 0 <= i < len(self.instances):
            raise SchedulerError(f"instance {i} does not exist; there are {len(self.instances)}")
        return self.instances[i]

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._glob, (t, self._seq, kind, payload))

    def _check_drained(self, inst: Instance, t: float) -> None:
        if inst.state == InstanceState.DRAINING and inst.empty:
            self._retire(inst, t)

    def _retire(self, inst: Instance, t: float) -> None:
        """An empty draining (or still starting) instance stops, or takes its pending role and is ACTIVE."""
        if inst.switch_to is not None:
            inst.role, inst.switch_to = inst.switch_to, None
            inst.state = InstanceState.ACTIVE
            self.log_event(t, "role_switch", -1, inst.id, int(inst.role))
            self._push(t, _READY, inst.id)
            return
        inst.state = InstanceState.STOPPED
        inst.stopped_at = t
        self.log_event(t, "instance_stop", -1, inst.id)

    def _on_ready(self, i: int, t: float) -> _Gen:
        """Instance ``i``'s cold start ended (or it became accepting): retry what waits for capacity."""
        inst = self.instances[i]
        if inst.state == InstanceState.STARTING:
            inst.state = InstanceState.ACTIVE
            self.log_event(t, "instance_ready", -1, i)
        yield from self._retry_handoffs(t)
        if self.global_queue:
            yield from self._retry_queue(t)

    def _retry_handoffs(self, t: float) -> _Gen:
        """Ask the router again for the decode instance of each prefilled request waiting for one."""
        wait, self._handoff_wait = self._handoff_wait, []
        for r in wait:
            yield from self._send_kv(r, t)

    # ================================================================== state
    def _reset_state(self) -> None:
        w = self.w
        self.rs = RequestState(w)
        self.now = 0.0
        self.global_queue: list[int] = []
        self.completed: list[int] | None = None  # when a list, every request reaching an outcome is appended
        self.events: list[tuple[float, str, int, int, int]] = []
        self.dropped_reasons: dict[str, int] = {}
        self.rng = np.random.default_rng(self.seed)
        # iteration ends (time, instance id, sequence number): a tie goes to the lower instance id, whatever the
        # order the iterations were launched in (the pilot launches an instance's iterations ahead of the others)
        self._iter: list[tuple[float, int, int]] = []
        self._glob: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._na = 0
        self._arrival = w.arrival
        self._ta = float(w.arrival[0]) if len(w) else INF  # arrival time of request _na (inf: none left)
        self._n_done = 0
        self.ff_iterations = 0
        self.pilot_iterations = 0  # iterations the compiled pilot ran, and arrivals it placed
        self.pilot_arrivals = 0
        self.wall_seconds = 0.0
        self._skind = w.stage_kind.astype(np.int64)
        self._is_dec_stage = self._skind == _DECODE
        # output buffers of the iteration-end and admission kernels (a batch never exceeds the workload)
        self._fin_buf = np.empty(len(w), np.int64)
        self._pre_buf = np.empty(len(w), np.int64)
        self._admit_buf = np.empty(len(w), np.int64)
        self._waits_with_kv = np.zeros(len(w), np.bool_)  # joined a waiting list holding KV (n_waiting_kv)
        self._blocks_buf = np.empty(len(w), np.int64)  # KV blocks per request of the batch being launched
        self._no_spec = np.zeros(len(w), np.int64)
        work = np.empty((pilot.N_ROWS, len(w) + _PILOT_HEAD), np.int64)  # rows: pilot.W_*
        work[pilot.W_ZERO] = 0
        self._pilot_io = (work, np.empty(len(w)))
        # largest context a request reaches: all its prefill and decode tokens (KV kept across stages)
        tok = np.where(w.stage_kind != _EXTERNAL, w.stage_tokens, 0)
        c = np.concatenate(([0], np.cumsum(tok)))
        self._max_ctx = c[w.stage_ptr[1:]] - c[w.stage_ptr[:-1]]
        self._pilot_args = self._pilot_tables() + (float(self.sg_weights[0]), float(self.sg_alpha), NO_TPOT)
        self._groups: dict[tuple[int, int], int] = {}
        self._held: dict[tuple[int, int], list[int]] = {}
        for g, s in zip(w.group[w.group >= 0].tolist(), w.group_stage[w.group >= 0].tolist()):
            self._groups[(g, s)] = self._groups.get((g, s), 0) + 1
        self._group_stage_open = {g: 0 for g, _ in self._groups}
        self._pbar = None
        self.instances = [Instance(i, e, self, role) for i, (e, role) in enumerate(zip(self.engines, self.roles))]
        self._pd = Role.PREFILL in self.roles  # other instances' iteration ends can hand KV off: see _ff_horizon
        self._lifecycle = False  # set by the first drain / switch / add: instances may then stop or flip
        self._xfer_dst: dict[int, int] = {}  # request -> decode instance, while its KV is in flight
        self._staged: dict[int, tuple[int, int]] = {}  # arrived, not yet admitted: request -> (source, its blocks)
        self._handoff_wait: list[int] = []  # prefilled requests no decode instance could take yet
        self._pilot_fin: list[int] = []  # stage ends a pilot run left to _pilot_handback
        self._offer_t = INF  # the time the global queue is being offered at (_retry_queue), else inf
        self._park_ok = False  # instances may be parked (_setup_parking)
        self._pk_t, self._pk_id = INF, -1  # the earliest iteration end of a parked instance, and its id
        self.kv_transfers = 0

    # ================================================================== event loop
    def _loop(self) -> _Gen:
        it, gl = self._iter, self._glob
        if self.progress:
            from tqdm import tqdm

            self._pbar = tqdm(total=n, unit="req", mininterval=0.5, leave=False)
        while True:
            ta = self._ta
            ti = it[0][0] if it else INF
            tg = gl[0][0] if gl else INF
            tc = self._pk_t
            # a parked instance's iteration end comes next (heap order: a tie in time goes to the lower id)
            if tc < INF and tc <= tg and tc <= ta and (tc < ti or tc == ti and self._pk_id < it[0][1]):
                code, inst = self._drain(ti, tg, ta)
                if code != pilot.LAUNCHED and code != pilot.IDLE:
                    yield from self._pilot_handback(inst, code)
            elif ti <= tg and ti <= ta and ti < INF:
                t, i, _ = heapq.heappop(it)
                self.now = t
                inst = self.instances[i]
                code = self._pilot(inst, t) if self._pilot_on else _NO_PILOT
                if code == _NO_PILOT:
                    yield from self._on_iteration_done(inst, t)
                elif code != pilot.LAUNCHED and code != pilot.IDLE:
                    yield from self._pilot_handback(inst, code)
            elif tg <= ta and tg < INF:
                t, _, kind, payload = heapq.heappop(gl)
                self.now = t
                if kind == _EXT_DONE:
                    yield from self._on_external_done(payload, t)
                elif kind == _RELEASE:
                    yield from self._begin(payload, t)
                elif kind == _TIMER:
                    payload(self, t)
                    for inst in self.instances:
                        if not inst.busy and inst.n_resident:
                            yield from self._schedule(inst, t)
                elif kind == _XFER_DONE:
                    yield from self._on_transfer_done(payload, t)
                else:
                    yield from self._on_ready(payload, t)
            elif ta < INF:
                r = self._na
                self._arrived(r + 1)
                self.now = ta
                yield from self._on_arrival(r, ta)
            else:
                break
        if self._pbar is not None:
            self._pbar.close()

    def _arrived(self, na: int) -> None:
        """Requests before ``na`` have arrived."""
        self._na = na
        self._ta = float(self._arrival[na]) if na < self._arrival.size else INF

    def _scaler_tick(self, sim: "Simulator", t: float) -> None:
        scaler = self.policy.scaler
        scaler.decide(self, t)
        if self._ticks_go_on():
            self.add_timer(t + scaler.interval, self._scaler_tick)

    def _ticks_go_on(self) -> bool:
        """A scaler keeps ticking while a request has no outcome and something can still happen without it: an
        arrival, an iteration in flight, or an event (a tool call's return, a KV transfer, a cold start). Work
        that only waits (deferred requests or hand-offs with the cluster idle) stops the ticks: a scaler that
        declined to add capacity for it would decline forever, and the run would not end."""
        return self._n_done < len(self.w) and bool(self._na < len(self.w) or self._iter or self._glob
                                                   or self._pk_t < INF)

    # ================================================================== arrivals and routing
    def _on_arrival(self, r: int, t: float) -> _Gen:
        g = int(self.w.group[r])
        if g >= 0:
            s = int(self.w.group_stage[r])
            if s > self._group_stage_open[g]:
                self.rs.status[r] = Status.HELD
                self._held.setdefault((g, s), []).append(r)
                return
        yield from self._begin(r, t)

    def _begin(self, r: int, t: float) -> _Gen:
        """Request ``r`` becomes ready at ``t`` with its first stage (a prefill)."""
        rs = self.rs
        rs.ready[r] = t
        rs.num_tokens[r] = rs.stage_len[r]
        yield from self._route(r, t)

    def _route(self, r: int, t: float) -> _Gen:
        if self.agent_route:
            action = yield ("route", r, t)
        else:
            action = self.policy.router.route(r, self, t)
        yield from self._apply_route(r, int(action), t)

    def _apply_route(self, r: int, action: int, t: float) -> _Gen:
        if action >= 0:
            if action >= len(self.instances):
                raise SchedulerError(f"router sent request {r} to instance {action}; "
                                     f"there are {len(self.instances)}")
            inst = self.instances[action]
            if inst.state != InstanceState.ACTIVE or inst.role == Role.DECODE:
                raise SchedulerError(f"router sent request {r} to instance {action}, which is "
                                     f"{inst.state.name} with role {inst.role.name}; new requests go to "
                                     f"accepting COLOCATED or PREFILL instances (sim.accepting_instances)")
            yield from self._place(r, inst, t)
        elif action == DEFER:
            self.rs.status[r] = Status.QUEUED
            self.global_queue.append(r)
        elif action == REJECT:
            yield from self._done(r, Outcome.REJECTED, t)
        elif action == BEST_EFFORT:
            self.rs.be[r] = True
            i = int(self.policy.router.best_effort_instance(r, self, t))
            yield from self._apply_route(r, i, t)
        else:
            raise SchedulerError(f"router returned {action} for request {r}; expected an instance index "
                                 f"0..{len(self.instances) - 1}, DEFER={DEFER}, REJECT={REJECT} or "
                                 f"BEST_EFFORT={BEST_EFFORT}")

    def _place(self, r: int, inst: Instance, t: float) -> _Gen:
        if self._max_ctx[r] > inst.total_blocks * inst.block_size:
            yield from self._drop(r, "exceeds_kv_capacity", t)
            return
        rs = self.rs
        rs.instance[r] = inst.id
        rs.slot[r] = inst.id
        rs.status[r] = _WAITING
        self._enqueue(inst, r)
        if not inst.busy:
            yield from self._schedule(inst, t)

    def _enqueue(self, inst: Instance, r: int, front: bool = False) -> None:
        """``r`` joins ``inst``'s waiting list (at the back, or the front for a preempted request), counted in
        ``n_waiting_kv`` when it holds KV there."""
        if (type(inst) is ParkedInstance and not front and self.rs.kv_blocks[r] == 0 and r not in self._staged
                and pilot.enqueue_parked(self._pk_i, self._pk_f, self._pk_wait, inst.id, r, _PARK_CAP)):
            self.on_request_placed(r, inst)
            return
        if front:
            inst.waiting.insert(0, r)
        else:
            inst.waiting.append(r)
            seq, floor, after_next = inst.finish_floor
            if floor > after_next:  # it could finish in the instance's next iteration
                inst.finish_floor = (seq, after_next, after_next)
        if self.rs.kv_blocks[r] > 0:
            self._waits_with_kv[r] = True
            inst.n_waiting_kv += 1
        self.on_request_placed(r, inst)

    def _dequeue(self, inst: Instance, r: int) -> None:
        """``r`` leaves ``inst``'s waiting list (admitted to the running set, or released)."""
        inst.waiting.remove(r)
        if self._waits_with_kv[r]:
            self._waits_with_kv[r] = False
            inst.n_waiting_kv -= 1

    # ================================================================== scheduling an iteration
    def _schedule(self, inst: Instance, t: float) -> _Gen:
        """Ask the scheduler for ``inst``'s next batch and start it: through the compiled pilot when the scheduler
        has a rule for it (:meth:`_pilot` with ``start``), else in Python, fast-forwarding steady stretches."""
        inst.busy = True  # no nested scheduling of this instance while its batch is being formed
        if self._pilot_on:  # the scheduler's compiled rule, when it has one
            code = self._pilot(inst, t, start=True)
            if code == pilot.LAUNCHED or code == pilot.IDLE:
                return
            inst.busy = True
        rs = self.rs
        while True:
            self.now = t
            if self.agent_schedule:
                batch = yield ("schedule", inst, t)
            else:
                batch = self.policy.scheduler.next_batch(inst, t)
            if batch is None:
                inst.busy = False
                return
            side = batch.preempt or batch.drop or batch.demote
            if side:
                yield from self._apply_side_actions(inst, batch, t)
            if batch.empty:
                if side and inst.n_resident:
                    continue
                inst.busy = False
                return
            idx = np.asarray(batch.req, dtype=np.int64)
            tok = np.asarray(batch.tokens, dtype=np.int64)
            spec = None if batch.spec is None else np.asarray(batch.spec, dtype=np.int64)
            if self.validate:
                self._check_batch(inst, idx, tok, spec)
            # a stretch too close to the next event is cheaper to step (the horizon is checked before the call)
            if (batch.steady and self.fast_forward and spec is None and not side and not self.agent_schedule
                    and (horizon := self._ff_horizon()) - t >= FF_MIN_STRETCH * inst.last_dt):
                ff = yield from self._fast_forward(inst, idx, tok, t, horizon)
                if ff is not None:
                    t, same = ff
                    if not same:
                        continue
                    # by the steady contract the scheduler would return this batch again (minus finished
                    # requests) at t: start it without asking
                    alive = rs.slot[idx] == inst.id
                    idx, tok = (idx, tok) if alive.all() else (idx[alive], tok[alive])
                    if not idx.size:
                        inst.busy = False
                        return
                    if self._ff_fit_kv(inst, idx, tok, 1) < 1:
                        continue  # the next step needs KV that is not free: the scheduler decides
            f, need, total = self._prepare_iteration(inst, idx, tok, spec)
            if self.defer_timing:
                dt = yield ("time", inst, f)
            elif self._timed_here:
                dt = inst.time_one(f)  # the default iteration_time, without the call
            else:
                dt = self.iteration_time(inst, idx, tok, spec, f)
            self._launch(inst, idx, tok, spec, need, total, float(dt), f, t)
            return

    def _apply_side_actions(self, inst: Instance, batch: Batch, t: float) -> _Gen:
        for r in batch.preempt:
            self._preempt(inst, int(r), t)
        if batch.preempt:
            # once for all victims: they hold no KV, so one stable partition after prepending them all equals
            # one after each
            self._kv_holders_first(inst)
        for r in batch.demote:
            self.rs.be[int(r)] = True
        for r in batch.drop:
            yield from self._drop(int(r), "scheduler", t)

    def _check_batch(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray | None) -> None:
        rs = self.rs
        if idx.shape != tok.shape:
            raise SchedulerError(f"instance {inst.id}: batch.req has {idx.size} entries, tokens {tok.size}")
        code, j = kernels.check_batch(rs.I, idx, tok, inst.id, rs.scratch)
        if code:
            r = int(idx[j])
            if code == 1:
                raise SchedulerError(f"instance {inst.id}: request {r} is not waiting or running here "
                                     f"(status {Status(rs.status[r]).name}, instance {rs.instance[r]})")
            if code == 2:
                rem = int(rs.num_tokens[r] - rs.num_computed[r])
                raise SchedulerError(f"instance {inst.id}: request {r} scheduled {tok[j]} tokens; "
                                     f"it has {rem} left to compute (must be 1..{rem})")
            raise SchedulerError(f"instance {inst.id}: batch lists a request twice: {idx.tolist()}")
        if spec is not None:
            decoding = (rs.num_tokens[idx] - rs.num_computed[idx] == 1) & (self._skind[rs.stage[idx]] == _DECODE)
            if spec.shape != idx.shape or (spec < 0).any() or ((spec > 0) & ~decoding).any():
                raise SchedulerError(f"instance {inst.id}: batch.spec must be >= 0 per request and only set "
                                     f"on decode steps; got {spec.tolist()}")

    def _prepare_iteration(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray | None,
                           ) -> tuple[BatchFeatures, np.ndarray, int]:
        """Features of the batch and the KV blocks each request holds after it (checked against free blocks)."""
        blocks = self._blocks_buf[:idx.size]
        *f, total = kernels.batch_features(self.rs.I, idx, tok, self._no_spec[:idx.size] if spec is None else spec,
                                           inst.block_size, blocks)
        if total > inst.free_blocks:
            raise SchedulerError(f"instance {inst.id}: batch needs {total} KV blocks, {inst.free_blocks} free "
                                 f"(requests {idx.tolist()})")
        return BatchFeatures(*f), blocks, total

    def _launch(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray | None,
                blocks: np.ndarray, total: int, dt: float, f: BatchFeatures, t: float) -> None:
        """Allocate the batch's KV and put its iteration in flight until ``t + dt``."""
        if not dt > 0.0:
            raise SchedulerError(f"engine {inst.engine.name} gave iteration time {dt!r} for batch {f}")
        rs = self.rs
        rs.kv_blocks[idx] = blocks
        inst.free_blocks -= total
        if inst.waiting:
            self._admit(inst, idx, t)
        inst.busy = True
        inst.inflight = (idx, tok, spec)
        inst.busy_time += dt
        inst.last_dt = dt
        self._seq += 1
        heapq.heappush(self._iter, (t + dt, inst.id, self._seq))

    def _admit(self, inst: Instance, idx: np.ndarray, t: float) -> None:
        """Waiting requests of a batch join the running set."""
        rs = self.rs
        n = kernels.admit(rs.status, rs.first_scheduled, idx, t, _WAITING, _RUNNING, self._admit_buf)
        if not n:
            return
        for r in self._admit_buf[:n].tolist():
            self._dequeue(inst, r)
            inst.running.append(r)
            if inst.n_staged and r in self._staged:
                self._unstage(r, inst, t)
        inst.running_changed()

    # ================================================================== fast-forward
    def _ff_horizon(self, arrivals: bool = True) -> float:
        """Time of the next event that could reach an instance (``arrivals``: counting the next arrival)."""
        h = self._ta if arrivals else INF
        if self._offer_t < h:  # the global queue is being offered (_retry_queue)
            h = self._offer_t
        if self._glob:
            h = min(h, self._glob[0][0])
        if not self._iter and self._pk_t == INF:
            return h
        if self._coupled or self._held or self._handoff_wait:
            # another instance's iteration end may wake something for this instance
            return min(h, self._next_end())
        if self.global_queue:  # a finish elsewhere offers the deferred requests again
            h = min(h, self._earliest_finish())
        if self._pd:
            # a prefill instance's iteration end hands KV off: route_decode reads the decode instances' state
            # then, and the transfer it starts may end inside this stretch
            ins = self.instances
            h = min(h, min((e[0] for e in self._iter if ins[e[1]].role == Role.PREFILL), default=INF))
        return h

    def _next_end(self) -> float:
        """The time of the next iteration end (on the heap or of a parked instance)."""
        return min(self._iter[0][0], self._pk_t) if self._iter else self._pk_t

    def _earliest_finish(self) -> float:
        """Earliest time a request on an instance with an iteration in flight could finish: its iteration's end,
        or later where the pilot launched that iteration and bounded it (``Instance.finish_floor``)."""
        h = self._heap_finish()
        return min(h, pilot.parked_finish(self._pk_i, self._pk_f)) if self._pk_t < INF else h

    def _heap_finish(self) -> float:
        """:meth:`_earliest_finish` over the instances on the heap (not parked)."""
        ins = self.instances
        h = INF
        for t, i, seq in self._iter:
            s, floor, _ = ins[i].finish_floor
            if s == seq and floor > t:
                t = floor
            if t < h:
                h = t
        return h

    def _fast_forward(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, t: float, horizon: float,
                      ) -> Generator[tuple, Any, tuple[float, bool] | None]:
        """Apply, in bulk, the iterations of a steady batch that end before the horizon.

        A steady batch repeats with the same tokens per request: decode steps (one token each) and prefill
        chunks that stop short of completing their prefill. Decode requests in their last stage may finish inside
        the stretch when the scheduler's rule is unchanged by a finish (``steady_through_finish``, nothing
        waiting, an all-decode batch, no group or global queue to wake). Returns None when nothing could be
        applied, else ``(t, same)``: the last applied iteration's end, and whether the next iteration is known to
        be the same batch (the stretch stopped only because the next event or a decode stage end is one
        iteration away); otherwise the scheduler is asked again at ``t``. ``horizon`` is the next event's time.
        """
        rs, w = self.rs, self.w
        # a finish frees KV and budget: only the rule's whole input (every running request, nothing waiting)
        # guarantees the next batch is the rest of this one
        through = (self.policy.scheduler.steady_through_finish and not inst.waiting and not self.global_queue
                   and not self._handoff_wait and idx.size == len(inst.running))
        k_cap = int((horizon - t) / inst.last_dt) + 2 if horizon < INF else _FF_MAX
        is_dec = np.empty(idx.size, np.bool_)
        q_max, left = np.empty(idx.size, np.int64), np.empty(idx.size, np.int64)
        k_max, k_same, n_dec, feats = kernels.steady_stretch(rs.I, rs.stage, self._is_dec_stage, w.stage_ptr,
                                                             w.group, idx, tok, through, _FF_MAX, k_cap, is_dec,
                                                             q_max, left)
        if k_max < 2:
            return None
        q_max, left = q_max[:n_dec], left[:n_dec]
        feats = BatchFeatures(*feats)
        dts = np.asarray(inst.engine.batch_time(feats), dtype=np.float64)
        ends, k = kernels.stretch_ends(t, dts, horizon)
        same = k < k_max or k == k_same  # stopped by the horizon, or a decode stage ends next iteration
        k_fit = self._ff_fit_kv(inst, idx, tok, k)
        if k_fit < k:
            k, same = k_fit, False
        if k < 1:
            return None
        yield from self._apply_run(inst, idx, tok, is_dec, n_dec == idx.size, np.minimum(q_max, k), left, t,
                                   ends[:k], dts[:k])
        return float(ends[k - 1]), same

    def _ff_fit_kv(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, k: int) -> int:
        """Largest k' <= k such that every request growing by k' * tokens fits in free KV blocks
        (an upper bound on what the stretch really needs, since finishing requests stop growing)."""
        I, bs, free = self.rs.I, inst.block_size, inst.free_blocks
        if k < 1 or kernels.kv_growth(I, idx, tok, k, bs) <= free:
            return k
        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kernels.kv_growth(I, idx, tok, mid, bs) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _apply_run(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, is_dec: np.ndarray, all_dec: bool,
                   q: np.ndarray, left: np.ndarray, t: float, ends: np.ndarray, dts: np.ndarray) -> _Gen:
        """Account ``len(ends)`` iterations of a steady batch exactly as stepping would, in bulk.

        ``q`` is each decode request's number of tokens in the stretch (fewer than ``len(ends)`` for those that
        finish inside it).
        """
        k = ends.size
        grown, new_blocks, inst.busy_time = kernels.apply_run(self.rs.F, self.rs.I, idx, tok, is_dec, q, ends, dts,
                                                              inst.busy_time, inst.block_size, self.sg_alpha)
        inst.free_blocks -= new_blocks
        if inst.waiting:
            self._admit(inst, idx, t)
        inst.iterations += k
        inst.tokens += grown
        inst.last_dt = float(dts[-1])
        self.ff_iterations += k
        done = np.flatnonzero(q == left)
        if done.size:  # finishes in step order: by iteration, then batch position
            dec = idx if all_dec else idx[is_dec]
            for pos in done[np.argsort(q[done], kind="stable")].tolist():
                yield from self._end_decode_stage(int(dec[pos]), float(ends[q[pos] - 1]))

    def _decay(self, ratio: np.ndarray) -> np.ndarray:
        """Tempo's divisive decay f = min{1, (SLO / metric)^alpha} (Eq. 2-3) from ratio = SLO / metric."""
        return kernels.decay(ratio, self.sg_alpha)

    # ================================================================== the compiled pilot
    def _pilot_tables(self) -> tuple:
        """The request tables :func:`slogym.core.pilot.run_instance` reads and writes, and which requests it
        finishes itself: a prompt, optionally followed by one decode stage, outside any collective group."""
        rs, w = self.rs, self.w
        first = w.stage_ptr[:-1]
        n_st = np.diff(w.stage_ptr)
        nxt = np.minimum(first + 1, len(self._skind) - 1)
        simple = (w.group < 0) & (self._skind[first] == _PREFILL) & (
            (n_st == 1) | ((n_st == 2) & (self._skind[nxt] == _DECODE)))
        return (rs.F, rs.I, rs.status, rs.first_scheduled, rs.stage, rs.ready, rs.ttft_slack, rs.sg_in,
                rs.first_token, rs.stage_t0, rs.mean_slack, rs.outcome, rs.finish, rs.be, rs.recomputed, rs.n_preempt,
                simple, w.arrival, w.group, self._max_ctx, rs.instance, w.stage_ptr, self._is_dec_stage, w.stage_ttft,
                w.stage_tokens, w.stage_tpot)

    def _pilot(self, inst: Instance, t: float, start: bool = False) -> int:
        """End ``inst``'s iteration at ``t`` and run it up to the next event with the compiled pilot when its
        scheduler and perf model have compiled forms. Returns the pilot's code (``pilot.LAUNCHED`` / ``IDLE``:
        nothing left to do; ``TRANSITIONS`` / ``SCHEDULE``: :meth:`_pilot_handback` finishes the iteration end at
        ``self.now``), or ``_NO_PILOT`` (nothing done) when it does not apply. A plain function, not a generator:
        the common case, a launch, costs no generator frame.

        With ``start``, ``inst`` is free at ``t`` with nothing in flight (:meth:`_schedule`): the pilot ends an
        empty batch (not counted) and, with ``t`` as its horizon, forms and launches one batch as the scheduler
        would (``LAUNCHED``), finds nothing to run (``IDLE``), or leaves the decision to the scheduler
        (``SCHEDULE``).

        Where parking is on (:meth:`_setup_parking`), a launch parks the instance instead of putting it on the
        heap: its later iteration ends run in :meth:`_drain`."""
        idx, tok, spec = (_NONE, _NONE, None) if start else inst.inflight
        if (inst.time_coef is None or spec is not None or inst.role != Role.COLOCATED or self._lifecycle
                or inst.n_waiting_kv or inst.n_staged):
            return _NO_PILOT
        rule = self.policy.scheduler.pilot_rule(inst)
        if rule is None:
            return _NO_PILOT
        work, ev_t = self._pilot_io
        waiting = inst.waiting
        head = np.array(waiting[:_PILOT_HEAD], np.int64) if waiting else _NONE
        router = self.policy.router
        # arrivals are placed by the pilot too when the router would send every one here
        absorb = not (start or self.agent_route or self.global_queue) and router.pilot_target(self) == inst.id
        horizon = t if start else self._ff_horizon(arrivals=not absorb)
        sync_t, sync_id = self._iter[0][:2] if self._iter else (INF, 0)  # the next iteration end elsewhere
        if (self._pk_t, self._pk_id) < (sync_t, sync_id):
            sync_t, sync_id = self._pk_t, self._pk_id
        (code, t, t_end, m, n_run, n_wait, n_done, inst.free_blocks, iters, tokens, busy, last_dt, n_ev, na, n_app,
         run_changed, same, floor) = pilot.run_instance(
            *self._pilot_args, idx, tok, inst.running_array(), head, work, ev_t, inst.time_coef,
            len(waiting) > _PILOT_HEAD, bool(self.global_queue or self._handoff_wait), inst.free_blocks,
            inst.block_size, inst.id, self._na, inst.total_blocks * inst.block_size if absorb else 0, *rule, t,
            horizon, inst.busy_time, inst.dt_floor, sync_t, sync_id)
        if na != self._na:
            router.pilot_routed(na - self._na)
            self.pilot_arrivals += na - self._na
            self._arrived(na)
        iters -= start  # the empty batch it ended first
        self.pilot_iterations += iters
        if n_done:
            self._pilot_done(work[pilot.W_DONE, :n_done].tolist())
        if n_ev:
            self._log_preemptions(inst.id, n_ev)
        self.now = t
        if (code == pilot.LAUNCHED and self._park_ok and not absorb and len(waiting) <= _PILOT_HEAD
                and n_run + n_wait < _PARK_CAP and not (self._held or self._handoff_wait)):
            self._seq += 1
            pilot.park(self._pk_i, self._pk_f, self._pk_coef, self._pk_run, self._pk_wait, self._pk_req, self._pk_tok,
                       work, inst.id, n_run, n_wait, m, inst.free_blocks, self._seq, inst.iterations + iters,
                       inst.tokens + tokens, t_end, busy, last_dt, floor, inst.dt_floor, inst.time_coef,
                       inst.block_size, *rule)
            inst.__class__ = ParkedInstance
            if (t_end, inst.id) < (self._pk_t, self._pk_id):
                self._pk_t, self._pk_id = t_end, inst.id
            return code
        inst.inflight = None
        inst.iterations += iters
        inst.tokens += tokens
        inst.busy_time = busy
        if n_wait != head.size or n_ev or absorb:
            waiting[:head.size] = work[pilot.W_WAIT, :n_wait].tolist()
        if n_app:
            waiting.extend(work[pilot.W_APP, :n_app].tolist())
        if run_changed:
            inst.set_running(work[pilot.W_RUN, :n_run])
        if code == pilot.LAUNCHED:  # still busy, with the next batch
            inst.last_dt = last_dt
            inst.inflight = (idx, tok, None) if same else (work[pilot.W_REQ, :m].copy(), work[pilot.W_TOK, :m].copy(),
                                                           None)
            self._seq += 1
            heapq.heappush(self._iter, (t_end, inst.id, self._seq))
            inst.finish_floor = (self._seq, floor, t_end + inst.dt_floor)
            return code
        if iters > 1:
            inst.last_dt = last_dt
        if code == pilot.TRANSITIONS:  # busy until _pilot_handback has applied them
            self._pilot_fin = work[pilot.W_FIN, :m].tolist()
        else:
            inst.busy = False
        return code

    def _log_preemptions(self, i: int, n_ev: int) -> None:
        """The preemptions a pilot run on instance ``i`` logged (``ev_t``, ``work[W_EVR/W_EVNC]``)."""
        work, ev_t = self._pilot_io
        self.events.extend((te, "preempt", r, i, nc) for te, r, nc in zip(
            ev_t[:n_ev].tolist(), work[pilot.W_EVR, :n_ev].tolist(), work[pilot.W_EVNC, :n_ev].tolist()))

    # ------------------------------------------------------------------ parked instances
    def _setup_parking(self) -> None:
        """Whether the pilot may park instances (:class:`~slogym.core.instance.ParkedInstance`) this run, and
        their tables. Parking keeps an instance's state in compiled tables between its iteration ends, so the
        iteration ends of every parked instance run in one compiled call (:meth:`_drain`). Off where the
        horizon of an instance depends on more than the next event and the earliest finish (a coupled router,
        P/D hand-offs, a scaler's lifecycle), where the router's pilot target places arrivals compiled (one
        instance), and where instances' perf models differ in shape."""
        insts = self.instances
        sizes = {i.time_coef.size for i in insts if i.time_coef is not None}
        self._park_ok = (self._pilot_on and len(insts) > 1 and len(sizes) == 1 and not self._coupled
                         and self.policy.scaler is None and not self._pd and not self._lifecycle
                         and self.policy.router.pilot_target(self) < 0)
        n, cap = len(insts), _PARK_CAP if self._park_ok else 0
        self._pk_i = np.zeros((n, pilot.N_PI), np.int64)
        self._pk_f = np.zeros((n, pilot.N_PF))
        self._pk_coef = np.zeros((n, max(sizes, default=0)))
        self._pk_run, self._pk_wait, self._pk_req, self._pk_tok = (np.zeros((n, cap), np.int64) for _ in range(4))

    def _drain(self, ti: float, tg: float, ta: float) -> tuple[int, Instance | None]:
        """Run the parked instances' iteration ends that come before the heap's next one (``ti``), the next
        cluster event (``tg``) and the next arrival (``ta``), in one compiled call (:func:`pilot.run_parked`),
        exactly as the event loop would end them one by one through :meth:`_pilot`. Returns the code of the last
        one and, when it is not ``LAUNCHED``, that instance, unparked, for :meth:`_pilot_handback`."""
        if self._held or self._handoff_wait:  # horizons then depend on every iteration end: the heap decides
            self._unpark_all()
            return pilot.LAUNCHED, None
        work, ev_t = self._pilot_io
        hid = self._iter[0][1] if self._iter else 0
        queued = bool(self.global_queue)
        code, k, t, m, n_done, n_ev, iters, self._seq, tn, kn = pilot.run_parked(
            *self._pilot_args, self._pk_i, self._pk_f, self._pk_coef, self._pk_run, self._pk_wait, self._pk_req,
            self._pk_tok, work, ev_t, ti, hid, tg, ta, self._heap_finish() if queued else INF, queued, self._seq)
        self.pilot_iterations += iters
        if n_done:
            self._pilot_done(work[pilot.W_RUN, :n_done].tolist())
        if t < INF:  # the time the last instance it ran stopped at, as after that instance's _pilot call
            self.now = t
        if n_ev:
            self._log_preemptions(k, n_ev)
        if code == pilot.LAUNCHED:
            self._pk_t, self._pk_id = tn, kn
            return code, None
        inst = self.instances[k]
        self._unpark(inst, code)
        self._pk_t, self._pk_id = pilot.next_parked(self._pk_i, self._pk_f)
        if code == pilot.TRANSITIONS:  # busy until _pilot_handback has applied them
            self._pilot_fin = work[pilot.W_FIN, :m].tolist()
        return code, inst

    def _unpark(self, inst: Instance, code: int = pilot.LAUNCHED) -> None:
        """Write parked ``inst``'s row back into it: with ``LAUNCHED`` its batch is still in flight (it goes on
        the heap), else its run ended with ``code`` (``TRANSITIONS``: busy until the stage ends are applied)."""
        i = inst.id
        _, free, n_run, n_wait, m, seq, iters, tokens, *_ = self._pk_i[i].tolist()
        t_end, busy_time, last_dt, floor, after, _ = self._pk_f[i].tolist()
        self._pk_i[i, pilot.PI_ON] = 0
        inst.__class__ = Instance
        inst.waiting[:] = self._pk_wait[i, :n_wait].tolist()
        inst.set_running(self._pk_run[i, :n_run])
        inst.free_blocks, inst.iterations, inst.tokens, inst.busy_time, inst.last_dt = (free, iters, tokens,
                                                                                        busy_time, last_dt)
        if code == pilot.LAUNCHED:
            inst.inflight = (self._pk_req[i, :m].copy(), self._pk_tok[i, :m].copy(), None)
            inst.busy = True
            heapq.heappush(self._iter, (t_end, i, seq))
            inst.finish_floor = (seq, floor, after)
        else:
            inst.inflight = None
            inst.busy = code == pilot.TRANSITIONS
        if i == self._pk_id:
            self._pk_t, self._pk_id = pilot.next_parked(self._pk_i, self._pk_f)

    def free_blocks(self) -> np.ndarray:
        """Free KV blocks of every instance, in order; unlike reading ``Instance.free_blocks`` one by one, a
        parked instance's come from its table row in bulk."""
        if self._pk_t == INF:
            return np.array([i.free_blocks for i in self.instances], np.int64)
        free = self._pk_i[:, pilot.PI_FREE].copy()
        for i in self.instances:
            if type(i) is not ParkedInstance:
                free[i.id] = i.free_blocks
        return free

    def waiting_tokens(self) -> np.ndarray:
        """Per instance, in order: tokens its waiting requests have yet to compute (prompts, recomputation), read
        without unparking an instance (reading ``Instance.waiting`` would)."""
        rs = self.rs
        out = np.zeros(len(self.instances), np.int64)
        if self._pk_t < INF:
            pilot.parked_waiting_tokens(self._pk_i, self._pk_wait, rs.I, out)
        for inst in self.instances:
            if type(inst) is not ParkedInstance and inst.waiting:
                w = inst.waiting
                out[inst.id] = int((rs.num_tokens[w] - rs.num_computed[w]).sum())
        return out

    def _unpark_all(self) -> None:
        """Unpark every parked instance (its batch in flight goes on the heap)."""
        for inst in self.instances:
            if type(inst) is ParkedInstance:
                self._unpark(inst)

    def _pilot_handback(self, inst: Instance, code: int) -> _Gen:
        """The rest of an iteration end the pilot handed back at ``self.now``, in Python: the stage ends it left
        (``TRANSITIONS``), then the scheduler."""
        t = self.now
        if code == pilot.TRANSITIONS:
            for r in self._pilot_fin:
                yield from self._transition(r, t)
            inst.busy = False
        if inst.n_resident:
            yield from self._schedule(inst, t)

    def _pilot_done(self, done: list[int]) -> None:
        """Bookkeeping of requests the pilot finished (their outcomes are already written)."""
        before = self._n_done
        self._n_done += len(done)
        if self.completed is not None:
            self.completed.extend(done)
        if self._pbar is not None and self._n_done // 1024 > before // 1024:
            self._pbar.update(1024 * (self._n_done // 1024 - before // 1024))

    # ================================================================== iteration end: token accounting
    def _on_iteration_done(self, inst: Instance, t: float) -> _Gen:
        idx, tok, spec = inst.inflight
        inst.inflight = None
        inst.iterations += 1
        rs = self.rs
        if spec is not None and spec.any():
            tok = self._accept_speculation(inst, idx, tok, spec, t)
        fin, pre = self._fin_buf[:idx.size], self._pre_buf[:idx.size]
        computed, n_fin, n_pre = kernels.end_iteration(rs.F, rs.I, self._is_dec_stage, rs.stage, idx, tok, t,
                                                       self.sg_alpha, fin, pre)
        inst.tokens += computed
        transitions = fin[:n_fin].tolist()
        prefilled = pre[:n_pre].tolist()
        transitions.extend(r for r in prefilled if self._end_prefill(r, t))
        for r in transitions:
            yield from self._transition(r, t)
        if prefilled and inst.role == Role.PREFILL:
            yield from self._hand_off(inst, prefilled, t)
        inst.busy = False
        if inst.n_resident:
            yield from self._schedule(inst, t)

    def _accept_speculation(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray,
                            t: float) -> np.ndarray:
        """Verify drafts (SLOs-Serve App. D): draft j is kept while drafts 0..j were all accepted, each with
        probability ``spec_acceptance``. Accepted drafts are emitted at ``t``; the verified (bonus) token is
        then emitted by the normal path. Returns the tokens entering the KV (1 + accepted); KV blocks of
        rejected drafts are freed. Drafts never run past the end of the decode stage.
        """
        rs = self.rs
        u = self.rng.random((idx.size, int(spec.max())))
        ok = (u < self.spec_acceptance) | (np.arange(u.shape[1])[None, :] >= spec[:, None])
        accepted = np.where(ok.all(axis=1), spec, ok.argmin(axis=1))
        accepted = np.minimum(accepted, rs.stage_len[idx] - rs.gen_in_stage[idx] - 1)
        fin = np.empty(idx.size, np.int64)
        for step in range(int(accepted.max())):  # drafts arrive together: zero gaps, f = 1
            kernels.emit_tokens(rs.F, rs.I, idx[accepted > step], t, self.sg_alpha, fin)
        keep = -(-(rs.num_computed[idx] + tok + accepted) // inst.block_size)
        freed = np.maximum(rs.kv_blocks[idx] - keep, 0)
        rs.kv_blocks[idx] -= freed
        inst.free_blocks += int(freed.sum())
        return tok + accepted

    # ================================================================== stage transitions
    def _end_prefill(self, r: int, t: float) -> bool:
        """A prefill stage caught up at ``t``; emit the following decode stage's first token.

        Returns True when a stage transition follows (a one-token output, or no decode after the prefill).
        """
        rs, w = self.rs, self.w
        return kernels.end_prefill(rs.F, rs.I, r, t, rs.stage, rs.ready, rs.ttft_slack, rs.sg_in, rs.first_token,
                                   rs.stage_t0, w.stage_ptr, self._is_dec_stage, w.stage_ttft, w.stage_tokens,
                                   w.stage_tpot, float(self.sg_weights[0]), self.sg_alpha, NO_TPOT)

    def _transition(self, r: int, t: float) -> _Gen:
        """``r``'s current stage just ended at ``t``."""
        s = int(self.rs.stage[r])
        if self._skind[s] == _PREFILL:
            yield from self._next_stage_after(r, s + 1, t)
        else:
            yield from self._end_decode_stage(r, t)

    def _end_decode_stage(self, r: int, t: float) -> _Gen:
        rs, w = self.rs, self.w
        s = int(rs.stage[r])
        n = int(rs.stage_len[r])
        after_prefill = s > w.stage_ptr[r] and self._skind[s - 1] == _PREFILL
        gaps = n - 1 if after_prefill else n
        if gaps > 0:
            rs.mean_slack[r] = min(rs.mean_slack[r], rs.tpot[r] - (t - rs.stage_t0[r]) / gaps)
        nxt = s + 1
        if nxt < w.stage_ptr[r + 1] and self._skind[nxt] == _DECODE:
            rs.stage[r] = nxt
            rs.stage_len[r] = w.stage_tokens[nxt]
            rs.tpot[r] = min(w.stage_tpot[nxt], NO_TPOT)
            rs.dl_base[r] = rs.final_deadline[r] + rs.tpot[r]
            rs.stage_t0[r] = t
            rs.gen_in_stage[r] = 0
            return
        yield from self._next_stage_after(r, nxt, t)

    def _next_stage_after(self, r: int, nxt: int, t: float) -> _Gen:
        """Move ``r`` to stage ``nxt`` (a prefill, an external call) or finish it."""
        rs, w = self.rs, self.w
        if nxt >= w.stage_ptr[r + 1]:
            yield from self._done(r, _BEST_EFFORT if rs.be[r] else _FINISHED, t)
            return
        rs.stage[r] = nxt
        kind = self._skind[nxt]
        if kind == _PREFILL:  # a new user turn in the same residency: KV kept
            rs.stage_len[r] = w.stage_tokens[nxt]
            rs.num_tokens[r] += w.stage_tokens[nxt]
            rs.ready[r] = t
            return
        # external: off the running set while the tool runs; its KV stays parked on the instance
        inst = self.instances[int(rs.instance[r])]
        inst.running.remove(r)
        inst.running_changed()
        inst.n_parked += 1
        rs.status[r] = Status.EXTERNAL
        rs.slot[r] = -1
        self._seq += 1
        heapq.heappush(self._glob, (t + float(w.stage_delay[nxt]), self._seq, _EXT_DONE, r))

    def _on_external_done(self, r: int, t: float) -> _Gen:
        """The tool returned: back to the same instance's waiting queue to prefill only the new tokens."""
        rs, w = self.rs, self.w
        nxt = int(rs.stage[r]) + 1
        rs.stage[r] = nxt
        rs.stage_len[r] = w.stage_tokens[nxt]
        rs.num_tokens[r] += w.stage_tokens[nxt]
        rs.ready[r] = t
        inst = self.instances[int(rs.instance[r])]
        inst.n_parked -= 1
        rs.status[r] = Status.WAITING
        rs.slot[r] = inst.id
        self._enqueue(inst, r)
        if not inst.busy:
            yield from self._schedule(inst, t)

    # ================================================================== prefill/decode disaggregation
    def _hand_off(self, inst: Instance, prefilled: list[int], t: float) -> _Gen:
        """Requests whose prefill just completed on PREFILL instance ``inst`` and that go on decoding leave its
        running set; their KV stays there until the transfer to a decode instance ends."""
        rs = self.rs
        for r in prefilled:
            if rs.status[r] != _RUNNING or rs.slot[r] != inst.id or self._skind[rs.stage[r]] != _DECODE:
                continue  # finished with its first token, or a tool call follows
            inst.running.remove(r)
            inst.running_changed()
            inst.n_parked += 1
            rs.status[r] = Status.TRANSFER
            rs.slot[r] = -1
            yield from self._send_kv(r, t)

    def _send_kv(self, r: int, t: float) -> _Gen:
        """Ask the router for ``r``'s decode instance and start the KV transfer (or wait for capacity)."""
        rs = self.rs
        d = int(self.policy.router.route_decode(r, self, t))
        if d == BEST_EFFORT and not rs.be[r]:  # demoted: the router places it as best effort
            rs.be[r] = True
            d = int(self.policy.router.route_decode(r, self, t))
        if d == DEFER:
            self._handoff_wait.append(r)
            return
        if not 0 <= d < len(self.instances):
            raise SchedulerError(f"route_decode sent request {r} to instance {d}; expected an instance index "
                                 f"0..{len(self.instances) - 1}, DEFER={DEFER} or (once) BEST_EFFORT={BEST_EFFORT}")
        dst = self.instances[d]
        if dst.state != InstanceState.ACTIVE or dst.role == Role.PREFILL:
            raise SchedulerError(f"route_decode sent request {r} to instance {d}, which is {dst.state.name} "
                                 f"with role {dst.role.name}; KV goes to accepting DECODE or COLOCATED instances")
        if self._max_ctx[r] > dst.total_blocks * dst.block_size:
            yield from self._drop(r, "exceeds_kv_capacity", t)
            return
        src = self.instances[int(rs.instance[r])]
        dst.n_incoming += 1
        self._xfer_dst[r] = d
        self.kv_transfers += 1
        self.log_event(t, "kv_transfer", r, src.id, d)
        self._push(t + self.transfer.seconds(int(rs.num_computed[r]), src.engine), _XFER_DONE, r)

    def _on_transfer_done(self, r: int, t: float) -> _Gen:
        """``r``'s KV arrived: ``r`` waits on the decode instance, its computed tokens counted as KV to allocate
        when a scheduler admits it (decode-side admission). Until then its blocks stay allocated on the prefill
        instance (:meth:`_unstage`), as in vLLM's disaggregated serving, where the decode side allocates blocks
        and then pulls into them: the KV is held by exactly one instance at every moment, so a decode side that
        cannot admit holds the prefill side's memory (back-pressure) instead of a store that belongs to nobody.
        Deviation: the transfer is timed before the admission, not after it."""
        rs = self.rs
        src = self.instances[int(rs.instance[r])]
        dst = self.instances[self._xfer_dst.pop(r)]
        self._staged[r] = (src.id, int(rs.kv_blocks[r]))
        rs.kv_blocks[r] = 0
        dst.n_incoming -= 1
        dst.n_staged += 1
        rs.instance[r] = dst.id
        rs.slot[r] = dst.id
        rs.status[r] = Status.WAITING
        self._enqueue(dst, r)
        if not dst.busy:
            yield from self._schedule(dst, t)

    def staged_blocks(self, i: int) -> int:
        """KV blocks instance ``i`` still holds for requests waiting on a decode instance (:meth:`_on_transfer_done`):
        with the blocks of the requests on ``i``, what ``i`` has allocated."""
        return sum(b for j, b in self._staged.values() if j == i)

    def _unstage(self, r: int, dst: Instance, t: float) -> None:
        """``r`` left ``dst``'s queue (admitted, or done): its KV's blocks on the prefill instance are freed. A
        prefill instance left idle with work is offered it again at ``t`` (a timer: callers are not generators);
        the work may be a running prompt half prefilled when its KV ran out, with nothing waiting."""
        i, blocks = self._staged.pop(r)
        src = self.instances[i]
        src.free_blocks += blocks
        src.n_parked -= 1
        dst.n_staged -= 1
        self.on_kv_freed(r, src)
        self._check_drained(src, t)
        if not src.busy and src.n_resident:
            self.add_timer(t, _no_op)

    # ================================================================== leaving an instance
    def _drop_kv(self, inst: Instance, r: int) -> None:
        """``r``'s KV blocks return to ``inst``; what it had computed is recomputed if it runs again."""
        rs = self.rs
        inst.free_blocks += int(rs.kv_blocks[r])
        rs.kv_blocks[r] = 0
        rs.num_computed[r] = 0

    def _release(self, r: int) -> None:
        """Free ``r``'s KV and take it off its instance's lists."""
        rs = self.rs
        i = int(rs.instance[r])
        if i < 0:
            return
        inst = self.instances[i]
        self._drop_kv(inst, r)
        rs.slot[r] = -1
        st = rs.status[r]
        if st == _RUNNING:
            inst.running.remove(r)
            inst.running_changed()
        elif st == _WAITING:
            self._dequeue(inst, r)
            if inst.n_staged and r in self._staged:
                self._unstage(r, inst, self.now)
        elif st == _EXTERNAL:
            inst.n_parked -= 1
        elif st == _TRANSFER:
            inst.n_parked -= 1
            d = self._xfer_dst.pop(r, None)
            if d is not None:
                self.instances[d].n_incoming -= 1
            elif r in self._handoff_wait:  # (else dropped while being routed: _send_kv)
                self._handoff_wait.remove(r)
        self.on_kv_freed(r, inst)

    def _preempt(self, inst: Instance, r: int, t: float) -> None:
        """Recompute ``r`` later: a running request drops its KV and goes to the front of the waiting queue; a
        waiting one that holds KV (back from a tool call) drops it and keeps its place."""
        rs = self.rs
        waiting_kv = rs.status[r] == _WAITING and rs.kv_blocks[r] > 0
        if rs.instance[r] != inst.id or not (rs.status[r] == _RUNNING or waiting_kv):
            raise SchedulerError(f"instance {inst.id}: cannot preempt request {r} "
                                 f"(status {Status(rs.status[r]).name}, instance {rs.instance[r]}, "
                                 f"{rs.kv_blocks[r]} KV blocks)")
        rs.recomputed[r] += rs.num_computed[r]
        rs.n_preempt[r] += 1
        if rs.n_preempt[r] > MAX_PREEMPTIONS:  # a hang turned into an error that names the culprit
            raise SchedulerError(f"instance {inst.id}: request {r} preempted {MAX_PREEMPTIONS} times "
                                 f"({type(self.policy.scheduler).__name__}): the scheduler livelocks, restarting "
                                 f"the same work forever (report it with the policy, workload and seed)")
        self.log_event(t, "preempt", r, inst.id, int(rs.num_computed[r]))
        if waiting_kv:
            self._drop_kv(inst, r)
            self._waits_with_kv[r] = False
            inst.n_waiting_kv -= 1
            self.on_kv_freed(r, inst)
            return
        self._release(r)
        rs.status[r] = _WAITING
        rs.slot[r] = inst.id
        self._enqueue(inst, r, front=True)  # the caller then moves KV holders ahead (_kv_holders_first)

    def _kv_holders_first(self, inst: Instance) -> None:
        """Waiting requests that still hold KV (back from a tool call) move, in order, ahead of the preempted
        ones: a victim may need exactly that KV, and FCFS schedulers stop at the first request that does not
        fit and preempt only running requests, so a victim in front of them would be preempted again each
        iteration forever (a livelock once nothing else frees KV, e.g. on a draining instance). O(1) when no
        waiting request holds KV (the common case: a long queue under KV pressure is not scanned)."""
        if not inst.n_waiting_kv:
            return
        held = self.rs.kv_blocks[inst.waiting] > 0
        if held.any() and not held[:held.sum()].all():
            inst.waiting[:] = [x for x, h in zip(inst.waiting, held) if h] + \
                              [x for x, h in zip(inst.waiting, held) if not h]

    def _drop(self, r: int, reason: str, t: float) -> _Gen:
        self.dropped_reasons[reason] = self.dropped_reasons.get(reason, 0) + 1
        yield from self._done(r, Outcome.DROPPED, t)

    def _done(self, r: int, outcome: int, t: float) -> _Gen:
        rs = self.rs
        if rs.status[r] == _QUEUED:
            self.global_queue.remove(r)
        self._release(r)
        rs.status[r] = _DONE
        rs.outcome[r] = outcome
        rs.finish[r] = t
        self._n_done += 1
        if self._lifecycle and rs.instance[r] >= 0:
            self._check_drained(self.instances[int(rs.instance[r])], t)
        if self.completed is not None:
            self.completed.append(r)
        if self._pbar is not None and self._n_done % 1024 == 0:
            self._pbar.update(1024)
        g = int(self.w.group[r])
        if g >= 0:
            self._group_progress(g, int(self.w.group_stage[r]), t)
        if outcome in (_FINISHED, _BEST_EFFORT):  # capacity freed: what waits for it may now be placed
            if self._handoff_wait:
                yield from self._retry_handoffs(t)
            if self.global_queue:
                yield from self._retry_queue(t)

    def _group_progress(self, g: int, s: int, t: float) -> None:
        """A request of group ``g``'s stage ``s`` is done; release the next stage once this one is empty."""
        self._groups[(g, s)] -= 1
        while self._groups.get((g, self._group_stage_open[g]), 0) == 0 and \
                (g, self._group_stage_open[g] + 1) in self._groups:
            self._group_stage_open[g] += 1
            for r in self._held.pop((g, self._group_stage_open[g]), []):
                self._seq += 1
                heapq.heappush(self._glob, (t, self._seq, _RELEASE, r))

    def _retry_queue(self, t: float) -> _Gen:
        """Offer the deferred requests again, in order, at ``t``. Each leaves the queue only as it is offered, and no
        fast-forward a placement starts runs past ``t`` while they are offered (``_ff_horizon``)."""
        queue = self.global_queue
        # the rest are offered at t too, so a placement's fast-forward must not run past t (the instance that
        # finished is in the middle of its iteration end, not in the heap, and _earliest_finish misses it)
        offer_t, self._offer_t = self._offer_t, t
        try:
            for r in queue[:]:
                queue.pop(0)  # r, at the front
                self.rs.status[r] = Status.PENDING
                yield from self._route(r, t)
                if self.rs.status[r] == Status.QUEUED and not self.agent_route:
                    # still deferred (appended behind the rest): back to the front, the rest not asked this round
                    queue.insert(0, queue.pop())
                    return
        finally:
            self._offer_t = offer_t

    # ================================================================== end of run
    def _finalize(self) -> None:
        """Requests the run could not finish get outcome ``dropped`` with a counted reason (never silent)."""
        self._unpark_all()
        rs = self.rs
        # the pilot runs instances ahead of one another, so the last one it ran may have stopped before a finish
        # another reached: the run ends at the latest time stepping would have reached
        done = rs.finish[~np.isnan(rs.finish)]
        if done.size:
            self.now = max(self.now, float(done.max()))
        reasons = {Status.WAITING: "never_scheduled", Status.RUNNING: "stalled", Status.QUEUED: "deferred_at_end",
                   Status.HELD: "group_never_released", Status.PENDING: "never_arrived",
                   Status.EXTERNAL: "external_at_end", Status.TRANSFER: "transfer_at_end"}
        for r in np.flatnonzero(rs.status != Status.DONE).tolist():
            reason = reasons[Status(int(rs.status[r]))]
            self.dropped_reasons[reason] = self.dropped_reasons.get(reason, 0) + 1
            self._release(r)
            rs.status[r] = Status.DONE
            rs.outcome[r] = Outcome.DROPPED
            rs.finish[r] = self.now
        self.global_queue.clear()
        # the pilot runs one instance up to the next event that can reach it, so its log entries may come before
        # another instance's earlier ones: the log is kept in time order (stable: same-time entries keep theirs)
        self.events.sort(key=lambda e: e[0])
        # the run ends with its last outcome: a scaler tick or a timer after it is not part of it (nor charged)
        fin = rs.finish[~np.isnan(rs.finish)]
        self.end_time = float(fin.max()) if fin.size else self.now

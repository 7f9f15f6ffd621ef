"""Cluster mechanisms: backend hooks, instance lifecycle and cold starts, cost accounting, prefill/decode
disaggregation with KV transfer, and scaling actions at random times (property tests)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ToyEngine
from helpers import FF_FIELDS, assert_runs_equal, expected_compute, toy_engines, workloads
from slogym.baselines import make_policy
from slogym.core.cluster import KVTransfer, cold_start_seconds, model_params_b
from slogym.core.errors import SchedulerError
from slogym.core.instance import InstanceState, Role
from slogym.core.policy import BEST_EFFORT, DEFER, Scaler, Scheduler, SingleOrRoundRobin
from slogym.core.request import INF, Request, StageKind, Workload, decode, external, prefill
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome, Status
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload


def _chat(n: int, gap: float = 0.01, p: int = 64, o: int = 40) -> Workload:
    return Workload.from_requests([Request(i * gap, [prefill(p, 1.0), decode(o, 0.1)]) for i in range(n)])


# ---------------------------------------------------------------------------------------------- backend hooks
class HookedSim(Simulator):
    """Overrides every backend hook: times iterations itself (a stand-in for a live engine) and logs KV events."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.placed: list[tuple[int, int]] = []
        self.freed: list[tuple[int, int]] = []
        self.timed = 0

    def iteration_time(self, inst, idx, tok, spec, features) -> float:
        self.timed += 1
        return inst.time_one(features)

    def on_kv_freed(self, r, inst) -> None:
        self.freed.append((r, inst.id))

    def on_request_placed(self, r, inst) -> None:
        self.placed.append((r, inst.id))


def test_backend_hooks_called_and_fast_forward_disabled_when_timing_is_overridden():
    eng = ToyEngine(kv_capacity_tokens=800)
    w = _chat(30, gap=0.002, p=48, o=120)
    hooked = HookedSim(w, eng, make_policy("vllm", eng), n_instances=2, seed=1)
    assert not hooked.fast_forward
    hooked.run()
    plain = Simulator(w, eng, make_policy("vllm", eng), n_instances=2, seed=1).run()
    assert plain.ff_iterations > 0 and hooked.ff_iterations == 0
    assert_runs_equal(hooked.result(), plain.result(), ignore=FF_FIELDS)
    assert hooked.timed == sum(i.iterations for i in hooked.instances)
    n_pre = int(hooked.rs.n_preempt.sum())
    assert n_pre > 0, "KV pressure never preempted: the freed/placed accounting would be vacuous"
    # every request placed once, plus once per preemption; KV freed once per preemption and once at the end
    assert len(hooked.placed) == len(w) + n_pre
    assert len(hooked.freed) == len(w) + n_pre
    assert sorted({r for r, _ in hooked.freed}) == list(range(len(w)))


def test_live_subclass_disables_fast_forward():
    class Live(Simulator):
        live = True

    eng = ToyEngine()
    assert not Live(_chat(2), eng, make_policy("vllm", eng)).fast_forward
    assert Simulator(_chat(2), eng, make_policy("vllm", eng)).fast_forward
    assert (Live(_chat(4), eng, make_policy("vllm", eng)).run().rs.outcome == Outcome.FINISHED).all()


# ---------------------------------------------------------------------------------------------- cold starts, transfer
def test_cold_start_table_values_and_scaling_rule():
    assert cold_start_seconds(7, "disk") == 4.14 and cold_start_seconds(32, "cpu_offload") == 19.41
    assert cold_start_seconds(70, "d2d") == 1.16
    assert cold_start_seconds(3.5, "disk") == pytest.approx(4.14 / 2)        # proportional below 7B
    assert cold_start_seconds(140, "cpu_offload") == pytest.approx(11.50 * 2)  # proportional above 70B
    assert 4.14 < cold_start_seconds(13, "disk") < 28.84                     # interpolated in between
    for m in ("disk", "cpu_offload"):  # d2d is the fastest way up at every size
        assert all(cold_start_seconds(s, "d2d") < cold_start_seconds(s, m) for s in (1, 7, 13, 32, 50, 70, 200))
    with pytest.raises(ValueError, match="nvme"):
        cold_start_seconds(7, "nvme")
    assert model_params_b(get_engine("llama3-70b-h100-tp4")) == 70.0
    assert model_params_b(get_engine("qwen2.5-7b-v100-tp2")) == 7.0


def test_kv_transfer_time_model():
    eng = get_engine("llama3-70b-h100-tp4")
    x = KVTransfer(bandwidth_gbps=100.0, latency_s=1e-4)
    # 80 layers x 8 KV heads x 128 dims x K,V x 2 bytes, split over 4 TP ranks
    assert x.bytes_for(eng) == 2 * 80 * 8 * 128 * 2 / 4
    assert x.seconds(1000, eng) == pytest.approx(1e-4 + 1000 * 81920 / 12.5e9)
    assert KVTransfer(bytes_per_token=10.0, bandwidth_gbps=8.0, latency_s=0.0).seconds(100, None) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="toy"):
        KVTransfer().bytes_for(ToyEngine())
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        KVTransfer(bandwidth_gbps=0.0)


# ---------------------------------------------------------------------------------------------- property tests
XFER = KVTransfer(bytes_per_token=65536.0, bandwidth_gbps=100.0, latency_s=1e-3)
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_DECISIONS = 5_000  # ~10x above what these small workloads need: a livelock fails instead of hanging
_LIVE = (Status.WAITING, Status.RUNNING, Status.EXTERNAL, Status.TRANSFER)


def check_cluster(sim: Simulator) -> None:
    """KV, list and counter invariants of every instance, and each live request in exactly one place."""
    rs = sim.rs
    seen: set[int] = set()
    for inst in sim.instances:
        assert 0 <= inst.free_blocks <= inst.total_blocks
        held = int(rs.kv_blocks[rs.instance == inst.id].sum()) + sim.staged_blocks(inst.id)
        assert held == inst.total_blocks - inst.free_blocks, (inst, held)
        # computed tokens without blocks here: KV that arrived by transfer, still held by its prefill instance
        for r in inst.waiting:
            assert rs.kv_blocks[r] > 0 or rs.num_computed[r] == 0 or r in sim._staged, f"request {r}: KV held nowhere"
        lists = inst.waiting + inst.running
        assert not seen & set(lists) and len(set(lists)) == len(lists), f"request listed twice: {lists}"
        seen |= set(lists)
        assert all(rs.status[r] == Status.WAITING for r in inst.waiting)
        assert all(rs.status[r] == Status.RUNNING for r in inst.running)
        assert all(rs.instance[r] == inst.id for r in lists)
        assert inst.n_waiting_kv == sum(int(rs.kv_blocks[r] > 0) for r in inst.waiting)
        parked = (rs.instance == inst.id) & np.isin(rs.status, (Status.EXTERNAL, Status.TRANSFER))
        assert int(parked.sum()) + sum(j == inst.id for j, _ in sim._staged.values()) == inst.n_parked
        assert inst.n_incoming == sum(d == inst.id for d in sim._xfer_dst.values())
        if inst.state in (InstanceState.STARTING, InstanceState.STOPPED):
            assert inst.empty and inst.free_blocks == inst.total_blocks and inst.inflight is None
    moving = set(np.flatnonzero(rs.status == Status.TRANSFER).tolist())
    assert moving == set(sim._xfer_dst) | set(sim._handoff_wait)
    assert not set(sim._xfer_dst) & set(sim._handoff_wait)


class CheckedScheduler(Scheduler):
    """Checks the cluster before every decision, and that only ready, non-stopped instances are scheduled."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.steady_through_finish = inner.steady_through_finish

    def reset(self, sim) -> None:
        self.sim = sim
        self.calls = 0
        self.inner.reset(sim)

    def next_batch(self, inst, now):
        self.calls += 1
        assert self.calls <= MAX_DECISIONS, f"{self.calls} scheduling decisions: livelock? (now={now})"
        # (a fast-forward stretch that ends with the last request asks once more; a stopped instance is empty)
        assert inst.state != InstanceState.STARTING and (inst.state != InstanceState.STOPPED or inst.empty), inst
        assert now >= inst.ready_at, f"instance {inst.id} scheduled at {now} before ready_at {inst.ready_at}"
        check_cluster(self.sim)
        return self.inner.next_batch(inst, now)


class RandomScaler(Scaler):
    """Adds (with a random cold start), drains and switches roles of instances at random times, keeping at
    least one accepting entry instance (and one decode instance when ``pd``); snapshots what each draining
    instance holds so that placements there can be checked."""

    interval = 0.03

    def __init__(self, pd: bool) -> None:
        self.pd = pd

    def reset(self, sim) -> None:
        self.rng = np.random.default_rng(sim.seed)
        self.resident: dict[int, set[int]] = {}

    def _snapshot(self, sim, i: int) -> None:
        rs = sim.rs
        live = np.flatnonzero((rs.instance == i) & np.isin(rs.status, _LIVE)).tolist()
        self.resident.setdefault(i, set()).update(live, (r for r, d in sim._xfer_dst.items() if d == i))

    def decide(self, sim, now) -> None:
        roles = [Role.PREFILL, Role.DECODE] if self.pd else [Role.COLOCATED]
        u = self.rng.random()
        alive = [x.id for x in sim.instances if x.state != InstanceState.STOPPED]
        if u < 0.3 and len(alive) < 6:
            sim.add_instance(role=roles[int(self.rng.integers(len(roles)))],
                             cold_start=float(self.rng.choice([0.0, 0.01, 0.2])))
        elif u < 0.6:
            i = int(self.rng.choice(alive))
            spare = [sim.accepting_instances(r) for r in roles]
            if all(len(s) > 1 or i not in s for s in spare):
                self._snapshot(sim, i)
                if u < 0.45:
                    sim.drain_instance(i)
                else:
                    to = roles[int(self.rng.integers(len(roles)))]
                    sim.switch_role(i, to)


class TracingSim(HookedSim):
    """Checks every placement: never on a starting or stopped instance, and on a draining one only for requests
    it already held when it started draining."""

    def on_request_placed(self, r, inst) -> None:
        super().on_request_placed(r, inst)
        assert inst.state in (InstanceState.ACTIVE, InstanceState.DRAINING), (r, inst)
        if inst.state == InstanceState.DRAINING:
            held = self.policy.scaler.resident.get(inst.id, set()) if self.policy.scaler else set()
            assert r in held, f"draining instance {inst.id} accepted request {r}"


def run_cluster(w, engine, policy: str, pd: tuple[int, int] | None, n: int, scale: bool, ff: bool = True,
                cls: type = Simulator) -> Simulator:
    pol = make_policy(policy, engine, router=SingleOrRoundRobin())
    pol.scheduler = CheckedScheduler(pol.scheduler)
    if scale:
        pol.scaler = RandomScaler(pd is not None)
    sim = cls(w, engine, pol, None if pd else n, pd=pd, transfer=XFER, seed=5, fast_forward=ff)
    return sim.run()


def check_done(sim: Simulator) -> None:
    """Every request exactly one outcome, tokens conserved, nothing left anywhere, cost = instance timelines."""
    w, rs = sim.w, sim.rs
    assert (rs.outcome != Outcome.NONE).all() and (rs.status == Status.DONE).all()
    res = sim.result()
    assert sum(res.summary["outcomes"].values()) == len(w)
    assert sum(sim.dropped_reasons.values()) == int((rs.outcome == Outcome.DROPPED).sum())
    served = (rs.outcome == Outcome.FINISHED) | (rs.outcome == Outcome.BEST_EFFORT)
    assert (rs.computed_total[served] == expected_compute(w)[served] + rs.recomputed[served]).all()
    check_cluster(sim)
    for inst in sim.instances:
        assert inst.empty and inst.free_blocks == inst.total_blocks
    # KV moved at most once per prefill segment ending on a prefill instance, never to a non-decode role
    xfers = [e for e in sim.events if e[1] == "kv_transfer"]
    assert len(xfers) == sim.kv_transfers == res.summary["kv_transfers"]
    # cost: each instance from its start event (or t=0) to its stop event (or the end: the last outcome, which also
    # caps a stop after it), from the event log
    start = {i: 0.0 for i in range(len(sim.roles))}
    stop: dict[int, float] = {}
    for t, kind, _, i, _ in sim.events:
        if kind == "instance_start":
            start[i] = float(t)
        elif kind == "instance_stop":
            stop[i] = float(t)
    end = sim.end_time
    assert end == float(np.nanmax(sim.rs.finish))
    cost = sum(max(min(stop.get(i, end), end) - t0, 0.0) for i, t0 in start.items())
    assert res.summary["cost_instance_seconds"] == pytest.approx(cost, rel=1e-12, abs=1e-12)
    n_served = int(served.sum())
    if n_served:
        assert res.summary["cost_per_request"] == pytest.approx(cost / n_served)


@settings(max_examples=40, **SETTINGS)
@given(w=workloads(max_requests=10, groups=False), engine=toy_engines(), policy=st.sampled_from(["vllm", "sarathi"]),
       pd=st.sampled_from([(1, 1), (2, 1), (1, 2)]))
def test_pd_every_request_one_outcome_and_fast_forward_exact(w, engine, policy, pd):
    a = run_cluster(w, engine, policy, pd, 0, scale=False)
    check_done(a)
    assert a.kv_transfers <= int((a.w.stage_kind == StageKind.PREFILL).sum())
    b = run_cluster(w, engine, policy, pd, 0, scale=False, ff=False)
    assert_runs_equal(a.result(), b.result(), ignore=FF_FIELDS)


@settings(max_examples=40, **SETTINGS)
@given(w=workloads(max_requests=12, groups=True), engine=toy_engines(), policy=st.sampled_from(["vllm", "sarathi"]),
       pd=st.sampled_from([None, (1, 1), (2, 1)]))
def test_scaling_at_random_times_keeps_invariants(w, engine, policy, pd):
    a = run_cluster(w, engine, policy, pd, 2, scale=True, cls=TracingSim)
    check_done(a)
    b = run_cluster(w, engine, policy, pd, 2, scale=True, ff=False)
    assert_runs_equal(a.result(), b.result(), ignore=FF_FIELDS)
    c = run_cluster(w, engine, policy, pd, 2, scale=True)
    assert a.result().records.equals(c.result().records)  # determinism: same seed, same records


def test_preempted_request_does_not_starve_behind_waiting_kv_holders():
    """Regression (the example that made the random-scaling property test hang): on a draining decode
    instance, request 3 (preempted, no KV) led the waiting queue ahead of request 4, back from a tool call with
    43 of 64 KV blocks; Sarathi gave 3 a chunk that filled the rest, then had to preempt it, forever. KV-holding
    waiting requests now go ahead of preempted ones, so the run ends with every request served."""
    stages = [[prefill(41), decode(1)], [prefill(48), decode(114, 0.006)], [prefill(84, 2.0), decode(16, 0.02)],
              [prefill(122, 0.2), decode(33, 0.2), external(0.003), prefill(7, 0.02), decode(44, 0.2),
               external(0.003), prefill(17), decode(30, 0.02)],
              [prefill(92), decode(12, 0.02), external(0.003), prefill(39, 0.2), decode(30, 0.006), external(0.003),
               prefill(3), decode(47)]]
    meta = [("a", INF, 0, False), ("a", 5.0, 2, False), ("b", 0.5, 2, False), ("a", 5.0, 0, True),
            ("b", INF, 1, True)]
    w = Workload.from_requests([Request(0.0, s, app=a, ttlt=t, priority=p, best_effort=be)
                                for s, (a, t, p, be) in zip(stages, meta)])
    eng = ToyEngine(a=0.005, b=0.0001, c=1e-06, kv_capacity_tokens=256, block_size=4, max_num_seqs=2,
                    max_num_batched_tokens=256)
    sim = run_cluster(w, eng, "sarathi", (1, 1), 2, scale=True, cls=TracingSim)
    check_done(sim)
    assert int(sim.rs.n_preempt.sum()) > 0, "no preemption: the starvation path was not exercised"


@pytest.mark.parametrize("policy", ["polyserve-pd-minimal", "polyserve-pd-random", "polyserve-pd"])
def test_prefill_instance_resumes_a_half_prefilled_prompt_when_a_hand_off_frees_its_kv(policy: str) -> None:
    """Regression: a PD prefill instance whose KV was full (its hand-offs staged there until the decode side
    admits them) stopped with a half-prefilled prompt running and nothing waiting; the hand-offs' release only
    woke instances with a queue, so the prompt was dropped as ``stalled`` at the end of the run."""
    engine = dataclasses.replace(get_engine("llama3-8b-h100"), kv_capacity_tokens=12000)
    w = make_workload("toolllm", rate=1.92, n_requests=80, seed=1, engine=engine)
    sim = Simulator(w, engine, make_policy(policy, engine), 4, seed=1).run()
    assert "stalled" not in sim.dropped_reasons, sim.dropped_reasons
    check_done(sim)


class OneAtATimeDecode(SingleOrRoundRobin):
    """Admits a hand-off only onto an empty decode instance (a stand-in for a router whose decode admission
    refuses while the instance is full, as PolyServe's may): the rest wait for a finish."""

    def route_decode(self, req, sim, now):
        free = [i for i in sim.accepting_instances(Role.DECODE)
                if not (sim.instances[i].n_resident or sim.instances[i].n_incoming)]
        return free[0] if free else DEFER


@pytest.mark.parametrize("ff", [True, False])
def test_deferred_hand_offs_are_retried_when_a_request_finishes(ff):
    """On a fixed fleet no instance ever becomes ready: a hand-off the router defers must be offered again when
    a request finishes (capacity freed), else it would wait until the run ends (``transfer_at_end``)."""
    eng = ToyEngine()
    pol = make_policy("vllm", eng, router=OneAtATimeDecode())
    sim = Simulator(_chat(8, gap=0.001, o=30), eng, pol, pd=(1, 1), transfer=XFER, seed=0, fast_forward=ff).run()
    check_done(sim)
    assert sim.dropped_reasons == {} and sim.kv_transfers == 8
    dec = [e for e in sim.events if e[1] == "kv_transfer"]
    fin = np.sort(sim.rs.finish)
    assert all(t >= f for (t, *_), f in zip(dec[1:], fin[:-1]))  # each transfer after the previous finish


class DemotingDecode(SingleOrRoundRobin):
    """Demotes every odd request at its hand-off (``always``: asks to demote a demoted one again too)."""

    def __init__(self, always: bool = False) -> None:
        super().__init__()
        self.always = always

    def route_decode(self, req, sim, now):
        if req % 2 and (self.always or not sim.rs.be[req]):
            return BEST_EFFORT
        return super().route_decode(req, sim, now)


def test_a_hand_off_demoted_to_best_effort_is_placed_as_one():
    """``route_decode`` may return BEST_EFFORT: the request becomes best effort and the router is asked again for
    its decode instance; asking to demote it a second time is an error, not a loop."""
    eng = ToyEngine()
    sim = Simulator(_chat(6, gap=0.001, o=10), eng, make_policy("vllm", eng, router=DemotingDecode()), pd=(1, 1),
                    transfer=XFER, seed=0).run()
    check_done(sim)
    assert sim.kv_transfers == 6
    assert sim.rs.be.tolist() == [False, True] * 3
    assert (sim.rs.outcome[1::2] == Outcome.BEST_EFFORT).all() and (sim.rs.outcome[::2] == Outcome.FINISHED).all()
    with pytest.raises(SchedulerError, match="route_decode sent request 1 to instance -3"):
        Simulator(_chat(6, gap=0.001, o=10), eng, make_policy("vllm", eng, router=DemotingDecode(always=True)),
                  pd=(1, 1), transfer=XFER, seed=0).run()


# ---------------------------------------------------------------------------------------------- P/D hand-off memory
def test_transferred_kv_stays_on_the_prefill_instance_until_the_decode_side_admits_it():
    """Decode memory pressure: arrived KV waits in the decode queue while its blocks stay on the prefill instance
    (never in a store that belongs to no instance), which throttles the prefill side; everything still finishes."""
    eng = ToyEngine(kv_capacity_tokens=8192)
    w = Workload.from_requests([Request(0.001 * i, [prefill(1000, 100.0), decode(3000, 10.0)]) for i in range(60)])
    pol = make_policy("distserve", eng)
    inner, staged_peak = pol.scheduler.next_batch, [0]

    def checked(inst, now):
        check_cluster(inst.sim)
        staged_peak[0] = max(staged_peak[0], sum(b for _, b in inst.sim._staged.values()))
        return inner(inst, now)

    pol.scheduler.next_batch = checked
    sim = Simulator(w, eng, pol, pd=(1, 1), transfer=KVTransfer(bytes_per_token=1000.0)).run()
    assert staged_peak[0] > 0  # the decode side could not admit at once: the path ran
    assert staged_peak[0] <= sim.instances[0].total_blocks
    assert (sim.rs.outcome == Outcome.FINISHED).all() and not sim._staged
    assert all(i.free_blocks == i.total_blocks and i.n_parked == 0 and i.n_staged == 0 for i in sim.instances)


def test_a_decode_instance_too_small_for_the_context_drops_the_request():
    big, small = ToyEngine(kv_capacity_tokens=4096), ToyEngine(kv_capacity_tokens=256)
    w = Workload.from_requests([Request(0.0, [prefill(200, 1.0), decode(100, 0.1)]),
                                Request(0.0, [prefill(20, 1.0), decode(10, 0.1)])])
    sim = Simulator(w, [big, small], make_policy("vllm", big), pd=(1, 1),
                    transfer=KVTransfer(bytes_per_token=1000.0)).run()
    assert sim.dropped_reasons == {"exceeds_kv_capacity": 1}
    assert sim.rs.outcome.tolist() == [Outcome.DROPPED, Outcome.FINISHED]
    assert all(i.free_blocks == i.total_blocks and i.n_parked == 0 for i in sim.instances)


def test_routing_to_a_draining_instance_raises():
    class ToDrained(SingleOrRoundRobin):
        def route(self, r, sim, now):
            return 0

    eng = ToyEngine()
    sim = Simulator(_chat(6, gap=0.5), eng, make_policy("vllm", eng, router=ToDrained()), n_instances=2)
    sim.add_timer(0.25, lambda s, t: s.drain_instance(0))
    with pytest.raises(SchedulerError, match="DRAINING|draining|accept"):
        sim.run()


def test_a_scaler_keeps_ticking_through_a_tool_call():
    """Nothing runs while the only request waits for its tool, but the tool's return is still to come: the scaler
    is asked every interval until the request finishes, and no more after."""
    class Count(Scaler):
        interval = 1.0

        def reset(self, sim):
            self.ticks = []

        def decide(self, sim, now):
            self.ticks.append(now)

    eng = ToyEngine()
    w = Workload.from_requests([Request(0.0, [prefill(50), decode(10), external(10.0), prefill(20), decode(10)])])
    pol = make_policy("vllm", eng)
    pol.scaler = Count()
    sim = Simulator(w, eng, pol).run()
    end = float(sim.rs.finish[0])
    assert end > 10.0 and sim.end_time == end
    assert pol.scaler.ticks == [float(k) for k in range(1, int(end) + 2)]  # the last one was armed before the end

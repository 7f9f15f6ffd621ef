"""The compiled pilot (slogym.core.pilot) gives bit-identical runs to stepping every iteration in Python: on
scenario presets under KV pressure and without, with one and several instances, on random workloads (tool calls,
collective groups, tiny KV, every block size), and through the arrival environments."""

from __future__ import annotations

from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slogym  # noqa: F401  (registers the envs)
from helpers import FF_FIELDS, assert_runs_equal, workloads
from slogym.baselines import make_policy
from slogym.core import simulator as simulator_module
from slogym.baselines.routers import outstanding_tokens
from slogym.core.policy import DEFER, Router, SingleOrRoundRobin
from slogym.core.request import Request, Workload, decode, external, prefill
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import SCENARIOS, make_workload

H100 = get_engine("llama3-8b-h100")
TP2 = get_engine("llama2-70b-a100-tp2")  # 1,153 KV blocks: preemption and unsticking are frequent
PILOT_FIELDS = FF_FIELDS  # the iteration counters of either shortcut differ; nothing else may


def _run(w, engine, policy, n_instances, ff, pilot, router=None, **params):
    pol = make_policy(policy, engine, router=router, **params)
    return Simulator(w, engine, pol, n_instances=n_instances, seed=3, fast_forward=ff, pilot=pilot).run()


def _assert_same(a: Simulator, b: Simulator) -> None:
    assert_runs_equal(a.result(), b.result(), ignore=PILOT_FIELDS)
    for name in ("F", "I", "recomputed", "n_preempt", "first_scheduled"):
        assert np.array_equal(getattr(a.rs, name), getattr(b.rs, name), equal_nan=True), name
    assert [(x.iterations, x.tokens, x.busy_time, x.free_blocks) for x in a.instances] == \
        [(x.iterations, x.tokens, x.busy_time, x.free_blocks) for x in b.instances]
    assert a.events == b.events


@pytest.mark.parametrize("engine", [H100, TP2], ids=["h100", "70b-tp2"])
@pytest.mark.parametrize("scenario,rate,n_inst", [("chatbot", 1.0, 1), ("mixed", 1.5, 2), ("toolllm", 0.3, 1),
                                                  ("tempo-mix", 1.0, 2)])
@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_pilot_equals_stepping_on_presets(engine, scenario, rate, n_inst, policy):
    n = 60 if scenario == "tempo-mix" else 300
    w = make_workload(scenario, rate=SCENARIOS[scenario].default_rate * rate * n_inst, n_requests=n, seed=1)
    step = _run(w, engine, policy, n_inst, ff=False, pilot=False)
    piloted = _run(w, engine, policy, n_inst, ff=True, pilot=True)
    assert piloted.pilot_iterations > 0, "the pilot never engaged: the comparison would be vacuous"
    if n_inst == 1 and scenario != "tempo-mix":  # round-robin over one instance: the pilot places arrivals too
        assert piloted.pilot_arrivals > 0
    _assert_same(step, piloted)
    _assert_same(step, _run(w, engine, policy, n_inst, ff=True, pilot=False))


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_pilot_forms_the_batch_of_a_free_instance(policy):
    """The batch of an instance that is free (a request placed on an idle instance) comes from the pilot's rule
    too: on a light load, where instances idle between requests, the scheduler's Python ``next_batch`` is never
    asked, and the run equals stepping."""
    w = make_workload("chatbot", rate=SCENARIOS["chatbot"].default_rate * 0.3, n_requests=200, seed=2)
    pol = make_policy(policy, H100)
    asked = []
    next_batch = pol.scheduler.next_batch
    pol.scheduler.next_batch = lambda inst, t: asked.append(t) or next_batch(inst, t)  # the class keeps its rule
    piloted = Simulator(w, H100, pol, n_instances=2, seed=3).run()
    assert asked == []
    assert sum(x.iterations for x in piloted.instances) == piloted.pilot_iterations
    _assert_same(_run(w, H100, policy, 2, ff=False, pilot=False), piloted)


@pytest.mark.parametrize("policy,n_inst", [("sarathi", 1), ("vllm", 2)])
def test_pilot_equals_stepping_with_a_queue_longer_than_its_head(policy, n_inst):
    """A burst queues hundreds of requests: the pilot sees 64, hands back when it needs more, and appends the
    arrivals it places behind the ones it was not given."""
    w = make_workload("chatbot", rate=SCENARIOS["chatbot"].default_rate * 30, n_requests=500, seed=2)
    step = _run(w, TP2, policy, n_inst, ff=False, pilot=False)
    piloted = _run(w, TP2, policy, n_inst, ff=True, pilot=True)
    assert max(len(x.waiting) for x in step.instances) == 0  # (all served in the end)
    assert int((step.rs.first_scheduled - w.arrival).max()) > 10  # a long queue formed
    _assert_same(step, piloted)


def test_pilot_equals_stepping_when_preemptions_overflow_its_log():
    """Four requests thrashing one-token KV blocks preempt more times in one stretch than the log holds."""
    
    engine = replace(TP2, kv_capacity_tokens=24, block_size=1, max_num_seqs=4)
    w = Workload.from_requests([Request(0.001 * i, [prefill(4 + i), decode(12)]) for i in range(4)])
    step = _run(w, engine, "vllm", 1, ff=False, pilot=False)
    assert int(step.rs.n_preempt.sum()) > len(w)
    _assert_same(step, _run(w, engine, "vllm", 1, ff=True, pilot=True))


def test_pilot_opts_out_where_it_cannot_stand_in():
    """A router subclass that decides itself, a simulator subclass that overrides a method the pilot replaces,
    and a driver that times iterations itself (defer_timing) are all served by the Python path."""
    class Picky(SingleOrRoundRobin):
        def route(self, req, sim, now):
            return DEFER if req % 2 else super().route(req, sim, now)

    class Logged(Simulator):
        def log_event(self, t, kind, req, inst, detail=0):
            super().log_event(t, kind, req, inst, detail)

    w = make_workload("chatbot", rate=SCENARIOS["chatbot"].default_rate, n_requests=50, seed=0)
    sim = Simulator(w, TP2, make_policy("vllm", TP2, router=Picky()), seed=0)
    assert sim.policy.router.pilot_target(sim) == -1
    logged = Logged(w, TP2, make_policy("vllm", TP2), seed=0).run()
    assert logged.pilot_iterations == 0 and not Logged(w, TP2, make_policy("vllm", TP2)).pilot
    deferred = Simulator(w, TP2, make_policy("vllm", TP2), seed=0)
    deferred.defer_timing = True
    gen = deferred.decisions()
    msg = next(gen)
    while True:
        try:
            msg = gen.send(deferred.instances[msg[1].id].time_one(msg[2]))
        except StopIteration:
            break
    assert deferred.pilot_iterations == 0
    _assert_same(logged, deferred)


class Capped(SingleOrRoundRobin):
    """Round-robin that defers a request to the global queue while its instance holds ``cap`` requests: the
    queue is offered again at every finish, so the pilot must stop wherever another instance may finish."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def route(self, req, sim, now):
        i = super().route(req, sim, now)
        return DEFER if sim.instances[i].n_resident >= self.cap else i


@pytest.mark.parametrize("park", [False, True], ids=["heap", "parked"])
@pytest.mark.parametrize("engine", [H100, TP2], ids=["h100", "70b-tp2"])
@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_pilot_equals_stepping_while_the_global_queue_waits_for_a_finish(engine, policy, park, monkeypatch):
    """Deferred requests wait for a finish anywhere; the pilot runs an instance past other instances' iteration
    ends up to the earliest time they could finish (``Simulator._earliest_finish``) and ends a finishing iteration
    only once every other instance has caught up. Bit-identical to stepping: with the instances on the heap, one
    pilot call each (the floor is used), and parked, all in one compiled call (``Simulator._drain``)."""
    w = make_workload("chatbot", rate=SCENARIOS["chatbot"].default_rate * 4, n_requests=300, seed=2)
    step = _run(w, engine, policy, 3, ff=False, pilot=False, router=Capped(12))
    extended, drains = [], []
    earliest, drain = Simulator._earliest_finish, Simulator._drain

    def spy(self):
        h = earliest(self)
        extended.append(h > self._next_end())
        return h

    def count(self, *a):
        drains.append(self._pk_id)
        return drain(self, *a)

    monkeypatch.setattr(Simulator, "_earliest_finish", spy)
    monkeypatch.setattr(Simulator, "_drain", count)
    if not park:
        monkeypatch.setattr(simulator_module, "_PARK_CAP", 0)
    piloted = _run(w, engine, policy, 3, ff=True, pilot=True, router=Capped(12))
    assert piloted.pilot_iterations > 0
    if park:
        assert len(set(drains)) == 3, "not every instance ran parked"
    else:
        assert not drains and any(extended), "the floor never reached past an iteration end"
    _assert_same(step, piloted)


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_pilot_equals_stepping_when_instances_end_iterations_at_the_same_time(policy):
    """Regression: two identical instances run identical batches, so every iteration end ties. A piloted instance
    launches its iterations ahead of the other; ties must still go in the heap's order (the lower instance id
    first), as stepping takes them, or the deferred requests land on other instances."""
    reqs = [Request(0.0, [prefill(100), decode(30)]) for _ in range(2)]
    reqs += [Request(0.0, [prefill(50 + 10 * k), decode(5 + 7 * k)]) for k in range(6)]
    w = Workload.from_requests(reqs)
    step = _run(w, H100, policy, 2, ff=False, pilot=False, router=Capped(1))
    piloted = _run(w, H100, policy, 2, ff=True, pilot=True, router=Capped(1))
    assert piloted.pilot_iterations > 0
    _assert_same(step, piloted)
    _assert_same(step, _run(w, H100, policy, 2, ff=True, pilot=False, router=Capped(1)))


def _tied_mixed_workload(seed: int):
    """Arrivals in tied bursts, request shapes drawn from chat, one-token, prompt-only, reasoning (two decode
    stages), long and tool-call requests (a 0-50 ms call between two turns), sometimes a collective group; with
    the cluster drawn too: (workload, engine, instances, Capped cap, policy)."""
    rng = np.random.default_rng(seed)

    def stages():
        k = rng.choice(["chat", "chat", "one", "ponly", "reason", "tool", "long"])
        p = int(rng.integers(1, 400))
        if k == "chat":
            return [prefill(p), decode(int(rng.integers(1, 60)))]
        if k == "one":
            return [prefill(p), decode(1)]
        if k == "ponly":
            return [prefill(p)]
        if k == "reason":
            return [prefill(p), decode(int(rng.integers(1, 30))), decode(int(rng.integers(1, 10)))]
        if k == "long":
            return [prefill(int(rng.integers(500, 3000))), decode(int(rng.integers(50, 300)))]
        return [prefill(p), decode(int(rng.integers(1, 10))), external(float(rng.choice([0.0, 0.003, 0.05]))),
                prefill(int(rng.integers(1, 50))), decode(int(rng.integers(1, 20)))]

    n = int(rng.integers(10, 80))
    t = np.cumsum(rng.choice([0.0, 0.0, 0.01, 0.1], n))
    reqs = [Request(float(t[i]), stages()) for i in range(n)]
    if rng.random() < 0.3:
        ta = float(t[int(rng.integers(n))])
        for s in range(int(rng.integers(2, 4))):
            for _ in range(int(rng.integers(1, 3))):
                reqs.append(Request(ta, [prefill(int(rng.integers(1, 60))), decode(int(rng.integers(1, 20)))],
                                    group=0, group_stage=s))
    base = H100 if rng.random() < 0.5 else TP2
    kv = int(rng.choice([base.kv_capacity_tokens, 4096, 1024]))
    engine = replace(base, kv_capacity_tokens=max(kv, 3400), block_size=int(rng.choice([1, 16])))
    return (Workload.from_requests(reqs), engine, int(rng.integers(2, 5)), int(rng.integers(1, 5)),
            str(rng.choice(["sarathi", "vllm"])))


@pytest.mark.parametrize("seed", [68, 166, 217, 3, 11])
def test_a_placement_while_the_queue_is_offered_again_stops_at_the_next_finish(seed):
    """Regression (seeds 68, 166, 217): offering the global queue again placed a request on an idle instance,
    whose fast-forward then saw an empty queue -- the requests not yet offered had left it -- and ran past the
    next finish elsewhere, which offers them to that instance. They now leave the queue one by one."""
    w, engine, n_inst, cap, policy = _tied_mixed_workload(seed)
    step = _run(w, engine, policy, n_inst, ff=False, pilot=False, router=Capped(cap))
    _assert_same(step, _run(w, engine, policy, n_inst, ff=True, pilot=False, router=Capped(cap)))
    _assert_same(step, _run(w, engine, policy, n_inst, ff=True, pilot=True, router=Capped(cap)))


class _DeferUntilAFinish(Router):
    """Requests 0-1 to instance 0; the rest wait in the global queue until a finish offers them: request 2 to the
    idle instance 1, the next ones to the instance with the fewest outstanding tokens then (a router that reads
    the instances at the time of the offer)."""

    def route(self, r: int, sim: Simulator, now: float) -> int:
        if r < 2:
            return 0
        if sim._n_done == 0:
            return DEFER
        return 1 if r == 2 else int(np.argmin(outstanding_tokens(sim)))


@pytest.mark.parametrize("engine", [H100, get_engine("qwen2.5-7b-v100-tp2")], ids=["compiled", "no-compiled-time"])
def test_no_fast_forward_past_the_time_the_global_queue_is_offered_at(engine):
    """While a finish offers the global queue, a request placed on an idle instance does not fast-forward it past
    that time: the rest of the queue is offered at the same time, and a router reading the instances must see
    them there (fast-forward and pilot equal stepping; the reviewer's reproducer, found on the Python path)."""
    w = Workload.from_requests([Request(0.0, [prefill(1000), decode(3000)]), Request(1e-4, [prefill(10), decode(3)]),
                                Request(2e-4, [prefill(3000), decode(5)]), Request(3e-4, [prefill(10), decode(5)])])
    runs = [_run(w, engine, "sarathi", 2, ff=ff, pilot=pilot, router=_DeferUntilAFinish())
            for ff, pilot in ((False, False), (True, False), (True, True))]
    assert runs[0].rs.instance[3] == 1  # instance 1 had only request 2's 3,000-token prompt left to compute
    assert runs[1].ff_iterations > 0 or runs[2].pilot_iterations > 0
    for run in runs[1:]:
        _assert_same(runs[0], run)


def test_fast_forward_does_not_run_through_a_finish_that_frees_kv_for_a_prefill():
    """Regression: a steady decode batch that leaves out a running request still prefilling (no KV for its chunk)
    must not fast-forward through a finish, because the freed KV gives that request its chunk next iteration."""
    w = make_workload("toolllm", rate=SCENARIOS["toolllm"].default_rate * 0.3, n_requests=400, seed=1)
    step = _run(w, TP2, "sarathi", 1, ff=False, pilot=False)
    ff = _run(w, TP2, "sarathi", 1, ff=True, pilot=False)
    assert ff.ff_iterations > 0
    _assert_same(step, ff)


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=80, **SETTINGS)
@given(w=workloads(max_requests=10, groups=True), kv=st.sampled_from([64, 256, 1024, 20000]),
       block=st.sampled_from([1, 4, 16]), seqs=st.sampled_from([2, 8, 64]), budget=st.sampled_from([32, 256, 2048]),
       policy=st.sampled_from(["sarathi", "vllm"]), router=st.sampled_from(["round-robin", "least-load"]),
       n_inst=st.integers(1, 3))
def test_pilot_equals_stepping_on_random_workloads(w, kv, block, seqs, budget, policy, router, n_inst):
    engine = replace(TP2, kv_capacity_tokens=kv, block_size=block, max_num_seqs=seqs, max_num_batched_tokens=budget)
    params = {"token_budget": budget} if policy == "sarathi" else {}
    step = _run(w, engine, policy, n_inst, False, False, router, **params)
    _assert_same(step, _run(w, engine, policy, n_inst, True, True, router, **params))


@pytest.mark.parametrize("env_id,kw,action_seed,steps", [
    ("slogym/Admission-v0", {}, 1, 500), ("slogym/Routing-v0", {"n_instances": 3, "policy": "round-robin"}, 1, 500),
    ("slogym/Routing-v0", {"n_instances": 8, "policy": "sarathi", "scenario": "coder", "episode": 315, "seed": 86,
                           "pool_requests": 1500}, 87, 350)])
def test_arrival_env_rollouts_equal_with_and_without_pilot(env_id, kw, action_seed, steps, monkeypatch):
    """Random actions (Routing-v0's include deferral to the global queue, which wakes at every finish). On
    Routing-v0's replicas the pilot parks them (the observation then reads the parked tables). Infos too: the
    third case ends an episode right after the pilot ran an instance that stopped before another's last finish
    (the end time must still be that finish, as stepping's)."""
    drains = []
    drain = Simulator._drain

    def count(self, *a):
        drains.append(self._pk_id)
        return drain(self, *a)

    monkeypatch.setattr(Simulator, "_drain", count)

    def rollout() -> list:
        env = gym.make(env_id, **({"scenario": "chatbot", "episode": 200, "seed": 0} | kw)).unwrapped
        env.action_space.seed(action_seed)
        obs, _ = env.reset(seed=env._seed)
        out = [obs]
        for _ in range(steps):
            obs, rew, term, trunc, info = env.step(env.action_space.sample())
            summary = info.pop("summary", {})  # its wall time and pilot counters differ by design
            out.append((obs, rew, term, trunc, sorted(info.items()),
                        sorted((k, v) for k, v in summary.items() if k not in PILOT_FIELDS)))
            if term or trunc:
                out.append(env.reset()[0])
        return out

    piloted = rollout()
    assert (len(set(drains)) == kw.get("n_instances", 1)) == (env_id == "slogym/Routing-v0")
    init = Simulator.__init__
    monkeypatch.setattr(simulator_module.Simulator, "__init__",
                        lambda self, *a, **k: init(self, *a, **(k | {"pilot": False})))
    stepped = rollout()
    assert len(piloted) == len(stepped)
    for x, y in zip(piloted, stepped):
        assert repr(x) == repr(y)

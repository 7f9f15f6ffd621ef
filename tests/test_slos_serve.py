"""SLOs-Serve (slogym.baselines.slos_serve): DP optimality against brute force, App. D speculation lengths, the
admission guarantee in simulation, speculative-decoding token accounting, best-effort preemption, routing."""

from __future__ import annotations

import dataclasses
import itertools

import gymnasium as gym
import numpy as np
import pytest

import slogym  # noqa: F401  (registers the environments)
from slogym.baselines import make_policy
from slogym.baselines.slos_serve import (POLICIES, AdmissionProblem, BatchTimeInverse, IntervalBudget,
                                         allocate_prefill, expected_tokens, solve_admission, speculation_plan,
                                         with_draft_model)
from slogym.core.batch import BatchFeatures
from slogym.core.instance import InstanceState, Role
from slogym.core.policy import Scaler
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome
from slogym.engines.perf_models import RooflinePerf
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload

from conftest import ToyEngine
from helpers import expected_compute

H100 = get_engine("llama3-8b-h100")
ALPHA = 0.7


# ---------------------------------------------------------------------------------------------- the DP
def _random_problem(rng: np.random.Generator, n_new: int, n_forced: int, L: int) -> AdmissionProblem:
    tpot = np.sort(rng.choice([0.02, 0.03, 0.05, 0.1], L, replace=False))
    n = n_new + n_forced
    return AdmissionProblem(
        deadline=rng.uniform(0.0, 0.4, n), prefill=rng.integers(1, 900, n),
        memory=np.where(np.arange(n) < n_forced, 0, rng.integers(1, 5, n)), tier=rng.integers(0, L, n),
        forced=np.arange(n) < n_forced, base=rng.integers(0, 6, L), tpot=tpot, mem_units=int(rng.integers(4, 12)))


def _model(prob: AdmissionProblem, max_sl: int) -> tuple:
    inv = BatchTimeInverse(ToyEngine(), 2048, max_sl - 1, decode_seqs=4, decode_ctx=4000)
    return (lambda g: speculation_plan(g, prob.tpot, ALPHA, max_sl, inv)), inv


def _feasible(prob: AdmissionProblem, chosen: np.ndarray, budget: IntervalBudget) -> bool:
    """The DP's model checked directly on one admitted set: memory fits, and walking the accepted requests in
    deadline order, the prefill budget of each interval (counts so far) covers each prefill (pb >= 0) and the
    decodes of the counts after it still fit in a batch."""
    if prob.memory[chosen].sum() > prob.mem_units:
        return False
    idx = np.flatnonzero(chosen)
    idx = idx[np.argsort(prob.deadline[idx], kind="stable")]
    counts = np.zeros(prob.tpot.size, np.int64)
    if not budget.ok[tuple(counts)]:
        return False
    pb, t = 0.0, 0.0
    for i in idx.tolist():
        pb += float(budget(np.array(prob.deadline[i] - t), tuple(counts))) - prob.prefill[i]
        counts[prob.tier[i]] += 1
        t = prob.deadline[i]
        if pb < 0 or not budget.ok[tuple(counts)]:
            return False
    return True


@pytest.mark.parametrize("seed", range(40))
def test_dp_is_optimal_against_brute_force_over_admission_subsets(seed):
    rng = np.random.default_rng(seed)
    prob = _random_problem(rng, n_new=int(rng.integers(1, 8)), n_forced=int(rng.integers(0, 4)),
                           L=int(rng.integers(1, 3)))
    plan, inv = _model(prob, max_sl=int(rng.integers(1, 4)))
    F, K = (np.bincount(prob.tier[f], minlength=prob.tpot.size) for f in (prob.forced, ~prob.forced))
    dims = tuple((F + K + 1).tolist())
    # the same PB* table the DP builds, indexed by absolute counts relative to base
    budget = IntervalBudget(plan(np.indices(dims).reshape(len(dims), -1).T + prob.base), inv, dims)
    new = np.flatnonzero(~prob.forced)
    best = -1
    for k in range(new.size, -1, -1):
        for sub in itertools.combinations(new.tolist(), k):
            chosen = prob.forced.copy()
            chosen[list(sub)] = True
            if _feasible(prob, chosen, budget):
                best = k
                break
        if best >= 0:
            break
    res = solve_admission(prob, plan, inv)
    if best < 0:  # even the running requests alone are infeasible: nothing new is admitted
        assert not res.feasible and not res.accepted[new].any()
        return
    assert res.feasible
    assert res.accepted[prob.forced].all(), "forced (running) requests must stay admitted"
    assert int(res.accepted[new].sum()) == best
    assert _feasible(prob, res.accepted, budget)


def test_reconstructed_batches_cover_every_prefill_by_its_deadline_edf():
    rng = np.random.default_rng(7)
    for _ in range(20):
        prob = _random_problem(rng, 6, 2, 2)
        plan, inv = _model(prob, 3)
        res = solve_admission(prob, plan, inv)
        if not res.feasible:
            continue
        done = allocate_prefill(res, prob.deadline, prob.prefill)
        acc = res.accepted
        assert (done[acc] <= prob.deadline[acc] + 1e-9).all()
        assert np.isinf(done[~acc]).all()
        ends = [row[1] for row in res.intervals]
        assert ends == sorted(ends) and len(ends) == int(acc.sum())


def test_dp_prefers_more_requests_over_one_long_prompt():
    """Fig. 5's intuition: two short prompts beat one long prompt that would crowd them out."""
    inv = BatchTimeInverse(ToyEngine(), 2048, 0)
    tpot = np.array([0.05])
    # ~158 prefill tokens per 50 ms batch: the long prompt alone fits by 0.3 s, so do both short ones by 0.32 s,
    # but not the long one with either short one
    prob = AdmissionProblem(deadline=np.array([0.30, 0.32, 0.32]), prefill=np.array([900, 400, 400]),
                            memory=np.array([1, 1, 1]), tier=np.zeros(3, np.int64), forced=np.zeros(3, bool),
                            base=np.array([2]), tpot=tpot, mem_units=8)
    res = solve_admission(prob, lambda g: speculation_plan(g, tpot, 0.0, 1, inv), inv)
    assert res.accepted.tolist() == [False, True, True]


def test_bad_problem_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="prefill"):
        AdmissionProblem(np.zeros(2), np.zeros(3, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64),
                         np.zeros(2, bool), np.zeros(1, np.int64), np.ones(1), 4)
    with pytest.raises(ValueError, match="NaN"):
        AdmissionProblem(np.array([np.nan]), np.ones(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                         np.zeros(1, bool), np.zeros(1, np.int64), np.ones(1), 4)
    with pytest.raises(ValueError, match="max_sl"):
        POLICIES["slos-serve"](H100, max_sl=0)
    with pytest.raises(ValueError, match="k2"):
        with_draft_model(H100, float("nan"))


# ---------------------------------------------------------------------------------------------- App. D
def test_speculation_plan_follows_app_d():
    inv = BatchTimeInverse(H100, 8192, 4, decode_seqs=64, decode_ctx=64000)
    tpot = np.array([0.05, 0.1])
    counts = np.array([[10, 0], [10, 30], [0, 30], [0, 0]])
    pb = speculation_plan(counts, tpot, ALPHA, 5, inv)
    acc = expected_tokens(np.arange(1, 6), ALPHA)
    for g in range(counts.shape[0]):
        T, sl = pb.time[g], pb.sl[g]
        assert np.isfinite(T) and pb.budget[g] >= 0
        # T is one tier's TPOT x Acc(sl) and no present tier falls behind at its speculation length
        assert np.isclose(T, tpot[:, None] * acc[None]).any()
        assert (tpot * acc[sl - 1] >= T * (1 - 1e-9))[counts[g] > 0].all()
    # without speculation (Alg. 2) the batch time is the tightest TPOT present
    plain = speculation_plan(counts[:3], tpot, ALPHA, 1, inv)
    assert plain.time.tolist() == [0.05, 0.05, 0.1]
    assert (pb.budget[:3] / pb.time[:3] >= plain.budget / plain.time - 1e-9).all()  # App. D maximizes throughput
    assert expected_tokens(1, ALPHA) == 1.0 and np.isclose(expected_tokens(3, ALPHA), 1 + ALPHA + ALPHA ** 2)


def test_batch_time_inverse_is_the_largest_batch_within_the_time():
    inv = BatchTimeInverse(H100, 8192, 2, decode_seqs=32, decode_ctx=32000)
    for T in (0.02, 0.05, 0.1):
        for steps in (0, 2):
            cap = int(inv(T, steps))

            def f(x: int) -> float:
                return float(H100.batch_time(BatchFeatures.build(
                    prefill_tokens=x, prefill_seqs=1, prefill_attn=x * x, prefill_sq=x * x, decode_seqs=32,
                    decode_ctx=32000, kv_tokens=32000 + x, spec_steps=steps))[0])

            assert cap == 0 or f(cap) <= T
            # within the grid step (16 tokens) and the time resolution of the table
            assert f(cap + 16) > T - inv.res or cap >= 8192


# ---------------------------------------------------------------------------------------------- in simulation
def _run(policy: str, w: Workload, n_instances: int = 1, engine=H100, seed: int = 0, **params) -> Simulator:
    return Simulator(w, engine, make_policy(policy, engine, **params), n_instances, seed=seed).run()


@pytest.mark.parametrize("scenario,rate", [("chatbot", 45.0), ("mixed", 20.0)])
def test_admitted_requests_meet_their_slos_under_overload(scenario, rate):
    """The soft-admission guarantee: with deterministic execution (no speculation) every admitted request meets
    its SLOs; with speculation (random acceptance) nearly all do (the plan holds in expectation, §3.2.3)."""
    w = make_workload(scenario, rate=rate, n_requests=300, seed=1, engine=H100)
    for policy, floor in (("slos-serve-no-spec", 1.0), ("slos-serve", 0.99)):
        df = _run(policy, w).result().records
        admitted = ~df["best_effort"]
        assert df["best_effort"].any(), "overload must demote some requests to best-effort"
        assert df.loc[admitted, "slo_met"].mean() >= floor, (policy, df.loc[admitted & ~df["slo_met"]].head())
        assert set(df["outcome"]) <= {"finished", "best_effort"}


class _CountingRoofline(RooflinePerf):
    """§3.1.1's roofline (one line: 8 ms fixed, 30 us per token, ``k2`` = 1 ms per draft step) counting the
    iterations that ran draft steps (the simulator times each batch through batch_time_one)."""

    spec_iterations = 0

    def __init__(self) -> None:
        super().__init__(k1=[3e-5], k2=[1e-3], b=[8e-3])

    def batch_time_one(self, f: BatchFeatures) -> float:
        type(self).spec_iterations += int(f.spec_steps > 0)
        return super().batch_time_one(f)


ROOFLINE = dataclasses.replace(H100, perf=_CountingRoofline())


def test_app_d_speculates_when_longer_batches_raise_throughput():
    """Under the paper's roofline (throughput grows with the batch) App. D picks sl > 1; the planner's batch time
    is then TPOT * Acc(sl) > TPOT. Without dynamic batch sizing the batch time is fixed and nothing speculates."""
    inv = BatchTimeInverse(ROOFLINE, 8192, 3, decode_seqs=40, decode_ctx=40000)
    pb = speculation_plan(np.array([[40]]), np.array([0.1]), ALPHA, 4, inv)
    assert pb.sl[0, 0] > 1 and pb.time[0] > 0.1
    w = make_workload("chatbot", rate=40.0, n_requests=120, seed=2, engine=H100)
    before = _CountingRoofline.spec_iterations
    Simulator(w, ROOFLINE, make_policy("slos-serve-no-dbs", ROOFLINE), seed=5, spec_acceptance=0.8).run()
    assert _CountingRoofline.spec_iterations == before


def test_speculative_decoding_token_accounting_is_exact_and_seeded():
    w = make_workload("chatbot", rate=40.0, n_requests=150, seed=2, engine=H100)
    eng = ROOFLINE
    before = _CountingRoofline.spec_iterations
    a = Simulator(w, eng, make_policy("slos-serve", eng), seed=5, spec_acceptance=0.8).run()
    assert _CountingRoofline.spec_iterations > before, "App. D's speculation lengths must be used"
    rs = a.rs
    assert ((rs.outcome == Outcome.FINISHED) | (rs.outcome == Outcome.BEST_EFFORT)).all()
    assert (rs.generated == w.output_tokens).all()  # accepted drafts never run past a stage's end
    assert (rs.computed_total == expected_compute(w) + rs.recomputed).all()
    b = Simulator(w, eng, make_policy("slos-serve", eng), seed=5, spec_acceptance=0.8).run()
    assert a.result().records.equals(b.result().records)
    c = Simulator(w, eng, make_policy("slos-serve", eng), seed=6, spec_acceptance=0.8).run()
    assert not a.result().records.equals(c.result().records), "acceptance draws follow the seed"


def test_draft_model_term_is_added_per_spec_step():
    eng = with_draft_model(H100, 0.002)
    f = BatchFeatures.build(decode_seqs=8, decode_tokens=24, decode_ctx=8000, kv_tokens=8024, spec_steps=2)
    assert np.isclose(eng.batch_time(f)[0] - H100.batch_time(f)[0], 0.004)
    assert eng.batch_time_one(BatchFeatures(*(int(v[0]) for v in f))) == float(eng.batch_time(f)[0])


def test_best_effort_preemption_drops_kv_but_keeps_generated_tokens():
    """Best-effort requests fill a small KV; a burst of admitted requests then preempts them (recompute)."""
    eng = ToyEngine(kv_capacity_tokens=6000)
    reqs = [Request(0.0, [prefill(500), decode(300, 0.05)], best_effort=True) for _ in range(8)]
    reqs += [Request(0.5 + 0.01 * i, [prefill(300, 1.0), decode(100, 0.05)]) for i in range(8)]
    w = Workload.from_requests(reqs)
    sim = Simulator(w, eng, make_policy("slos-serve", eng), seed=0).run()
    rs = sim.rs
    pre = [e for e in sim.events if e[1] == "preempt"]
    assert pre, "admissions must preempt best-effort requests"
    assert all(bool(rs.be[e[2]]) for e in pre)
    assert (rs.generated == w.output_tokens).all() and (rs.outcome != Outcome.DROPPED).all()
    assert (rs.computed_total == expected_compute(w) + rs.recomputed).all()
    assert rs.recomputed[[e[2] for e in pre]].min() > 0
    df = sim.result().records
    assert df.loc[~df["best_effort"], "slo_met"].all()


@pytest.mark.parametrize("backup", ["best_effort", "reject"])
def test_routing_never_loses_a_request_and_reroutes(backup):
    w = make_workload("coder", rate=6.0, n_requests=300, seed=3, engine=H100)
    pol = make_policy("slos-serve", H100, backup=backup)
    sim = Simulator(w, H100, pol, 3, seed=0).run()
    rs = sim.rs
    assert (rs.outcome != Outcome.NONE).all() and (rs.outcome != Outcome.DROPPED).all()
    st = pol.router.state
    assert sum(p.invocations for p in st.planners) > len(w), "unattainable requests are re-routed"
    first = np.arange(len(w)) % 3
    placed = rs.instance >= 0
    assert (rs.instance[placed] != first[placed]).any()
    other = {"best_effort": Outcome.REJECTED, "reject": Outcome.BEST_EFFORT}[backup]
    assert not (rs.outcome == other).any()
    backed_up = (rs.outcome == (Outcome.BEST_EFFORT if backup == "best_effort" else Outcome.REJECTED)).sum()
    assert 0 < backed_up < len(w)


def test_replicas_scale_capacity():
    w = make_workload("chatbot", rate=60.0, n_requests=400, seed=4, engine=H100)
    one = _run("slos-serve", w, 1).result().summary["attainment"]
    two = _run("slos-serve", w, 2).result().summary["attainment"]
    assert two > one


# ---------------------------------------------------------------------------------------------- environments
def test_admission_env_expert_is_slos_serve_admission():
    env = gym.make("slogym/Admission-v0", scenario="chatbot", rate_scale=2.5, episode=60, seed=0,
                   pool_requests=600, policy="slos-serve")
    env.reset(seed=1)
    acts, done = [], False
    while not done:
        a = env.unwrapped.expert_action()
        acts.append(a)
        _, _, done, _, info = env.step(a)
    assert set(acts) == {0, 1}, "overload: the DP admits some and sends others to best-effort"
    u = env.unwrapped
    native = Simulator(u.sim.w, u.engine, make_policy("slos-serve", u.engine), u.n_instances, seed=u.sim.seed).run()
    assert u.sim.result().records.equals(native.result().records)


def test_routing_env_expert_is_slos_serve_routing():
    env = gym.make("slogym/Routing-v0", scenario="chatbot", rate_scale=1.0, episode=40, seed=0,
                   pool_requests=400, policy="slos-serve", n_instances=3)
    env.reset(seed=1)
    done, seen = False, set()
    while not done:
        a = env.unwrapped.expert_action()
        assert 0 <= a <= 3
        seen.add(a)
        _, _, done, _, info = env.step(a)
    assert {0, 1, 2} <= seen
    assert (env.unwrapped.sim.rs.outcome != Outcome.NONE).all()


class _DrainAndSwitch(Scaler):
    """Drains replica 0, turns replica 1 into a decode-only instance and starts a fourth replica (cold start)."""

    interval = 0.5

    def reset(self, sim) -> None:
        self.done = False

    def decide(self, sim, now) -> None:
        if not self.done and now >= 1.0:
            self.done = True
            sim.drain_instance(0)
            sim.switch_role(1, Role.DECODE)
            sim.add_instance(cold_start=1.0)


def test_router_never_sends_to_a_draining_starting_or_decode_instance():
    w = make_workload("chatbot", rate=40.0, n_requests=300, seed=6, engine=H100)
    pol = make_policy("slos-serve", H100)
    pol.scaler = _DrainAndSwitch()
    seen: list[tuple[int, int, int]] = []  # (instance, state, role) of every placement decision
    route = pol.router.route

    def checked(req, sim, now):
        i = route(req, sim, now)
        if i >= 0:
            seen.append((i, int(sim.instances[i].state), int(sim.instances[i].role)))
        return i

    pol.router.route = checked
    sim = Simulator(w, H100, pol, 3, seed=0).run()
    assert len({i for i, _, _ in seen}) == 4, "every replica accepting at some point is used"
    assert all(s == InstanceState.ACTIVE and r == Role.COLOCATED for _, s, r in seen)
    late = w.arrival > 1.0
    assert not np.isin(sim.rs.instance[late], [0, 1]).any(), "nothing new after the drain/role switch"
    assert (sim.rs.outcome != Outcome.NONE).all() and (sim.rs.outcome != Outcome.DROPPED).all()

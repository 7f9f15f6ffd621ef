"""PolyServe (slogym.baselines.polyserve): future-KV simulation, profile table, load-gradient choice, wait-time
admission, lazy promotion, nothing lost, determinism, Routing-v0 expert, and a small-scale comparison."""

from __future__ import annotations

import inspect

import gymnasium as gym
import numpy as np
import pytest

from helpers import assert_runs_equal
from slogym.baselines import make_policy
from slogym.baselines import polyserve_kernels as pk
from slogym.baselines.polyserve import (POLICIES, PolyServeScaler, _profiled, dynamic_chunk, future_kv_peak, pd_split,
                                        prefill_profile_table, profile_table, remaining_curve)
from slogym.core.batch import BatchFeatures
from slogym.core.instance import Role
from slogym.core.policy import BEST_EFFORT, DEFER
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome, Status
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload

ENGINE = get_engine("llama3-8b-h200")
CO = ("polyserve-co", "polyserve-co-random", "polyserve-co-minimal", "polyserve-co-chunk")
PD = ("polyserve-pd", "polyserve-pd-random", "polyserve-pd-minimal")
needs_pd = pytest.mark.skipif("pd" not in inspect.signature(Simulator).parameters,
                              reason="the simulator's prefill/decode roles (cluster API) have not landed")


def _tiers(n: int, rate: float, seed: int = 1) -> Workload:
    return make_workload("polyserve-tiers", rate=rate, n_requests=n, seed=seed, engine=ENGINE)


# ---------------------------------------------------------------------------------------------- future KV growth
def _brute_peak(rem: list[int], ctx: list[int], c0: int, r0: int) -> int:
    """Step the future iterations one by one: each resident holds c + k tokens while k < its remaining."""
    rs, cs = rem + [r0], ctx + [c0]
    return max(sum(c + k for r, c in zip(rs, cs) if r > k) for k in range(max(rs)))


def test_future_kv_peak_equals_step_by_step_simulation() -> None:
    rng = np.random.default_rng(0)
    rows, truth = [], []
    for _ in range(200):
        n = int(rng.integers(0, 12))
        rem = sorted(rng.integers(1, 40, n).tolist(), reverse=True)
        ctx = rng.integers(1, 500, n).tolist()
        rows.append((rem, ctx))
    c0, r0 = 37, 15
    width = max(len(r) for r, _ in rows)
    rem_a = np.zeros((len(rows), width), np.int64)
    cs_a = np.zeros((len(rows), width), np.int64)
    for i, (rem, ctx) in enumerate(rows):
        rem_a[i, :len(rem)] = rem
        cs_a[i, :len(rem)] = np.cumsum(ctx)
        truth.append(_brute_peak(rem, ctx, c0, r0))
    n = np.array([len(r) for r, _ in rows])
    assert future_kv_peak(rem_a, cs_a, n, c0, r0).tolist() == truth


def test_profile_table_budget_is_the_inverse_of_its_time() -> None:
    table = profile_table(ENGINE)
    rng = np.random.default_rng(1)
    tok, kvs = rng.integers(0, 20_000, 500), rng.integers(0, 900_000, 500)
    z = np.zeros_like(tok)
    ref = table.perf.batch_time(BatchFeatures(z, z, z, z, tok, tok, kvs, kvs, z))  # the ``table`` perf family
    assert np.allclose(table.time(tok, kvs), ref, rtol=1e-12, atol=0)
    assert table.time_one(300, 40_000) == pytest.approx(float(table.time(np.array([300]), np.array([40_000]))[0]))
    kv = np.array([0, 50_000, 300_000, 700_000])
    for tpot in (0.02, 0.05, 0.1):
        b = table.token_budget(kv, tpot)
        fits = b > 0
        assert fits[0], "an idle instance must fit some tokens within every tier's TPOT"
        assert (table.time(b[fits], kv[fits]) <= tpot + 1e-12).all()
        assert (table.time(b + 8, kv) > tpot).all()
        assert (table.time(np.ones(kv.size, np.int64), kv)[~fits] > tpot).all()  # 0 only when nothing fits
    # a tighter TPOT never gets a larger budget; more KV never a larger one either
    assert (table.token_budget(kv, 0.02) <= table.token_budget(kv, 0.05)).all()
    assert np.all(np.diff(table.token_budget(kv, 0.05)) <= 0)


# ---------------------------------------------------------------------------------------------- hand-built state
def _bound(n_inst: int, w: Workload, name: str = "polyserve-co") -> tuple[Simulator, object]:
    """A simulator whose policy is reset but not run; every request is ready (its prompt known)."""
    pol = POLICIES[name](ENGINE)
    sim = Simulator(w, ENGINE, pol, n_instances=n_inst)
    pol.reset(sim)
    sim.rs.num_tokens[:] = sim.rs.stage_len
    return sim, pol


def _tier0(n_inst: int, w: Workload) -> tuple[Simulator, object, object]:
    """:func:`_bound` with every instance labelled to the tightest tier: (simulator, fleet, router)."""
    sim, pol = _bound(n_inst, w)
    for j in range(n_inst):
        pol.router.core.fleet.relabel(j, 0, 0.0)
    return sim, pol.router.core.fleet, pol.router


def _chat_workload(n: int, prompt: int = 200, ttft: float = 1.0, tpot: float = 0.05) -> Workload:
    return Workload.from_requests([Request(0.0, [prefill(prompt, ttft), decode(100, tpot)]) for _ in range(n)])


def test_load_gradient_picks_highest_load_attainable_instance() -> None:
    w = _chat_workload(400)
    sim, fleet, router = _tier0(4, w)
    # instance loads: 0 empty, 1 light, 2 heavier, 3 heaviest but over its KV capacity once the request joins
    nxt = iter(range(1, 400))
    for j, (count, ctx) in enumerate([(0, 0), (10, 300), (40, 300), (60, 14_100)]):
        for _ in range(count):
            fleet.place(j, next(nxt), ctx, 0)
    j = np.arange(4)
    v = router.admission(j, 0, 0.0, 0.05)
    assert v.ok.tolist() == [True, True, True, False]
    assert v.kv_peak[3] > fleet.cap[3] and np.argmax(v.load) == 3
    assert router.route(0, sim, 0.0) == 2  # the highest load among the attainable ones
    # ties go to the first instance of the gradient
    sim2, _, router2 = _tier0(3, w)
    assert router2.route(0, sim2, 0.0) == 0


def test_admission_counts_the_wait_for_the_current_iteration() -> None:
    w = _chat_workload(100, prompt=2000, ttft=0.3, tpot=0.1)
    sim, fleet, router = _tier0(2, w)
    for r in range(1, 21):
        fleet.place(0, r, 500, 0)   # instance 0: higher load ...
    for r in range(21, 26):
        fleet.place(1, r, 500, 0)
    j = np.arange(2)
    tpot = 0.1
    before = router.admission(j, 0, 0.0, tpot)
    assert before.ok.all() and np.argmax(before.load) == 0
    fleet.busy_until[0] = 0.25  # ... but its current iteration ends in 250 ms: the TTFT (300 ms) is missed
    after = router.admission(j, 0, 0.0, tpot)
    assert after.first_token[0] == pytest.approx(before.first_token[0] + 0.25)
    assert after.ok.tolist() == [False, True]
    assert router.route(0, sim, 0.0) == 1


def test_ttft_prediction_waits_for_queued_slo_prompts_not_best_effort_ones() -> None:
    """The scheduler runs demoted / best-effort prompts after every SLO prompt (deadline order), so a new SLO
    prompt waits only for the SLO prompts queued ahead (§4.7, ``Fleet.q_slo``)."""
    w = _chat_workload(20, prompt=3000, ttft=0.15, tpot=0.05)
    sim, fleet, router = _tier0(3, w)
    sim.rs.be[2] = True
    fleet.place(1, 1, 3000, 3000)   # instance 1: an SLO prompt of 3000 tokens to prefill
    fleet.place(2, 2, 3000, 3000)   # instance 2: the same prompt, demoted to best effort
    assert fleet.q_pre.tolist() == [0, 3000, 3000] and fleet.q_slo.tolist() == [0, 3000, 0]
    v = router.admission(np.arange(3), 0, 0.0, 0.05)
    assert v.first_token[1] > v.first_token[2] + 0.03  # behind 3000 SLO tokens: later
    assert v.ok.tolist() == [True, False, True]
    # a batch formed on instance 2 prefilling its best-effort chunk leaves its SLO queue unchanged
    fleet.formed(2, 0.0, 0.02, [2], [500])
    assert (fleet.q_pre[2], fleet.q_slo[2]) == (2500, 0)


def test_demoted_requests_keep_the_load_gradient() -> None:
    """Best effort runs in the pool; without one (on the loosest tier) it goes to the highest-load instance, so
    the tier's last, least-loaded instance can empty and return to the pool (§4.3)."""
    w = _chat_workload(40, prompt=200, ttft=1.0, tpot=0.05)
    sim, fleet, router = _tier0(3, w)
    for r in range(1, 11):
        fleet.place(1, r, 500, 0)   # instance 1: the head of the gradient
    fleet.place(2, 11, 500, 0)      # instance 2: the tail, nearly empty
    assert router.best_effort_instance(0, sim, 0.0) == 1
    fleet.relabel(0, fleet.POOL, 0.0)
    assert router.best_effort_instance(12, sim, 0.0) == 0  # the pool first


def test_route_defers_when_nothing_admits_and_demotes_once_ttft_is_lost() -> None:
    w = _chat_workload(300, prompt=4000, ttft=0.3, tpot=0.02)
    sim, pol = _bound(1, w)
    fleet, router = pol.router.core.fleet, pol.router
    fleet.relabel(0, 0, 0.0)
    sim.instances[0].waiting.extend(range(1, 200))  # 199 residents of 4000 tokens: a 20 ms step is impossible
    fleet.observe(sim.instances[0], 0.0)
    assert router.route(0, sim, 0.0) == DEFER
    assert router.route(0, sim, 0.29) < 0 and router.route(0, sim, 0.29) != DEFER  # demoted to best effort


def test_a_request_an_idle_host_refuses_is_demoted_at_once() -> None:
    """An 8000-token prompt with a 300 ms TTFT at the 20 ms tier: alone in one iteration it would make its TTFT
    (the scenario's idle-server rule), in the tier's TPOT-bounded chunks it cannot (§4.7) -- so the idle pool
    instance refuses it, and it is demoted at once instead of pending until its TTFT is lost. A prompt the idle
    instance admits scales it up; without an idle instance the long one pends."""
    w = Workload.from_requests([Request(0.0, [prefill(8000, 0.3), decode(100, 0.02)]),
                                Request(0.0, [prefill(2000, 0.3), decode(100, 0.02)])]
                               + [Request(0.0, [prefill(4000, 0.3), decode(100, 0.02)]) for _ in range(199)])
    sim, pol = _bound(2, w)
    fleet, router = pol.router.core.fleet, pol.router
    assert fleet.table.time_one(8000, 8000) < 0.3  # the prompt alone in one iteration
    fleet.relabel(1, 0, 0.0)
    sim.instances[1].waiting.extend(range(2, 201))  # instance 1 (20 ms tier) is full
    fleet.observe(sim.instances[1], 0.0)
    assert fleet.label[0] == fleet.POOL and fleet.n_res[0] == 0
    assert router.route(0, sim, 0.0) == BEST_EFFORT
    assert router.route(1, sim, 0.0) == 0 and fleet.label[0] == 0  # scale-up from the pool
    sim2, pol2 = _bound(2, w)
    fleet2 = pol2.router.core.fleet
    for j, res in ((0, range(101, 201)), (1, range(2, 101))):
        fleet2.relabel(j, 0, 0.0)
        sim2.instances[j].waiting.extend(res)
        fleet2.observe(sim2.instances[j], 0.0)
    assert pol2.router.route(0, sim2, 0.0) == DEFER  # no idle instance: it waits


# ---------------------------------------------------------------------------------------------- runs
def _placements(pol: object) -> list[tuple[int, int, int, bool]]:
    """Wrap the router: record (request, instance, instance label after the decision, own tier was full)."""
    router = pol.router
    log: list[tuple[int, int, int, bool]] = []
    inner = router.route

    def route(req: int, sim: Simulator, now: float) -> int:
        fleet = router.core.fleet
        fleet.refresh_stale(now)
        t = int(fleet.rtier[req])
        own = np.flatnonzero(fleet.label == t)
        full = not own.size or not router.admission(own, req, now, float(fleet.tiers[min(t, fleet.n_tiers - 1)])
                                                  ).ok.any()
        i = inner(req, sim, now)
        if i >= 0:
            log.append((req, i, int(fleet.label[i]), full))
        return i

    router.route = route
    return log


def test_lazy_promotion_never_places_a_tighter_request_on_a_looser_instance() -> None:
    w = _tiers(1200, rate=70.0)
    pol = make_policy("polyserve-co", ENGINE)
    log = _placements(pol)
    sim = Simulator(w, ENGINE, pol, n_instances=4).run()
    fleet = pol.router.core.fleet
    tiers = fleet.rtier
    promoted = 0
    for req, _, label, full in log:
        if tiers[req] == fleet.n_tiers:
            continue  # best effort runs anywhere
        assert label <= tiers[req], f"request {req} of tier {tiers[req]} placed on an instance of tier {label}"
        if label < tiers[req]:
            promoted += 1
            assert full, f"request {req} promoted while its own tier could admit it"
    assert promoted > 0, "no lazy promotion happened: the check would be vacuous"
    assert sim.result().summary["outcomes"]["finished"] > 0


@pytest.mark.parametrize("name", CO)
def test_every_request_ends_in_exactly_one_outcome(name: str) -> None:
    w = _tiers(500, rate=120.0, seed=3)
    sim = Simulator(w, ENGINE, make_policy(name, ENGINE), n_instances=3)
    sim.completed = []
    sim.run()
    assert sorted(sim.completed) == list(range(len(w)))
    assert (sim.rs.status == Status.DONE).all() and (sim.rs.outcome != Outcome.NONE).all()
    assert "deferred_at_end" not in sim.dropped_reasons
    for inst in sim.instances:
        assert inst.free_blocks == inst.total_blocks


def test_router_predicts_batches_within_the_policys_max_num_seqs() -> None:
    """The router's predictions (prefill queue replay, decode admission) form batches within the same
    ``max_num_seqs`` the policy's scheduler applies, not the engine's larger default."""
    w = _tiers(40, rate=60.0, seed=1)
    for seqs, want in ((4, 4), (None, int(ENGINE.max_num_seqs))):
        pol = make_policy("polyserve-pd", ENGINE, **({} if seqs is None else {"max_num_seqs": seqs}))
        sim = Simulator(w, ENGINE, pol, pd=(1, 1)).run()
        assert pol.scheduler.max_num_seqs == want
        assert (pol.router.core.fleet.max_seqs == want).all()
        assert (sim.rs.outcome != Outcome.NONE).all()


def test_same_seed_same_results() -> None:
    w = _tiers(400, rate=90.0, seed=5)
    runs = [Simulator(w, ENGINE, make_policy("polyserve-co", ENGINE), n_instances=3, seed=2).run().result()
            for _ in range(2)]
    assert_runs_equal(*runs)
    rnd = [Simulator(w, ENGINE, make_policy("polyserve-co-random", ENGINE), n_instances=3, seed=s).run().result()
           for s in (2, 2, 3)]
    assert_runs_equal(rnd[0], rnd[1])
    assert not rnd[0].records["instance"].equals(rnd[2].records["instance"])


def test_scaler_returns_idle_instances_to_the_pool() -> None:
    w = _tiers(300, rate=40.0, seed=4)
    pol = make_policy("polyserve-co", ENGINE)
    sim = Simulator(w, ENGINE, pol, n_instances=6).run()
    fleet = pol.router.core.fleet
    assert (fleet.label == fleet.POOL).all()  # everything drained: every tier's last instance went back
    assert 0 < fleet.instance_seconds(sim.end_time) < 6 * sim.end_time


def test_tier_pool_deltas_scale_up_pending_tiers_and_return_empty_instances() -> None:
    """``PolyServeScaler.deltas`` (Scaling-v0, one pool per tier): +1 for a tier whose waiting requests can no
    longer meet their TTFT where they wait (they pend, §4.3; also while a scale-up is starting), -1 for a tier
    with an empty instance (§4.3's check of the last instance), 0 for a tier with both, or for a request already
    lost."""
    tpots = [0.02, 0.03, 0.05, 0.1]
    tier = np.repeat(np.arange(4), 10)
    w = Workload.two_stage(np.zeros(40), np.full(40, 4000), np.full(40, 100), np.full(40, 0.5),
                           np.array(tpots)[tier], tier=tier, tier_names=["a", "b", "c", "d", "e"])
    sim = Simulator(w, ENGINE, make_policy("polyserve-co", ENGINE), n_instances=5)
    sim.policy.reset(sim)
    for i in range(5):
        sim.set_pool(i, i)
    scaler = sim.policy.scaler
    sim.rs.num_tokens[:] = sim.rs.stage_len  # arrived (what the simulator sets at an arrival)
    now = 0.0
    # tier 1: ten 4000-token prompts queue on one instance: the last ones cannot start before their TTFT
    sim.instances[1].waiting.extend(range(10, 20))
    # tier 2: one prompt alone: it starts at once
    sim.instances[2].waiting.append(20)
    # tier 3: one prompt whose TTFT passed long ago: lost, not pending
    sim.instances[3].waiting.append(30)
    late = now + 5.0
    assert scaler.pending(sim.instances[1], now)
    assert not scaler.pending(sim.instances[2], now)
    assert not scaler.pending(sim.instances[3], late)
    d = scaler.deltas(sim, now).tolist()
    assert d == [-1, 1, 0, 0, -1]  # tiers 0 and 4 (best effort, no requests) are empty
    assert scaler.deltas(sim, late).tolist()[3] == 0
    sim.add_instance(cold_start=10.0, pool=1)  # a scale-up under way: the requests still pend, one more
    assert scaler.deltas(sim, now).tolist()[1] == 1
    sim.add_instance(pool=1)  # an empty active instance: PolyServe would admit the pending requests there
    assert scaler.deltas(sim, now).tolist()[1] == 0


def test_requests_pend_where_the_tpot_would_break() -> None:
    """The TPOT side of §4.5's admission: residents whose decode batch at the predicted future KV peak takes longer
    than the tier's TPOT pend, though each prompt alone would meet its TTFT."""
    w = Workload.two_stage(np.zeros(200), np.full(200, 10), np.full(200, 2000), np.full(200, 1.0),
                           np.full(200, 0.02), tier=np.zeros(200, np.int64), tier_names=["a"])
    sim = Simulator(w, ENGINE, make_policy("polyserve-co", ENGINE), n_instances=2)
    sim.policy.reset(sim)
    sim.rs.num_tokens[:] = sim.rs.stage_len  # arrived
    scaler = sim.policy.scaler
    sim.instances[0].waiting.extend(range(5))       # 5 x 2010 tokens at their peak: a short step
    sim.instances[1].waiting.extend(range(5, 200))  # 195 of them: the step at the peak exceeds 20 ms
    assert not scaler.pending(sim.instances[0], 0.0)
    assert not scaler._late_ttft(sim.instances[1], 0.0) and scaler.pending(sim.instances[1], 0.0)


def test_polyserve_beats_random_on_a_small_loaded_cluster() -> None:
    w = _tiers(800, rate=75.0, seed=7)
    att = {name: Simulator(w, ENGINE, make_policy(name, ENGINE), n_instances=4).run().result().summary["attainment"]
           for name in ("polyserve-co", "polyserve-co-random")}
    assert att["polyserve-co"] >= att["polyserve-co-random"], att


def test_bad_parameters_raise() -> None:
    with pytest.raises(ValueError, match="remaining='median'"):
        POLICIES["polyserve-pd"](ENGINE, remaining="median")
    with pytest.raises(ValueError, match="avg_decode_len"):
        POLICIES["polyserve-co"](ENGINE, avg_decode_len=0)
    with pytest.raises(ValueError, match="token_budget"):
        POLICIES["polyserve-co-chunk"](ENGINE, token_budget=0)
    with pytest.raises(ValueError, match="unknown parameters"):
        POLICIES["polyserve-co"](ENGINE, budget=3)


# ---------------------------------------------------------------------------------------------- Routing-v0
def test_routing_env_expert_is_polyserve() -> None:
    env = gym.make("slogym/Routing-v0", scenario="polyserve-tiers", n_instances=3, policy="polyserve-co",
                   episode=150, seed=0, pool_requests=600, rate_scale=4.0).unwrapped
    env.reset(seed=0)
    steps, placed = 0, 0
    done = False
    while not done:
        a = env.expert_action()
        assert env.action_space.contains(a) and env.action_masks()[a]
        placed += a < env.n_instances
        _, _, term, trunc, _ = env.step(a)
        done = term or trunc
        steps += 1
    assert steps >= 150 and placed > 0
    assert (env.sim.rs.status == Status.DONE).all()


# ---------------------------------------------------------------------------------------------- disaggregated (PD)
def test_dynamic_chunking_rule() -> None:
    assert dynamic_chunk(300, 1024) == (300, 724)       # fits: the rest of the budget stays for others
    assert dynamic_chunk(2047, 1024) == (2047, 0)       # below 2x the budget: finished at once, nothing joins
    assert dynamic_chunk(1025, 1024) == (1025, 0)
    assert dynamic_chunk(2048, 1024) == (1024, 0)       # 2x or more: one budget-sized chunk
    # the paper's example: 2050 tokens take 2 iterations (1024 + 1026) instead of 3 with plain chunks
    left, chunks = 2050, []
    while left:
        c, _ = dynamic_chunk(left, 1024)
        chunks.append(c)
        left -= c
    assert chunks == [1024, 1026]
    # the prediction forms the same iterations, each at its chunk's past KV (prefill attention, §4.5)
    pt = prefill_profile_table(ENGINE)
    fin = np.full(1, -1.0)
    pk.prefill_finish(np.array([2050]), np.array([0]), 1024, 256, 1.0, pt.tokens, pt.kv, pt.times, fin)
    assert fin[0] == pytest.approx(1.0 + pt.time_one(1024, 0) + pt.time_one(1026, 1024))
    assert pt.time_one(1024, 13_000) > 1.3 * pt.time_one(1024, 0)  # attention over a long past is not negligible


def _edf_case(slack_a: float, due_b: float) -> tuple[bool, float, float]:
    """A prefill instance holding prompt A (4096 tokens, due ``slack_a`` after its predicted end alone); B
    (512 tokens, due ``due_b``, before A) arrives. Returns B's admission, B's predicted first token and A's
    end alone."""
    pt = prefill_profile_table(ENGINE)
    fin = np.full(1, -1.0)
    pk.prefill_finish(np.array([4096]), np.array([0]), 1024, 256, 0.0, pt.tokens, pt.kv, pt.times, fin)
    a_alone = float(fin[0])
    ok, first = pk.prefill_admits(np.array([512, 4096]), np.array([0, 0]), np.array([due_b, a_alone + slack_a]), 0,
                                  1024, 256, 0.0, pt.tokens, pt.kv, pt.times)
    return ok, first, a_alone


def test_prefill_admission_is_edf_consistent() -> None:
    """§4.2 runs the prefill queue by TTFT deadline: a tighter newcomer waits only for prompts due before it,
    and may not push an admitted prompt past its deadline (unless that one was already late)."""
    ok, first, a_alone = _edf_case(slack_a=0.1, due_b=0.05)
    assert ok and first < 0.05 < a_alone    # B jumps the queue: counting all queued tokens would reject it
    ok, first, _ = _edf_case(slack_a=0.001, due_b=0.05)
    assert not ok and first < 0.05          # B alone would be on time, but A (on time without B) turns late
    ok, _, _ = _edf_case(slack_a=-0.01, due_b=0.05)
    assert ok                               # A is late anyway: it cannot veto B


@needs_pd
def test_pd_prefill_instance_uses_dynamic_chunks() -> None:
    w = Workload.from_requests([Request(0.0, [prefill(2050, 5.0), decode(5, 0.1)])])
    chunks: dict[str, list[int]] = {}
    for name in ("polyserve-pd", "polyserve-pd-minimal"):
        pol = make_policy(name, ENGINE)
        inner, log = pol.scheduler.next_batch, []

        def record(inst, now, inner=inner, log=log):
            b = inner(inst, now)
            if b is not None and inst.role == 1 and len(b):
                log.append(int(b.tokens.sum()))
            return b

        pol.scheduler.next_batch = record
        sim = Simulator(w, ENGINE, pol, pd=(1, 1)).run()
        assert sim.rs.outcome[0] == Outcome.FINISHED
        chunks[name] = log
    assert chunks["polyserve-pd"] == [1024, 1026]
    assert chunks["polyserve-pd-minimal"] == [1024, 1024, 2]


@needs_pd
@pytest.mark.parametrize("name", PD)
@pytest.mark.parametrize("n_decode", [3, 4])
def test_pd_every_request_one_outcome_and_no_looser_decode_host(name: str, n_decode: int) -> None:
    """Nothing lost, KV all returned, and no request in time on a looser decode instance -- with hand-offs
    pending (4 decode instances: one per tier) and without (3). Batches of at most 16 fill the decode side."""
    w = _tiers(500, rate=70.0, seed=3)
    pol = make_policy(name, ENGINE, max_num_seqs=16)
    hosts: list[tuple[int, int, bool]] = []
    inner = pol.router.route_decode
    deferred, demoted = 0, []

    def route_decode(req, sim, now):
        nonlocal deferred
        late = name == "polyserve-pd" and pol.router._decode_late(req, sim, now)
        i = inner(req, sim, now)
        if i == DEFER:
            deferred += 1
        elif i == BEST_EFFORT:
            assert late and not sim.rs.be[req]   # only a hand-off whose next token is lost, and only once
            demoted.append(req)
        else:
            hosts.append((req, int(pol.router.core.fleet.label[i]), late))
        return i

    pol.router.route_decode = route_decode
    sim = Simulator(w, ENGINE, pol, pd=(6 - n_decode, n_decode))
    sim.completed = []
    sim.run()
    assert sorted(sim.completed) == list(range(len(w)))
    assert (sim.rs.status == Status.DONE).all() and not sim.dropped_reasons
    assert all(inst.free_blocks == inst.total_blocks for inst in sim.instances)
    fleet = pol.router.core.fleet
    assert hosts and all(sim.instances[int(sim.rs.instance[r])].role == 2 or sim.rs.outcome[r] != Outcome.FINISHED
                         for r, _, _ in hosts)
    assert len({r for r, _, _ in hosts}) == len(hosts)      # each hand-off placed once
    if name == "polyserve-pd":
        # a demoted request, or one whose next token is lost, is best effort, routed like it (the pool first)
        assert all(label <= fleet.rtier[r] for r, label, late in hosts
                   if fleet.rtier[r] < fleet.n_tiers and not sim.rs.be[r])
        assert not any(late for _, _, late in hosts)          # a late hand-off is demoted before it is placed
        assert all(sim.rs.be[r] and sim.rs.outcome[r] == Outcome.BEST_EFFORT for r in demoted)
        assert demoted or n_decode < fleet.n_tiers            # pending hand-offs that waited too long were demoted
        assert (deferred > 0) == (n_decode >= fleet.n_tiers)  # hand-offs pend only with a cluster per tier
    else:
        assert deferred == 0


@needs_pd
def test_pd_prefill_prediction_matches_the_simulated_prefill() -> None:
    """The replayed prefill queue (deadline order, dynamic chunks, prefill profile with its past-KV axis) predicts
    when each prompt of a burst gets its first token, within the table's interpolation error."""
    # the first arrival starts the idle instance at once (the tightest: it would go first anyway); the rest queue
    prompts, ttfts = [1500, 3000, 700, 5000, 9000, 2600], [1.5, 4.0, 2.0, 5.0, 6.0, 3.0]
    w = Workload.from_requests([Request(0.0, [prefill(p, t), decode(4, 0.1)]) for p, t in zip(prompts, ttfts)])
    sim = Simulator(w, ENGINE, make_policy("polyserve-pd", ENGINE), pd=(1, 1)).run()
    order = np.argsort(ttfts, kind="stable")
    pt, fin = prefill_profile_table(ENGINE), np.full(len(prompts), -1.0)
    pk.prefill_finish(np.array(prompts)[order], np.zeros(len(prompts), np.int64), 1024, 256, 0.0, pt.tokens, pt.kv,
                      pt.times, fin)
    actual = sim.result().records.ttft.values[order]
    assert (sim.rs.outcome == Outcome.FINISHED).all()
    assert np.diff(actual).min() > 0                      # served in TTFT-deadline order
    assert np.abs(fin / actual - 1).max() < 0.05


@needs_pd
def test_decode_rows_count_requests_whose_kv_is_still_in_transfer() -> None:
    """A hand-off is the decode instance's resident from its routing on (§4.5 admits against every request the
    instance will serve), though the instance lists it only once its KV arrives: a row refresh during the
    transfer must not forget it."""
    w = _tiers(200, rate=60.0, seed=4)
    pol = make_policy("polyserve-pd", ENGINE)
    fleet_of, inner, seen = pol.router.core, pol.router.route_decode, []

    def route_decode(req, sim, now):
        d = inner(req, sim, now)
        inst = sim.instances[d]
        fleet_of.fleet.read(inst)  # a batch formation on d while req's KV is on its way
        seen.append(int(fleet_of.fleet.n_res[d]) - len(inst.running) - len(inst.waiting))
        return d

    pol.router.route_decode = route_decode
    sim = Simulator(w, ENGINE, pol, pd=(2, 2)).run()
    assert seen and min(seen) >= 1                      # the request being handed off is always counted
    assert all(not fleet_of.fleet.in_transfer(j) for j in range(4))  # arrived ones are pruned
    assert (sim.rs.outcome != Outcome.DROPPED).all()


@needs_pd
def test_demoted_hand_off_goes_to_the_pool_not_its_former_tier() -> None:
    """A demoted request is best effort on the decode side too: with nothing admitting it goes to the loosest
    tier, never forced onto its former (tight) tier's instances as a request still in time is."""
    w = _chat_workload(800, prompt=4000, ttft=0.3, tpot=0.02)
    pol = POLICIES["polyserve-pd"](ENGINE, tiers=(0.02, 0.03, 0.05, 0.1))
    sim = Simulator(w, ENGINE, pol, pd=(1, 3))
    pol.reset(sim)
    sim.rs.num_tokens[:] = sim.rs.stage_len
    sim.rs.num_computed[:] = sim.rs.num_tokens
    fleet, router = pol.router.core.fleet, pol.router
    fleet.relabel(1, 0, 0.0)
    for r in range(1, 150):          # the 20 ms decode instance is full
        fleet.place(1, r, 4000, 0)
    assert router.route_decode(0, sim, 0.0) == 2             # a tier-0 request in time: scale-up from the pool
    fleet.relabel(3, 3, 0.0)
    for r in range(150, 570):        # instances 2 (20 ms) and 3 (100 ms) out of KV: nothing admits
        fleet.place(2 + (r % 2), r, 4000, 0)
    sim.rs.be[600] = True
    assert router.route_decode(600, sim, 0.0) == 3           # demoted: the loosest tier
    assert fleet.label[router.route_decode(601, sim, 0.0)] == 0  # in time: its own tier's least-loaded


def _full_decode_side(labels: tuple[int, ...]) -> tuple[Simulator, object, object]:
    """A PD cluster (1 prefill instance, then decode instances labelled ``labels``) of 20 ms requests with 4000-token
    contexts, prefilled; every decode instance labelled < 3 is full (KV: its waiting list), the 100 ms ones empty."""
    w = _chat_workload(800, prompt=4000, ttft=0.3, tpot=0.02)
    pol = POLICIES["polyserve-pd"](ENGINE, tiers=(0.02, 0.03, 0.05, 0.1))
    sim = Simulator(w, ENGINE, pol, pd=(1, len(labels)))
    pol.reset(sim)
    sim.rs.num_tokens[:] = sim.rs.stage_len
    sim.rs.num_computed[:] = sim.rs.num_tokens
    fleet = pol.router.core.fleet
    r = 100
    for j, label in enumerate(labels, 1):
        fleet.relabel(j, label, 0.0)
        while label < 3 and r < 700 and fleet.kv_now[j] < fleet.cap[j]:
            sim.instances[j].waiting.append(r)
            fleet.place(j, r, 4000, 0)
            r += 1
    return sim, fleet, pol.router


@needs_pd
def test_in_time_hand_off_pends_rather_than_break_its_tier() -> None:
    """§4.2-4.3: a hand-off that no decode instance of its tier (or a tighter one) admits, with no pool instance
    to scale up from, waits for a finish instead of being forced onto a full instance; once its next token is
    lost it no longer waits."""
    sim, fleet, router = _full_decode_side((0, 0, 1, 3))
    assert router.route_decode(0, sim, 0.0) == DEFER
    assert router.pending == {0: 0} and router.pending_tier[0] == 1
    late = float(sim.rs.ready[1] + sim.w.stage_ttft[sim.rs.stage[1]]) + 0.1   # its second token was due before
    assert router.route_decode(0, sim, late) == BEST_EFFORT      # the pending one, offered again too late: demoted
    assert not router.pending and router.pending_tier[0] == 0
    sim.rs.be[0] = True                                          # as the simulator marks it, then asks again
    assert fleet.label[router.route_decode(0, sim, late)] == 3   # best effort: the loosest tier, no wait
    sim3, fleet3, router3 = _full_decode_side((0, 1, 3))       # fewer decode instances than tiers: no wait
    assert fleet3.label[router3.route_decode(0, sim3, 0.0)] == 0  # its tier's least-loaded, as before


@needs_pd
def test_a_demoted_hand_off_no_longer_counts_as_its_former_tier() -> None:
    """A hand-off whose next token is lost is demoted (``route_decode`` returns BEST_EFFORT; the simulator marks
    it best effort and asks again): its host's row no longer counts it at its tier (scale-up onto that host stays
    open to every tier), and a tier's last instance holding only demoted requests of that tier goes to the
    pending list (§4.4: no request *of the current tier* occupies it)."""
    sim, fleet, router = _full_decode_side((0, 0, 1, 3))
    late = float(sim.rs.ready[0] + sim.w.stage_ttft[sim.rs.stage[0]]) + 0.1
    assert router.route_decode(0, sim, late) == BEST_EFFORT
    sim.rs.be[0] = True
    host = router.route_decode(0, sim, late)
    assert fleet.label[host] == 3 and fleet.res_tight[host] == fleet.n_tiers  # best effort, not the 20 ms tier
    sim.instances[host].waiting.append(0)
    fleet.read(sim.instances[host])                              # a row refresh agrees
    assert fleet.res_tight[host] == fleet.n_tiers
    j = fleet.joined[0][-1]                                      # the 20 ms tier's last instance ...
    PolyServeScaler(router.core).decide(sim, late)
    assert fleet.label[j] == 0                                   # ... stays while it holds 20 ms requests
    sim.rs.be[sim.instances[j].waiting] = True                   # ... and goes once they are all demoted
    PolyServeScaler(router.core).decide(sim, late)
    assert fleet.label[j] == fleet.PENDING


@needs_pd
def test_promotion_leaves_a_tier_with_pending_hand_offs_alone() -> None:
    """§4.2 keeps a queue per tier and §4.4 promotes only because the request's own tier is full: a looser
    hand-off takes no capacity of a tighter tier whose own hand-offs pend."""
    sim, fleet, router = _full_decode_side((1, 1, 1, 0))
    fleet.rtier[2:4] = 1                             # 30 ms requests; the 30 ms instances are full
    assert router.route_decode(2, sim, 0.0) == 4    # lazy promotion onto the empty 20 ms instance ...
    sim2, fleet2, router2 = _full_decode_side((1, 1, 1, 0))
    fleet2.rtier[2:4] = 1
    router2.pending[0], router2.pending_tier[0] = 0, 1  # ... but not while a 20 ms hand-off pends
    sim2.rs.status[0] = Status.TRANSFER
    assert router2.route_decode(3, sim2, 0.0) == DEFER


# ---------------------------------------------------------------------------------------------- CO prefill attention
def _flat_prefill_profile(fleet: object) -> None:
    """Replace the fleet's prefill profile with one whose time ignores the past: no prefill attention (§4.5)."""
    p = fleet.ptable
    fleet.ptable = _profiled(p.tokens, p.kv, np.repeat(p.times[:, :1], p.kv.size, axis=1))


def _real_time(dec: int, kv_dec: int, chunk: int, past: int) -> float:
    """The engine's own time of ``dec`` decodes reading ``kv_dec`` KV tokens plus one chunk after ``past``."""
    f = BatchFeatures.build(prefill_tokens=np.array([chunk]), prefill_seqs=np.array([1]),
                            prefill_attn=np.array([chunk * (past + chunk)]), prefill_sq=np.array([chunk * chunk]),
                            decode_seqs=np.array([dec]), decode_tokens=np.array([dec]), decode_ctx=np.array([kv_dec]),
                            kv_tokens=np.array([kv_dec + past + chunk]))
    return float(np.asarray(ENGINE.batch_time(f))[0])


def test_co_chunk_budget_counts_the_prefill_attention_over_its_past() -> None:
    """§3.5: a co-located iteration's time includes the prefill chunk's attention over its past. Without past the
    chunk is the table's budget less the decodes (§4.5); after a long past it is smaller, and the engine's own
    time of that batch stays within the TPOT where the attention-free chunk overruns it."""
    sim, pol = _bound(1, _chat_workload(60, prompt=8000, ttft=3.0))
    fleet, table = pol.router.core.fleet, pol.router.core.fleet.table
    dec, kv_dec, past, tpot = 100, 300_000, 6000, 0.05
    kv = kv_dec + past
    free = fleet.chunk_budget(dec, kv, tpot, 0)
    long = fleet.chunk_budget(dec, kv, tpot, past)
    assert free == table.token_budget_one(kv, tpot) - dec
    assert 0 < long < free
    assert _real_time(dec, kv_dec, free, past) > 1.04 * tpot
    assert _real_time(dec, kv_dec, long, past) <= 1.01 * tpot
    # the router's TTFT prediction (§4.7) reads the same chunk: a long prompt's first token comes later with the
    # prefill attention than without it
    for j in range(1, 41):
        fleet.place(0, j, 2000, 0)
    with_attn = pol.router.admission(np.array([0]), 0, 0.0, tpot).first_token[0]
    _flat_prefill_profile(fleet)
    assert pol.router.admission(np.array([0]), 0, 0.0, tpot).first_token[0] < with_attn
    assert fleet.chunk_budget(dec, kv, tpot, past) == free


def _prefill_iterations(flat: bool) -> np.ndarray:
    """Durations of the iterations that prefill a chunk of an 8000-token prompt after >= 1500 tokens of past, on
    one co-located instance decoding 80 requests (TPOT 50 ms)."""
    reqs = [Request(0.0, [prefill(200, 1.0), decode(1500, 0.05)]) for _ in range(80)]
    reqs.append(Request(2.0, [prefill(8000, 3.0), decode(10, 0.05)]))
    pol = make_policy("polyserve-co", ENGINE)
    sched, log = pol.scheduler, []
    inner = sched.next_batch

    def next_batch(inst, now):
        if flat and not log:
            _flat_prefill_profile(sched.core.fleet)
        past = int(inst.sim.rs.num_computed[80])
        b = inner(inst, now)
        log.append((now, b is not None and 80 in b.req.tolist() and past < 8000 - 1 and past >= 1500))
        return b

    sched.next_batch = next_batch
    sim = Simulator(Workload.from_requests(reqs), ENGINE, pol, n_instances=1).run()
    assert (sim.rs.outcome == Outcome.FINISHED).all()
    t = np.array([x[0] for x in log])
    chunked = np.array([x[1] for x in log])[:-1]
    return np.diff(t)[chunked]


def test_co_batches_with_a_long_past_stay_within_the_tpot() -> None:
    """Batch formation shrinks the chunk by its prefill attention (``Fleet.chunk_budget``): the simulated
    iterations of a long prompt's later chunks beside a full decode batch stay at the TPOT; the attention-free
    budget (§4.5's table alone) overruns it."""
    fixed, flat = _prefill_iterations(False), _prefill_iterations(True)
    assert fixed.size >= 3 and flat.size >= 3
    assert fixed.max() <= 0.05 * 1.02
    assert flat.max() > 0.05 * 1.1


def test_remaining_output_curves() -> None:
    """§4.5's average decode length: ``average`` predicts ``avg - generated`` (at least 1); ``residual`` the mean
    remaining output of the requests that got as far, equal to the average for a new request and the expected rest
    (not 1 token) for one past the average."""
    out = np.random.default_rng(3).integers(1, 2049, 3000)
    avg, res = remaining_curve(out, mode="average"), remaining_curve(out, mode="residual")
    assert avg.tolist() == np.maximum(int(out.mean()) - np.arange(int(out.mean()) + 1), 1).tolist()
    for g in (0, 1, 700, 1500, 2040, int(out.max())):
        alive = out[out > g]
        assert res[g] == (max(round(float((alive - g).mean())), 1) if alive.size else 1)
    assert abs(int(res[0]) - out.mean()) <= 1
    g = int(out.mean()) + 200  # past the average: the paper's rule says "next step", the residual ~ (2048 - g) / 2
    assert avg[min(g, avg.size - 1)] == 1 and abs(int(res[g]) - (2048 - g) / 2) < 60
    assert remaining_curve(out, avg_decode_len=500, mode="residual")[0] == 500


# ------------------------------------------------------------------------------------ PD on a co-located cluster
@needs_pd
@pytest.mark.parametrize("name", PD)
def test_pd_variants_split_a_colocated_cluster(name: str) -> None:
    """Without ``pd=`` a PD variant splits a co-located cluster of 4 into pd_split's P:D at reset (as DistServe
    does): KV moves between the roles and nothing is lost."""
    w = _tiers(300, rate=60.0, seed=3)
    p, d = pd_split(w, ENGINE, 4, 4)
    assert p >= 1 and d >= 1 and p + d == 4
    sim = Simulator(w, ENGINE, make_policy(name, ENGINE), n_instances=4)
    sim.completed = []
    sim.run()
    assert [inst.role for inst in sim.instances] == [Role.PREFILL] * p + [Role.DECODE] * d
    assert sim.result().summary["kv_transfers"] > 0
    assert sorted(sim.completed) == list(range(len(w)))
    assert (sim.rs.status == Status.DONE).all() and (sim.rs.outcome != Outcome.NONE).all()
    assert "deferred_at_end" not in sim.dropped_reasons
    assert all(inst.free_blocks == inst.total_blocks for inst in sim.instances)


@needs_pd
def test_pd_variants_keep_a_preset_split_and_co_variants_stay_colocated() -> None:
    w = _tiers(200, rate=40.0, seed=2)
    p, _ = pd_split(w, ENGINE, 4, 4)
    preset = (1, 3) if p != 1 else (2, 2)  # not the split the policy would choose
    for name in PD:
        sim = Simulator(w, ENGINE, make_policy(name, ENGINE), pd=preset).run()
        assert [inst.role for inst in sim.instances] == [Role.PREFILL] * preset[0] + [Role.DECODE] * preset[1]
        assert sim.result().summary["kv_transfers"] > 0
        one = Simulator(w, ENGINE, make_policy(name, ENGINE), n_instances=1).run()  # nothing to split
        assert one.instances[0].role == Role.COLOCATED and one.result().summary["kv_transfers"] == 0
    for name in CO:
        sim = Simulator(w, ENGINE, make_policy(name, ENGINE), n_instances=4).run()
        assert all(inst.role == Role.COLOCATED for inst in sim.instances)
        assert sim.result().summary["kv_transfers"] == 0


def test_pd_split_keeps_a_decode_instance_per_tier_where_the_fleet_has_room() -> None:
    """The reproduction's rule: by the work share, at least one decode instance per tier once ``n >= 2 x
    tiers``, at least one instance on each side."""
    w = _tiers(400, rate=40.0, seed=1)
    for n in range(2, 25):
        p, d = pd_split(w, ENGINE, n, 4)
        assert p + d == n and p >= 1 and d >= (4 if n >= 8 else 1)
    long_prompts = Workload.from_requests([Request(0.0, [prefill(8000, 1.0), decode(8, 0.05)]) for _ in range(20)])
    assert pd_split(long_prompts, ENGINE, 20, 4) == (16, 4)   # the work share alone would leave fewer decoders
    assert pd_split(long_prompts, ENGINE, 6, 4)[1] == 1
    with pytest.raises(ValueError):
        pd_split(w, ENGINE, 1, 4)

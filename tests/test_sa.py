"""SA scheduler (Huang et al. 2025): objective by hand, search quality vs exhaustive, determinism, simulator runs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from slogym.baselines import make_policy
from slogym.baselines.sa import (POLICIES, AnnealConfig, PlanProblem, _compositions, _propose, anneal, build_problem,
                                 exhaustive)
from slogym.baselines.sa_kernels import propose, resample, score_plans
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.gaussian import GaussianLengthPredictor, history_of
from slogym.workloads.profiling import default_history
from slogym.workloads.scenarios import make_workload

ENGINE = get_engine("qwen2.5-7b-v100-tp2")


def _random_problem(n: int, bmax: int, seed: int) -> PlanProblem:
    rng = np.random.default_rng(seed)
    chat = rng.random(n) < 0.5
    L = np.where(chat, rng.integers(200, 1500, n), rng.integers(50, 400, n))
    O = np.where(chat, rng.integers(50, 600, n), rng.integers(50, 400, n))
    inf = np.inf
    return build_problem(ENGINE, bmax, L, O, np.where(chat, inf, 30.0), np.where(chat, 10.0, inf),
                         np.where(chat, 0.05, inf), np.zeros(n), np.arange(n, dtype=float))


def test_objective_by_hand():
    # two requests, B_max = 2; e(1) = (2, 1), e(2) = (3, 1.5); request 0 has an e2e SLO of 2.5 s
    p = PlanProblem(np.array([[2.0, 1.0], [3.0, 1.5]]), np.array([[0.5, 0.2], [0.6, 0.3]]),
                    np.ones((2, 2), bool), np.array([2.5, np.inf]), np.array([np.inf, np.inf]),
                    np.zeros(2), np.arange(2.0))
    g = np.array([[0, 1], [1, 0], [0, 0]])
    # [0,1]: latencies 2, 2+1=3, both met -> 2/5; [1,0]: 1+2=3 misses, 1 -> 1/4; together: 3, 1.5, 0 met -> 1/4.5
    np.testing.assert_allclose(p.objective(g), [2 / 5, 1 / 4, 1 / 4.5])
    assert exhaustive(p)[1] == pytest.approx(2 / 5)


@pytest.mark.parametrize("n,bmax", [(4, 1), (5, 2), (6, 4), (7, 1), (7, 2), (7, 4)])
def test_sa_within_one_percent_of_exhaustive(n, bmax):
    """§5.2: with the paper's defaults (L = 500 moves per level, T 100 -> 20, alpha 0.95) SA shows "a maximum
    degradation of just 1.0%" against exhaustive search "across the tested examples".

    Annealing is random, so the claim is checked as a rate over runs, not on one lucky seed: 10 seeded problems x 5
    annealing seeds. Scratch measurement (40 problems x 20 seeds each): a run ends more than 1% below the optimum
    in 0.13% (N/B_max 7/1, 6/2), 0.50% (7/2) and 1.75% (7/3) of runs, worst 4.4% -- the paper's 1.0% holds for
    almost every run, not for every one. Asserted: no run beats the optimum, at least 48 of 50 runs are within 1%,
    and the median run reaches the optimum. A search that stops near its start (population 4) fails the count in
    all 6 cases below, one that anneals cold (T 0.02 -> 0.01) in 5."""
    gaps = []
    for seed in range(10):
        p = _random_problem(n, bmax, seed)
        g_ex = exhaustive(p)[1]
        for run in range(5):
            g, g_sa = anneal(p, np.random.default_rng([seed, run]))
            assert g_sa <= g_ex * (1 + 1e-12) and p.objective(g[None])[0] == pytest.approx(g_sa)
            gaps.append(1 - g_sa / g_ex)
    gaps = np.array(gaps)
    assert np.sum(gaps <= 0.01) >= 48, np.sort(gaps)[-5:]
    assert np.median(gaps) <= 1e-12, np.median(gaps)


def _direct_objective(p: PlanProblem, g: np.ndarray) -> float:
    """Eq. 2-12 request by request: batches in index order, each as long as its longest member."""
    size = np.bincount(g, minlength=p.n)
    exec_ = [p.exec_time[size[g[j]] - 1, j] for j in range(p.n)]
    met = lat = 0.0
    for j in range(p.n):
        wait = sum(max(exec_[i] for i in range(p.n) if g[i] == b) for b in set(g) if b < g[j])
        b = size[g[j]] - 1
        met += (wait + exec_[j] <= p.e2e_budget[j] and wait + p.first_time[b, j] <= p.ttft_budget[j]
                and p.tpot_ok[b, j])
        lat += wait + exec_[j] + p.offset[j]
    return met / lat


def _random_plans(n: int, bmax: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` random plans with at most ``bmax`` requests per batch (a permutation at ``bmax = 1``)."""
    plans = []
    while len(plans) < k:
        g = rng.permutation(n) if bmax == 1 else rng.integers(0, n, n)
        if np.bincount(g).max() <= bmax:
            plans.append(g)
    return np.array(plans)


@pytest.mark.parametrize("bmax", [1, 3])
def test_vectorized_objective_matches_direct(bmax):
    n, rng = 6, np.random.default_rng(bmax)
    p = _random_problem(n, bmax, 5)
    p = PlanProblem(p.exec_time, p.first_time, p.tpot_ok, p.e2e_budget, p.ttft_budget,
                    rng.random(n), p.arrival)   # nonzero offsets count in every latency
    plans = _random_plans(n, bmax, 40, rng)
    np.testing.assert_allclose(p.objective(plans), [_direct_objective(p, g) for g in plans])


@pytest.mark.parametrize("n,bmax", [(6, 1), (10, 1), (7, 3), (12, 4)])
def test_compiled_objective_matches_numpy(n, bmax):
    # the search's compiled G (sequential sums) against the vectorized NumPy reference (BLAS sums)
    rng = np.random.default_rng(n * bmax)
    p = _random_problem(n, bmax, n)
    plans = _random_plans(n, bmax, 200, rng)
    met, lat, _ = p.score(plans)
    met_c, lat_c = score_plans(plans, p.exec_time, p.latest_start)
    assert met.min() < met.max()   # the plans differ in the SLOs they meet: both outcomes are compared
    np.testing.assert_array_equal(met_c, met)
    np.testing.assert_allclose(lat_c + p._offset_sum, lat, rtol=1e-12)


@pytest.mark.parametrize("n,bmax", [(6, 1), (10, 1), (7, 2), (9, 4)])
def test_compiled_moves_match_numpy(n, bmax):
    # the search's moves and its scoring of them (at B_max = 1 incremental: only the swapped span is re-checked)
    # against the vectorized NumPy moves and objective
    rng = np.random.default_rng(bmax)
    p = _random_problem(n, bmax, 1)
    cur = _random_plans(n, bmax, 300, rng)
    kind, r, r2 = rng.integers(0, 3, 300), rng.integers(0, n, 300), rng.integers(0, n, 300)
    expected = _propose(cur, p.score(cur)[2], bmax, kind, r, r2)
    assert (expected != cur).any(axis=1).sum() > 50   # many moves change their plan (at bmax = 1 only swaps)
    plans, met, lat = propose(cur, p.exec_time, p.latest_start, kind, r, r2)
    np.testing.assert_array_equal(plans, expected)
    met_np, lat_np, _ = p.score(expected)
    assert met_np.min() < met_np.max()   # both SLO outcomes occur among the moved plans
    np.testing.assert_array_equal(met, met_np)
    np.testing.assert_allclose(lat + p._offset_sum, lat_np, rtol=1e-12)


def test_compiled_resampling_is_systematic():
    # keep[i] = first plan whose cumulative Boltzmann weight reaches (i + u0) / m of the total (searchsorted),
    # computed in the search by counts and a prefix sum; duplicate G values and u0 = 0 included
    rng = np.random.default_rng(0)
    for trial in range(300):
        m = int(rng.integers(1, 80))
        g = rng.random(m) * (rng.random(m) < 0.7)
        coef, u0 = float(rng.random() * 30), (0.0 if trial % 5 == 0 else float(rng.random()))
        w = np.cumsum(np.exp(coef * (g - g.max())))
        expected = np.minimum(np.searchsorted(w, (np.arange(m) + u0) / m * w[-1]), m - 1)
        np.testing.assert_array_equal(resample(g, coef, float(g.max()), u0), expected)


def _canonical(g: np.ndarray) -> tuple[frozenset[int], ...]:
    """A plan as its non-empty batches in order (what G depends on)."""
    return tuple(frozenset(np.flatnonzero(g == b).tolist()) for b in np.unique(g))


@pytest.mark.parametrize("n,bmax", [(4, 1), (4, 2), (5, 3)])
def test_moves_reach_every_plan_of_the_exhaustive_space(n, bmax):
    # breadth-first search over squeeze / delay / swap from the start solution visits every (permutation,
    # batch-size sequence) the exhaustive search scores, up to empty batches
    p = _random_problem(n, bmax, 0)
    kind, r, r2 = (a.ravel() for a in np.meshgrid(np.arange(3), np.arange(n), np.arange(n), indexing="ij"))
    seen, frontier = {tuple(p.fill(np.arange(n))[0])}, [p.fill(np.arange(n))[0]]
    while frontier:
        cur = np.array(frontier)
        k = cur.shape[0]
        size = p.score(cur)[2]
        props = _propose(np.repeat(cur, kind.size, axis=0), None if size is None else np.repeat(size, kind.size, 0),
                         bmax, np.tile(kind, k), np.tile(r, k), np.tile(r2, k))
        frontier = [g for g in {tuple(x) for x in props} - seen]
        seen |= set(frontier)
        frontier = [np.array(g) for g in frontier]
    space = set()
    for perm in itertools.permutations(range(n)):
        for sizes in _compositions(n, bmax):
            g = np.empty(n, np.int64)
            g[list(perm)] = np.repeat(np.arange(len(sizes)), sizes)
            space.add(_canonical(g))
    assert {_canonical(np.array(g)) for g in seen} == space


def test_anneal_config_rejects_bad_values():
    for bad in ({"iters": 0}, {"t0": 10.0, "t_min": 20.0}, {"alpha": 1.0}):
        with pytest.raises(ValueError, match="invalid annealing config"):
            AnnealConfig(**bad)
    assert len(AnnealConfig().temperatures()) == 32   # 100 * 0.95^k >= 20


@pytest.mark.parametrize("bmax", [1, 4])
def test_search_is_deterministic(bmax):
    # the compiled search draws its own random numbers, seeded from the caller's generator
    p = _random_problem(10, bmax, 1)
    a, b = anneal(p, np.random.default_rng(7)), anneal(p, np.random.default_rng(7))
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    assert p.objective(a[0][None])[0] == pytest.approx(a[1])   # the returned G is the returned plan's


def test_gaussian_predictor_online():
    pred = GaussianLengthPredictor(2, prior_mean=50, seed=0)
    assert pred.mean(1) == 50 and pred.std(1) == 0
    for x in (10, 20, 30):
        pred.observe(0, x)
    assert pred.mean(0) == pytest.approx(20) and pred.std(0) == pytest.approx(np.std([10, 20, 30]))
    s = pred.sample(np.zeros(1000, np.int64))
    assert s.min() >= 1 and abs(s.mean() - 20) < 1.5


# a history in which the apps appear in the other order than in the simulated workload's codes (chat = 0, code = 1)
HISTORY = (("code", 100), ("chat", 300), ("code", 200), ("chat", 500), ("code", 300))


def test_warm_predictor_mean_is_the_history_mean():
    pol = POLICIES["sa"](ENGINE, max_batch_size=2, seed=0, history=HISTORY)
    sim = Simulator(_sa_mix(4, 1), ENGINE, pol, attainment="mean_tpot")
    pol.scheduler.reset(sim)
    chat, code = sim.w.app_names.index("chat"), sim.w.app_names.index("code")
    lengths = pol.scheduler.lengths
    # code: (100 + 200 + 300) / 3 = 200, population std sqrt((100^2 + 0 + 100^2) / 3); chat: (300 + 500) / 2 = 400
    assert lengths.mean(code) == pytest.approx(200) and lengths.std(code) == pytest.approx(np.sqrt(20000 / 3))
    assert lengths.mean(chat) == pytest.approx(400) and lengths.std(chat) == pytest.approx(100)
    assert lengths.count[chat] == 2 and lengths.count[code] == 3
    # the router sizes requests by the warmed mean too (Eq. 20 needs prompt + predicted output)
    assert pol.router.scheduler.lengths is lengths


def test_warm_replays_the_online_update():
    online, warmed = GaussianLengthPredictor(2, 128, seed=5), GaussianLengthPredictor(2, 128, seed=5)
    for app, x in ((0, 40), (1, 7), (0, 90), (0, 11)):
        online.observe(app, x)
    warmed.warm([0, 1, 0, 0], [40, 7, 90, 11])
    apps = np.array([0, 1, 1, 0, 0])
    assert np.array_equal(online.sample(apps), warmed.sample(apps))   # same fit, and no random draw consumed


def test_history_of_a_workload_and_bad_histories():
    w = _sa_mix(6, 2)
    h = history_of(w)
    assert [a for a, _ in h] == [w.app_names[a] for a in w.app] and [x for _, x in h] == w.output_tokens.tolist()
    with pytest.raises(ValueError, match="summarize"):
        Simulator(w, ENGINE, POLICIES["sa"](ENGINE, history=[("summarize", 10)])).run()
    with pytest.raises(ValueError, match="-3"):
        POLICIES["sa"](ENGINE, history=[("chat", -3)])
    with pytest.raises(ValueError, match="history_requests"):
        POLICIES["sa"](ENGINE, history_requests=0)
    with pytest.raises(ValueError, match="app code 2"):
        GaussianLengthPredictor(2).warm([2], [10])


def test_default_is_warm_on_the_profiling_slice_and_cold_is_available():
    # the registered policy warms its Gaussian on the profiling slice (§5.3 "profiling data from tasks", §4.2): a
    # fresh seeded draw of the simulated scenario, the slice Tempo trains on; history=() keeps the cold ablation
    w = _sa_mix(10, 3)
    run = lambda **kw: Simulator(w, ENGINE, POLICIES["sa"](ENGINE, max_batch_size=2, seed=4, **kw),  # noqa: E731
                                 attainment="mean_tpot").run()
    default = run()
    cold = run(history=())
    explicit = run(history=history_of(default_history(w, 1500, 4)))
    default_again, cold_again = run(), run(history=())
    assert default.result().records.equals(default_again.result().records)      # deterministic
    assert cold.result().records.equals(cold_again.result().records)           # a warm run leaves no state behind
    assert default.result().records.equals(explicit.result().records)          # the default is exactly that slice
    # the slice is held out: a draw of the scenario with its own seed, not the served requests
    hist = default_history(w, 1500, 4)
    assert hist.name == "sa-mix" and len(hist) == 1500
    assert not np.array_equal(hist.output_tokens[:len(w)], w.output_tokens)
    assert history_of(default_history(w, 1500, 5)) != history_of(hist)          # seeded by the scheduler's seed
    # all ten arrive at t = 0 and are planned before any completion: cold = the 128-token prior for every request,
    # warm = draws from the slice's per-app Gaussian, whose mean is the slice's per-app mean
    cold_pred, warm_pred = cold.policy.scheduler._pred, default.policy.scheduler._pred
    assert (cold_pred == 128).all() and not (warm_pred == 128).all()
    assert not cold.result().records.equals(default.result().records)
    sched = POLICIES["sa"](ENGINE, max_batch_size=2, seed=4).scheduler
    sched.reset(Simulator(w, ENGINE, POLICIES["sa"](ENGINE)))
    for app, name in enumerate(w.app_names):
        truth = hist.output_tokens[hist.app == hist.app_names.index(name)]
        assert sched.lengths.count[app] == truth.size
        assert sched.lengths.mean(app) == pytest.approx(truth.mean())
        assert sched.lengths.std(app) == pytest.approx(truth.std())


def test_profiling_slice_of_a_workload_without_a_scenario_is_its_past():
    # a workload that names no scenario (a trace, hand-built requests) has no fresh draw: the slice is its first
    # history_requests requests (Tempo's rule, shared)
    w = Workload.from_requests([Request(0.1 * i, [prefill(50), decode(10 + i)], app="code", ttlt=30.0)
                                for i in range(6)])
    hist = default_history(w, 4, 0)
    assert hist.output_tokens.tolist() == w.output_tokens[:4].tolist()
    pol = POLICIES["sa"](ENGINE, max_batch_size=1, seed=0, history_requests=4)
    Simulator(w, ENGINE, pol).run()
    assert pol.scheduler.profile(w) == history_of(hist)


def test_length_error_varies_true_lengths_within_its_bound():
    # §5.3 (Fig. 9): "actual output lengths with variations of 2.5%, 5%, and 10%" in place of the Gaussian
    w = _sa_mix(40, 2)
    truth = w.output_tokens

    def predicted(**kw):
        pol = POLICIES["sa"](ENGINE, max_batch_size=2, seed=3, predictor="oracle", **kw)
        sim = Simulator(w, ENGINE, pol, attainment="mean_tpot").run()
        return sim.policy.scheduler._pred, sim.result().records

    exact, exact_rec = predicted()
    assert (exact == truth).all()
    for err in (0.025, 0.1):
        varied, rec = predicted(length_error=err)
        assert (np.abs(varied - truth) <= err * truth + 0.5).all()       # within the bound, up to rounding
        assert (varied != truth).mean() > 0.5                             # and actually varied
        assert (predicted(length_error=err)[0] == varied).all()           # seeded
    assert (predicted(length_error=0.0)[1]).equals(exact_rec)             # 0 = exact lengths, same run
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="length_error"):
            POLICIES["sa"](ENGINE, predictor="oracle", length_error=bad)
    with pytest.raises(ValueError, match="length_error"):
        POLICIES["sa"](ENGINE, length_error=0.05)                         # the Gaussian has no true length to vary


def _sa_mix(n: int, seed: int) -> Workload:
    w = make_workload("sa-mix", n_requests=n, seed=seed, engine=ENGINE)
    return w.with_arrivals(np.zeros(len(w)))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_runs_end_to_end_on_sa_mix(name):
    w = make_workload("sa-mix", n_requests=40, rate=2.0, seed=1, engine=ENGINE)
    pol = POLICIES[name](ENGINE, max_batch_size=4, seed=0)
    res = Simulator(w, ENGINE, pol, n_instances=2, attainment="mean_tpot").run().result()
    assert (res.records["outcome"] == "finished").all() and len(res.records) == len(w)
    again = Simulator(w, ENGINE, POLICIES[name](ENGINE, max_batch_size=4, seed=0), n_instances=2,
                      attainment="mean_tpot").run().result()
    assert res.records.equals(again.records)


def test_sa_beats_fcfs_on_constructed_case():
    # a long chat request arrives first; two short code requests with tight e2e SLOs behind it (Fig. 3-5 style)
    # (a first short request keeps the instance busy while the other three queue up)
    reqs = [Request(0.0, [prefill(10), decode(20)], app="code", ttlt=30.0),
            Request(0.001, [prefill(1500, ttft=60.0), decode(600, tpot=0.05)], app="chat"),
            Request(0.002, [prefill(100), decode(100)], app="code", ttlt=4.0),
            Request(0.003, [prefill(100), decode(100)], app="code", ttlt=6.0)]
    w = Workload.from_requests(reqs)
    out = {}
    for name, pol in (("sa", POLICIES["sa"](ENGINE, max_batch_size=1, predictor="oracle")),
                      ("fcfs", make_policy("vllm", ENGINE, max_num_seqs=1))):
        out[name] = Simulator(w, ENGINE, pol, attainment="mean_tpot").run().result().summary["sa_objective"]
    assert out["sa"] > out["fcfs"], out


def test_memory_round_robin_router_follows_eq_20():
    # §4.4, Eq. 20: a request (prompt + predicted output, here the 128-token prior) goes to the instance with the
    # most remaining virtual memory (eta x free KV tokens at the round's start); when none can hold it, a new round
    # resets every instance's remaining memory
    from conftest import ToyEngine

    from slogym.baselines.sa import MemoryRoundRobinRouter

    eng = ToyEngine(a=0.01, b=0.001, c=0.0)
    eng.kv_capacity_tokens, eng.block_size = 1600, 16
    w = Workload.from_requests([Request(0.0, [prefill(p), decode(8)], app="code", ttlt=30.0)
                                for p in (500, 300, 600, 400)])
    sim = Simulator(w, eng, POLICIES["sa"](eng), n_instances=2)
    router = MemoryRoundRobinRouter(eta=0.5, prior_len=128.0)
    router.reset(sim)
    full = 0.5 * sim.instances[0].free_blocks * 16  # both instances empty: 800 tokens each per round
    picks = [router.route(r, sim, 0.0) for r in range(4)]
    # 628 -> 0 (a tie goes to the lower id), 428 -> 1 (800 > 172); 728 fits neither (172, 372): a new round
    # resets both to 800 and it goes to 0; 528 -> 1 (800 > 72)
    assert picks == [0, 1, 0, 1]
    assert router._rem.tolist() == [full - 728, full - 528]

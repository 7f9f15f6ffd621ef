"""Tempo (slogym.baselines.tempo, slogym.workloads.qrf, slogym.workloads.dag): analyzer, LSDF scheduler, variants."""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("quantile_forest")

from slogym.baselines import make_policy  # noqa: E402
from slogym.baselines.common import split_running  # noqa: E402
from slogym.baselines.tempo import POLICIES, TempoScheduler  # noqa: E402
from slogym.core.batch import Batch  # noqa: E402
from slogym.core.instance import Instance  # noqa: E402
from slogym.core.policy import Policy  # noqa: E402
from slogym.core.request import Request, Workload, decode, prefill  # noqa: E402
from slogym.core.simulator import Simulator  # noqa: E402
from slogym.core.state import Outcome  # noqa: E402
from slogym.engines.registry import get_engine  # noqa: E402
from slogym.workloads.dag import GraphHistory, SuperGraph, stage_deadline  # noqa: E402
from slogym.workloads.qrf import QRFConfig, QRFLengthPredictor, request_features  # noqa: E402
from slogym.workloads.scenarios import make_workload  # noqa: E402

ENGINE = get_engine("llama3-8b-h100")
@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOGYM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def history() -> Workload:
    return make_workload("tempo-mix", n_requests=400, seed=11)


def _run(name: str, w: Workload, history: Workload, seed: int = 0, **kw) -> Simulator:
    return Simulator(w, ENGINE, POLICIES[name](ENGINE, history=history, **kw), seed=seed).run()


# ---------------------------------------------------------------------------------------------- service gain
@pytest.fixture(scope="module")
def goodput_run() -> pd.DataFrame:
    """vLLM on tempo-mix with a small KV (queueing, so some SLOs are missed) scored with alpha = inf."""
    eng = copy.copy(ENGINE)
    eng.kv_capacity_tokens = 20_000  # small KV: queueing and preemptions make some requests miss
    w = make_workload("tempo-mix", rate=15.0, n_requests=150, seed=3, engine=eng)
    return Simulator(w, eng, make_policy("vllm", eng), seed=0, sg_alpha=math.inf).run().result().records


def _full_gain(d: pd.DataFrame) -> np.ndarray:
    return (1.0 * d["input_tokens"] + 2.0 * d["output_tokens"]).to_numpy()  # Eq. 1, w_i:w_o = 1:2


def test_service_gain_of_ttlt_requests_reduces_to_goodput_as_alpha_grows(goodput_run: pd.DataFrame) -> None:
    # Eq. 2 with alpha -> inf: the full gain when the (end-to-end) deadline is met, nothing otherwise
    d = goodput_run[np.isfinite(goodput_run["ttlt_slo"])]
    met = d["slo_met"].to_numpy()
    assert met.any() and not met.all()
    np.testing.assert_allclose(d["service_gain"].to_numpy(), np.where(met, _full_gain(d), 0.0))


def test_service_gain_of_latency_sensitive_requests_reduces_to_dslo_goodput(goodput_run: pd.DataFrame) -> None:
    # Eq. 3 with alpha -> inf: full gain exactly when TTFT and every token's deadline line are met (dslo)
    d = goodput_run[~np.isfinite(goodput_run["ttlt_slo"])]
    met = d["slo_met_dslo"].to_numpy()
    assert met.any() and not met.all() and not d["slo_met_dslo"].equals(d["slo_met_strict"])
    full = np.isclose(d["service_gain"].to_numpy(), _full_gain(d), rtol=1e-12)
    np.testing.assert_array_equal(full, met)


def test_service_gain_penalizes_every_token_while_behind_the_line() -> None:
    """§3.1: "If the request is paused or lags behind, such that the actual number of generated tokens falls
    short of the expected length, the service gain of subsequent tokens during that interval is penalized."
    Toy engine, iteration = 0.01 + 0.001 * tokens s. Request 0 (line 0.11 + 0.011 k = its solo token times)
    emits at 0.11 and 0.121; vLLM then runs request 1's 50-token prefill alone (0.121-0.181), so request 0's
    tokens 2-4 come at 0.193, 0.204, 0.215, all behind their lines 0.132, 0.143, 0.154."""
    from conftest import ToyEngine

    eng = ToyEngine(a=0.01, b=0.001, c=0.0)
    w = Workload.from_requests([Request(0.0, [prefill(100, 0.11), decode(5, 0.011)]),
                                Request(0.115, [prefill(50, 0.1), decode(2, 0.02)])])
    sim = Simulator(w, eng, make_policy("vllm", eng), seed=0).run()
    assert sim.rs.last_token[0] == pytest.approx(0.215, rel=1e-9)
    late = sum(line / t for line, t in ((0.132, 0.193), (0.143, 0.204), (0.154, 0.215)))
    assert sim.result().records["service_gain"][0] == pytest.approx(100 + 2 * (2 + late), rel=1e-9)


# ---------------------------------------------------------------------------------------------- DAG matching
def _graph(node: list[float], edge: list[float], time: list[float] | None = None) -> SuperGraph:
    return SuperGraph(np.array(node, float), np.array(edge, float), None if time is None else np.array(time, float))


def test_dag_matching_picks_closest_graph_and_uses_prefixes() -> None:
    h = GraphHistory()
    h.add("tot", _graph([300, 3000], [50, 600], [1, 9]))     # short first stage
    h.add("tot", _graph([3000, 300], [600, 50], [9, 1]))     # long first stage
    h.add("tot", _graph([3100, 280, 500], [580, 60, 90], [8, 1, 2]))  # three stages, long first
    h.add("agent", _graph([300, 3000], [50, 600], [5, 5]))   # other application: never matched for "tot"
    best = h.match("tot", _graph([320], [55]))               # prefix of length 1 against all
    assert best is not None and list(best.time) == [1, 9]
    best = h.match("tot", _graph([2950, 310], [610, 50]))  # two stages: nearer the 2-stage graph than the prefix
    assert list(best.time) == [9, 1]
    best = h.match("tot", _graph([3050, 290, 480], [590, 55, 95]))  # only the 3-stage graph is long enough
    assert list(best.time) == [8, 1, 2]
    assert h.match("tot", _graph([1, 1, 1, 1], [1, 1, 1, 1])) is None
    assert h.match("unknown", _graph([1], [1])) is None


def _chain(group: int, outs: list[int], app: str = "collective_tot") -> list[Request]:
    return [Request(0.0, [prefill(200), decode(o)], app=app, ttlt=60.0, group=group, group_stage=s)
            for s, o in enumerate(outs)]


def test_graph_matching_reads_completed_stages_and_known_inputs_only(history: Workload) -> None:
    # §4.1 / Fig. 7: the N completed stages' outputs (and the inputs known so far) pick the historical graph
    # whose stage N+1 share is used; graphs with no more stages than completed are out; no length bound
    hist = Workload.from_requests(_chain(0, [100, 100, 1000]) + _chain(1, [1000, 1000, 100]) + _chain(2, [990]),
                                  name="graph-history")
    sched = TempoScheduler(history=hist)
    sched.reset(Simulator(Workload.from_requests(_chain(0, [50, 50]), name="live"), ENGINE,
                          Policy(name="t", scheduler=sched), seed=0))
    edge = np.full(2, 200.0)
    short, long_ = sched._match("collective_tot", np.array([105.0]), edge), sched._match(
        "collective_tot", np.array([990.0]), edge)  # the 1-stage graph (990) has no stage 2 to predict
    assert short is not None and long_ is not None and short[2] > short[1] and long_[1] > long_[2]
    assert sched._match("collective_codegen", np.array([105.0]), edge) is None
    # the starting stage's deadline is the same whatever bound the analyzer holds for its requests
    w = make_workload("tempo-mix", n_requests=80, seed=5, engine=ENGINE)
    deadlines = []
    for predictor in ("qrf", "none"):
        s = TempoScheduler(predictor=predictor, history=history)
        sim = Simulator(w, ENGINE, Policy(name="t", scheduler=s), seed=0)
        s.reset(sim)
        sim.rs.ready[:] = w.arrival
        first = [k for k, m in enumerate(s.members) if w.group_stage[m[0]] == 0]
        deadlines.append(s._stage_deadlines(np.array(first)))
    assert len(deadlines[0]) > 3 and np.array_equal(deadlines[0], deadlines[1])
    assert np.all(deadlines[0] < w.arrival[[s.members[k][0] for k in first]] + w.ttlt[[s.members[k][0] for k in first]])


def test_stage_deadline_splits_remaining_budget_by_ratios() -> None:
    ratios = np.array([1.0, 3.0])
    assert stage_deadline(ratios, 0, 0.0, 40.0) == pytest.approx(10.0)
    assert stage_deadline(ratios, 1, 12.0, 40.0) == pytest.approx(40.0)
    assert stage_deadline(ratios, 2, 12.0, 40.0) == 40.0


# ---------------------------------------------------------------------------------------------- QRF
def test_qrf_bound_covers_held_out_lengths_at_its_quantile(history: Workload) -> None:
    train = make_workload("tempo-mix", n_requests=1200, seed=21)
    test = make_workload("tempo-mix", n_requests=600, seed=22)
    p = QRFLengthPredictor.fit(train, QRFConfig(quantiles=(0.5, 0.9)))
    f, y = request_features(test), test.output_tokens
    zero = np.zeros(len(test), np.int64)
    assert abs((y <= p.predict(f, zero, 0.9)).mean() - 0.9) < 0.06
    assert abs((y <= p.predict(f, zero, 0.5)).mean() - 0.5) < 0.08
    # refinement: conditioned on tokens already generated the bound still covers, and it is >= generated + 1
    gen = (np.random.default_rng(0).random(len(test)) * y).astype(np.int64)
    ub = p.predict(f, gen, 0.9)
    assert (ub >= gen + 1).all() and (y <= ub).mean() > 0.84


def test_qrf_is_seeded_and_cached(history: Workload) -> None:
    a = QRFLengthPredictor.fit(history, QRFConfig(seed=3), cache=False)
    b = QRFLengthPredictor.fit(history, QRFConfig(seed=3))
    c = QRFLengthPredictor.fit(history, QRFConfig(seed=3))
    x, g = request_features(history), np.zeros(len(history), np.int64)
    assert np.array_equal(a.predict(x, g, 0.9), b.predict(x, g, 0.9))
    assert c.forest is b.forest


# ---------------------------------------------------------------------------------------------- scheduler
def test_end_to_end_every_request_one_outcome_and_deterministic(history: Workload) -> None:
    w = make_workload("tempo-mix", rate=14.0, n_requests=120, seed=5, engine=ENGINE)
    runs = {}
    for name in POLICIES:
        sim = _run(name, w, history)
        assert (sim.rs.outcome != Outcome.NONE).all(), name
        assert (sim.rs.outcome == Outcome.FINISHED).all(), name
        runs[name] = sim.result()
    again = _run("tempo", w, history).result()
    assert runs["tempo"].records.drop(columns=[]).equals(again.records)
    step = Simulator(w, ENGINE, POLICIES["tempo"](ENGINE, history=history), seed=0, fast_forward=False).run()
    assert step.result().records.equals(runs["tempo"].records)  # steady batches keep fast-forward exact


def test_preemption_quanta_respected(history: Workload) -> None:
    # small KV so that waiting requests regularly find no room and switches are considered
    w = make_workload("tempo-mix", rate=20.0, n_requests=60, seed=2, engine=ENGINE)
    eng = get_engine("llama3-8b-h100")
    eng.kv_capacity_tokens = 12_000
    for quantum in (5, 20):
        pol = POLICIES["tempo"](eng, history=history, quantum=quantum)
        Simulator(w, eng, pol, seed=0).run()
        its = [it for _, it in pol.scheduler.switches]
        assert all(b - a >= quantum for a, b in zip(its, its[1:]))


def test_reserve_prevents_starvation_of_slo_insensitive_requests(history: Workload) -> None:
    # a stream of SLO requests keeps the token budget full; best-effort requests arrive with them
    reqs = [Request(0.02 * i, [prefill(600, ttft=2.0), decode(40, tpot=0.1)], app="latency_sensitive")
            for i in range(150)]
    reqs += [Request(0.5 * i, [prefill(600), decode(40)], app="batch", best_effort=True) for i in range(6)]
    w = Workload.from_requests(reqs, name="reserve-test")

    def be_first_token(reserve: float) -> float:
        sched = TempoScheduler(token_budget=256, max_num_seqs=32, reserve=reserve, history=history)
        sim = Simulator(w, ENGINE, Policy("tempo", sched), seed=0).run()
        assert (sim.rs.outcome != Outcome.NONE).all()
        return float(np.max(sim.rs.first_token[w.best_effort] - w.arrival[w.best_effort]))

    with_reserve, without = be_first_token(0.1), be_first_token(0.0)
    assert with_reserve < without
    assert with_reserve < 1.0


def test_running_decodes_go_first_every_iteration(history: Workload) -> None:
    # vLLM's chunked-prefill substrate (§5): LSDF orders admission and eviction, never skips a running decode
    w = make_workload("tempo-mix", rate=30.0, n_requests=80, seed=4, engine=ENGINE)
    pol = POLICIES["tempo"](ENGINE, history=history)
    sched = pol.scheduler
    inner = sched.next_batch
    checked = []

    def checking(inst: Instance, now: float) -> Batch | None:
        dec = set(split_running(inst)[0].tolist())
        b = inner(inst, now)
        if b is not None:
            skipped = dec - set(b.req.tolist()) - set(b.preempt)
            checked.append((len(dec), bool(np.any(b.tokens > 1))))
            assert not skipped, f"running decodes {sorted(skipped)} left out at t={now}"
        return b

    sched.next_batch = checking
    Simulator(w, ENGINE, pol, seed=0, fast_forward=False).run()
    assert any(n > 0 and mixed for n, mixed in checked)  # decodes did share batches with prefill chunks


def _priorities(name: str, w: Workload, history: Workload, now: float, ready: float = 0.0,
                tau: float = 0.02, **kw) -> tuple[np.ndarray, TempoScheduler]:
    """Priorities of the requests of ``w`` (prompts not started, nothing generated) as seen at ``now``."""
    pol = POLICIES[name](ENGINE, history=history, **kw)
    sim = Simulator(w, ENGINE, pol, seed=0)
    pol.reset(sim)
    sched, inst, rs = pol.scheduler, sim.instances[0], sim.rs
    idx = np.flatnonzero(w.group_stage == 0)
    rs.ready[idx] = ready
    rs.num_tokens[idx] = w.input_tokens[idx]
    inst.last_dt = tau
    return sched.priority(idx, inst, now), sched


def test_density_is_projected_gain_over_remaining_process_time(history: Workload) -> None:
    # Eq. 4 / Alg. 1 line 16: gain over remaining process time T; the deadline only decays a projected miss
    tau, wi, wo = 0.02, 1.0, 2.0
    reqs = [Request(0.0, [prefill(100), decode(200)], app="throughput_intensive", ttlt=ttlt)
            for ttlt in (20.0, 60.0, 3.0)]
    w = Workload.from_requests(reqs, name="density-test")
    t_rem = 1 * tau + 200 * tau  # one prefill chunk, 200 decode steps (true length: tempo-precise)
    gain = wi * 100 + wo * 200
    early, _ = _priorities("tempo-precise", w, history, now=0.0, tau=tau)
    assert early[0] == pytest.approx(gain / t_rem) and early[1] == pytest.approx(early[0])  # slack: no urgency
    assert early[2] == pytest.approx(gain * 3.0 / t_rem / t_rem)  # projected TTLT 4.02 s > 3 s: f = 3 / 4.02
    late, _ = _priorities("tempo-precise", w, history, now=18.0, tau=tau)
    assert late[0] == pytest.approx(gain * (20.0 / (18.0 + t_rem)) / t_rem)  # decays once a miss is projected
    assert late[1] == pytest.approx(early[1])


def test_collective_calls_take_the_max_remaining_time_of_their_stage(history: Workload) -> None:
    # Alg. 1 lines 17-18: a stage's calls share its slowest call's remaining time, so the short call's density is
    # its own gain over the long call's time (its early finish does not end the stage); stage 1 is not released
    tau, wi, wo = 0.02, 1.0, 2.0
    reqs = [Request(0.0, [prefill(200), decode(o)], app="collective_tot", ttlt=1000.0, group=0, group_stage=s)
            for s, o in ((0, 100), (0, 1000), (1, 50))]
    w = Workload.from_requests(reqs, name="stage-test")
    p, _ = _priorities("tempo-precise", w, history, now=0.0, tau=tau)
    t_stage = tau + 1000 * tau  # one prefill chunk + the long call's 1000 decode steps; f = 1 (ample deadline)
    assert p == pytest.approx([(wi * 200 + wo * 100) / t_stage, (wi * 200 + wo * 1000) / t_stage])


def test_fairness_blends_density_with_the_least_served_application(history: Workload) -> None:
    # §4.3: priority = (1 - f) * density (normalized by the top one) + f * fair, fair = 1 - served / most served
    reqs = [Request(0.0, [prefill(100), decode(200)], app=a, ttlt=20.0) for a in ("chat", "summary", "chat")]
    w = Workload.from_requests(reqs, name="fairness-test")
    dens, _ = _priorities("tempo-precise", w, history, now=0.0)
    served = np.zeros(len(w.app_names))
    served[w.app_names.index("chat")] = 300.0
    served[w.app_names.index("summary")] = 100.0
    for f in (0.5, 1.0):
        pol = POLICIES["tempo-precise"](ENGINE, history=history, fairness=f)
        sim = Simulator(w, ENGINE, pol, seed=0)
        pol.reset(sim)
        pol.scheduler.served[:] = served
        sim.rs.num_tokens[:] = w.input_tokens
        sim.instances[0].last_dt = 0.02
        p = pol.scheduler.priority(np.arange(3), sim.instances[0], 0.0)
        fair = 1.0 - served[w.app] / 300.0
        assert p == pytest.approx((1 - f) * dens / dens.max() + f * fair)
    assert p[1] > p[0] == p[2]  # fairness alone: the less served application first


def test_latency_sensitive_prompt_outranks_throughput_request_and_decays_after_its_ttft(history: Workload) -> None:
    # Eq. 3's TTFT term: the prompt's gain over its prefill time; a prompt past its TTFT deadline decays
    reqs = [Request(0.0, [prefill(100, ttft=2.0), decode(200, tpot=0.1)], app="latency_sensitive"),
            Request(0.0, [prefill(100), decode(200)], app="throughput_intensive", ttlt=20.0)]
    w = Workload.from_requests(reqs, name="density-test")
    fresh, _ = _priorities("tempo-precise", w, history, now=0.0)
    assert fresh[0] > 10 * fresh[1]
    stale, _ = _priorities("tempo-precise", w, history, now=4.0)
    assert stale[0] < 0.6 * fresh[0]


def test_only_tempo_precise_reads_true_output_lengths(history: Workload) -> None:
    # the QRF, no-predictor, no-graph and SJF variants must rank identical prompts identically whatever the
    # (unknown) output lengths; Tempo-Precise is told them (Fig. 12, 15)
    def workload(outs: list[int]) -> Workload:
        reqs = [Request(0.0, [prefill(120, ttft=2.0), decode(outs[0], tpot=0.1)], app="latency_sensitive"),
                Request(0.0, [prefill(300), decode(outs[1])], app="throughput_intensive", ttlt=20.0)]
        reqs += [Request(0.0, [prefill(400), decode(o)], app="collective_tot", ttlt=40.0, group=0,
                         group_stage=s) for s, o in ((0, outs[2]), (0, outs[3]), (1, 50), (1, 50))]
        return Workload.from_requests(reqs, name="leak-test")

    short, long_ = workload([20, 30, 40, 60]), workload([900, 1000, 1500, 1200])
    for name in POLICIES:
        a, _ = _priorities(name, short, history, now=1.0)
        b, _ = _priorities(name, long_, history, now=1.0)
        assert np.array_equal(a, b) != (name == "tempo-precise"), name


def test_no_predictor_bound_is_one_history_quantile_raised_past_generation(history: Workload) -> None:
    # Fig. 15 ablation: the model goes, §4.1's conservative bound stays -- every request gets the history-wide
    # length quantile at Tempo's own level (the mean with predictor="mean"), lifted once generation passes it
    reqs = [Request(0.0, [prefill(p), decode(900)], app=a, ttlt=20.0)
            for p, a in ((20, "throughput_intensive"), (800, "collective_tot"), (300, "latency_sensitive"))]
    w = Workload.from_requests(reqs, name="flat-bound-test")
    for predictor, level in (("none", np.quantile(history.output_tokens, 0.9)),
                             ("mean", history.output_tokens.mean())):
        sched = TempoScheduler(predictor=predictor, quantile=0.9, refresh_tokens=64, history=history)
        sim = Simulator(w, ENGINE, Policy(name="t", scheduler=sched), seed=0)
        sched.reset(sim)
        idx = np.arange(3)
        assert np.allclose(sched.upper_bound(idx), level), predictor
        sim.rs.generated[0] = int(level) + 10
        ub = sched.upper_bound(idx)
        assert ub[0] == int(level) + 10 + 64 and np.allclose(ub[1:], level), predictor


def test_invalid_parameters_raise() -> None:
    with pytest.raises(ValueError, match="predictor"):
        TempoScheduler(predictor="bert")
    with pytest.raises(ValueError, match="quantum"):
        TempoScheduler(quantum=0)

"""Live vLLM backend: end-to-end runs on a tiny random-weight model, batch control, accounting, faults, profiling.

Every test here needs a Python with vLLM (``make vllm-venv`` builds ``.venv-vllm``; ``$SLOGYM_VLLM_PYTHON`` points
elsewhere) and skips with that reason otherwise. Engines are few and small: one shared engine for the runs that
leave it empty, one fresh engine per fault test (a fault leaves its engine dead on purpose).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from slogym.baselines import make_policy
from slogym.core.batch import Batch, BatchFeatures
from slogym.core.errors import EngineError
from slogym.core.policy import Policy, Scheduler
from slogym.core.request import Request, Workload, decode, external, prefill
from slogym.core.simulator import Simulator
from slogym.engines.live import (EngineConfig, LiveSimulator, UnsupportedOnLiveEngine, VLLMEngine, live_spec,
                                 make_tiny_model, vllm_unavailable_reason)

from helpers import SpecScheduler, expected_compute

REASON = vllm_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def chat_workload(n: int, seed: int, gap: float = 0.01, max_prompt: int = 200, max_out: int = 24,
                  priority: bool = False) -> Workload:
    rng = np.random.default_rng(seed)
    prio = rng.permutation(n) if priority else np.zeros(n, np.int64)
    return Workload.from_requests([
        Request(i * gap, [prefill(int(rng.integers(8, max_prompt)), 1.0), decode(int(rng.integers(1, max_out)), 0.1)],
                priority=int(prio[i]))
        for i in range(n)])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama"))


def config(model: str, **kw: Any) -> EngineConfig:
    base = dict(model=model, num_blocks=48, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1024)
    return EngineConfig(**(base | kw))


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Any:
    with VLLMEngine(config(model_dir, timing="norm")) as eng:
        yield eng


def run_live(engine: VLLMEngine, w: Workload, policy: Policy, **kw: Any) -> LiveSimulator:
    sim = LiveSimulator(w, engine, policy, **kw).run()
    # the run left nothing resident in the engine
    assert engine.abort([]) == engine.config.num_blocks
    return sim


# ---------------------------------------------------------------------------------------------- end to end
def test_fcfs_20_requests_end_to_end(engine: VLLMEngine) -> None:
    w = chat_workload(20, seed=1)
    spec = live_spec(engine.config)
    sim = run_live(engine, w, make_policy("vllm", engine=spec))
    rec = sim.result().records
    assert (rec["outcome"] == "finished").all()
    assert (rec["generated_tokens"] == w.output_tokens).all()
    # nothing preempted: every token computed exactly once (vLLM v1 semantics, helpers.expected_compute)
    if (rec["n_preemptions"] == 0).all():
        assert (rec["computed_tokens"] == expected_compute(w)).all()
    assert (rec["ttft"] > 0).all() and (rec["ttlt"] >= rec["ttft"]).all()
    # per-request records have exactly the simulator's schema
    ref = Simulator(w, spec, make_policy("vllm", engine=spec)).run().result().records
    assert list(rec.columns) == list(ref.columns)
    assert (rec.dtypes == ref.dtypes).all()
    it = sim.iteration_records()
    assert len(it) == sum(i.iterations for i in sim.instances) and (it["time_s"] > 0).all()
    assert (it["nivcsw"] >= 0).all() and (it["minflt"] >= 0).all()  # the worker reports what the host did
    assert it["prefill_tokens"].sum() + it["decode_tokens"].sum() == rec["computed_tokens"].sum()


def test_real_time_clock_waits_for_arrivals(engine: VLLMEngine) -> None:
    w = chat_workload(4, seed=2, gap=0.15, max_out=4)
    t0 = time.perf_counter()
    sim = run_live(engine, w, make_policy("sarathi", engine=live_spec(engine.config)), clock="real")
    wall = time.perf_counter() - t0
    rec = sim.result().records
    assert (rec["outcome"] == "finished").all()
    # real time: the last request cannot be served before it arrives on the wall clock, and the simulated
    # clock (anchored to the wall clock at the start) never runs ahead of it
    assert wall >= float(w.arrival[-1])
    assert sim.end_time <= wall


# ---------------------------------------------------------------------------------------------- batch control
class StrictPriority(Scheduler):
    """One request per iteration: the resident one with the highest priority, in prefill chunks of 32 tokens."""

    def next_batch(self, inst: Any, now: float) -> Batch | None:
        cands = inst.running + inst.waiting
        if not cands:
            return None
        prio = inst.sim.w.priority
        r = max(cands, key=lambda q: (prio[q], -q))
        n = int(min(inst.remaining([r])[0], 32))
        return Batch(req=np.array([r]), tokens=np.array([n]))


def test_policy_batch_order_is_honored(engine: VLLMEngine) -> None:
    w = chat_workload(6, seed=3, gap=0.0, max_out=4, priority=True)
    sim = run_live(engine, w, Policy("prio", StrictPriority()))
    rec = sim.result().records
    assert (rec["outcome"] == "finished").all()
    order = rec.sort_values("ttlt")["priority"].to_numpy()
    assert (np.diff(order) < 0).all(), f"finish order by priority: {order}"
    it = sim.iteration_records()
    assert ((it["prefill_seqs"] + it["decode_seqs"]) == 1).all()
    assert (it["prefill_tokens"] <= 32).all()


class Disrupt(Scheduler):
    """Wraps a scheduler: once, preempt (recompute) the newest running request; later, drop the oldest one."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner

    def reset(self, sim: Any) -> None:
        self.inner.reset(sim)
        self.preempted: int | None = None
        self.dropped: int | None = None

    def next_batch(self, inst: Any, now: float) -> Batch | None:
        b = self.inner.next_batch(inst, now)
        if b is None or b.preempt or b.drop or len(inst.running) < 3:
            return b
        if self.preempted is None:
            self.preempted = victim = inst.running[-1]
            return self._without(b, victim, preempt=(victim,))
        if self.dropped is None and inst.running[0] != self.preempted:
            self.dropped = victim = inst.running[0]
            return self._without(b, victim, drop=(victim,))
        return b

    @staticmethod
    def _without(b: Batch, r: int, **side: Any) -> Batch:
        keep = np.asarray(b.req) != r
        return Batch(req=np.asarray(b.req)[keep], tokens=np.asarray(b.tokens)[keep], **side)


def test_preempt_and_abort_keep_accounting_exact(engine: VLLMEngine) -> None:
    w = chat_workload(10, seed=4, gap=0.0, max_out=30)
    spec = live_spec(engine.config)
    sched = Disrupt(make_policy("sarathi", engine=spec).scheduler)
    sim = run_live(engine, w, Policy("disrupt", sched))
    rec = sim.result().records
    assert sched.preempted is not None and sched.dropped is not None
    assert rec.loc[sched.dropped, "outcome"] == "dropped"
    assert (rec.drop(index=sched.dropped)["outcome"] == "finished").all()
    p = rec.loc[sched.preempted]
    assert p["n_preemptions"] >= 1 and p["recomputed_tokens"] > 0
    fin = rec["outcome"] == "finished"
    # every finished request computed each token once, plus exactly what preemption threw away
    assert (rec.loc[fin, "computed_tokens"] == expected_compute(w)[fin] + rec.loc[fin, "recomputed_tokens"]).all()
    assert (rec.loc[fin, "generated_tokens"] == w.output_tokens[fin]).all()


# ---------------------------------------------------------------------------------------------- unsupported
def test_unsupported_decisions_raise_clear_errors(engine: VLLMEngine) -> None:
    w = chat_workload(3, seed=5, max_out=6)
    spec = live_spec(engine.config)
    with pytest.raises(UnsupportedOnLiveEngine, match="speculative"):
        LiveSimulator(w, engine, Policy("spec", SpecScheduler(make_policy("vllm", engine=spec).scheduler, 2))).run()
    engine.abort(list(range(len(w))))
    tool = Workload.from_requests([Request(0.0, [prefill(10), decode(3), external(0.1), prefill(5), decode(2)])])
    with pytest.raises(UnsupportedOnLiveEngine, match="tool call"):
        LiveSimulator(tool, engine, make_policy("vllm", engine=spec))
    long = Workload.from_requests([Request(0.0, [prefill(1000), decode(100)])])
    with pytest.raises(UnsupportedOnLiveEngine, match="max_model_len"):
        LiveSimulator(long, engine, make_policy("vllm", engine=spec))


# ---------------------------------------------------------------------------------------------- faults
class FaultAt(Scheduler):
    """Wraps a scheduler and calls ``fault`` at its ``n``-th decision (SIGKILL the engine, raise an exception)."""

    def __init__(self, inner: Scheduler, n: int, fault: Callable[[], None]) -> None:
        self.inner, self.n, self.fault = inner, n, fault

    def reset(self, sim: Any) -> None:
        self.inner.reset(sim)
        self.calls = 0

    def next_batch(self, inst: Any, now: float) -> Batch | None:
        self.calls += 1
        if self.calls == self.n:
            self.fault()
        return self.inner.next_batch(inst, now)


def kill_at(inner: Scheduler, pid: int, n: int) -> FaultAt:
    return FaultAt(inner, n, lambda: os.kill(pid, signal.SIGKILL))


def raise_at(inner: Scheduler, exc: BaseException, n: int) -> FaultAt:
    def fault() -> None:
        raise exc

    return FaultAt(inner, n, fault)


def test_killed_engine_raises_engine_error_and_fails_requests(model_dir: str) -> None:
    w = chat_workload(12, seed=6)
    with VLLMEngine(config(model_dir, step_timeout=30.0)) as eng:
        spec = live_spec(eng.config)
        sim = LiveSimulator(w, eng, Policy("kill", kill_at(make_policy("vllm", engine=spec).scheduler, eng.pid, 6)))
        with pytest.raises(EngineError, match="died|gone") as info:
            sim.run()
        assert eng.closed
    msg = str(info.value)
    if "died" in msg:  # the reply pipe closed: the process was reaped before the message was written
        assert "killed by signal 9" in msg
    log = re.search(r"engine log \((\S+)\)", msg)
    if log is not None:  # the log the message names outlives close()
        assert Path(log.group(1)).exists()
        Path(log.group(1)).unlink()
    rec = info.value.result.records
    assert set(rec["outcome"]) <= {"finished", "failed"}
    assert (rec["outcome"] == "failed").sum() >= 1
    assert len(rec) == len(w)
    # KV released for every failed request: the simulator's pool is whole again
    assert all(i.free_blocks == i.total_blocks for i in sim.instances)


@pytest.mark.parametrize("exc", [ValueError("policy bug"), KeyboardInterrupt()], ids=["ValueError", "Ctrl-C"])
def test_any_exception_mid_run_fails_requests_and_frees_the_engine(engine: VLLMEngine, exc: BaseException) -> None:
    w = chat_workload(12, seed=8, gap=0.0, max_out=20)
    spec = live_spec(engine.config)
    sim = LiveSimulator(w, engine, Policy("raise", raise_at(make_policy("sarathi", engine=spec).scheduler, exc, 5)))
    with pytest.raises(type(exc)) as info:
        sim.run()
    rec = info.value.result.records
    assert len(rec) == len(w) and (rec["outcome"] == "failed").sum() >= 1
    assert set(rec["outcome"]) <= {"finished", "failed"} and sim.error is not None
    assert all(i.free_blocks == i.total_blocks for i in sim.instances)
    # nothing of the run is left in the engine, which serves the next run
    assert not engine.closed and engine.abort([]) == engine.config.num_blocks
    run_live(engine, chat_workload(4, seed=9, max_out=4), make_policy("sarathi", engine=spec))


def test_batch_over_the_engine_limit_is_refused_and_cleaned_up(engine: VLLMEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's policy admits a prompt longer than the token budget alone (a stated deviation); the live engine
    # cannot run it. The shared engine's budget equals its max_model_len, so the run sees a smaller budget.
    cfg = engine.config
    monkeypatch.setattr(cfg, "max_num_batched_tokens", 512)
    w = Workload.from_requests([Request(0.0, [prefill(100), decode(20)]), Request(0.001, [prefill(700), decode(10)]),
                                Request(0.002, [prefill(100), decode(20)])])
    with pytest.raises(UnsupportedOnLiveEngine, match="max_num_batched_tokens=512") as info:
        LiveSimulator(w, engine, make_policy("vllm", engine=live_spec(cfg))).run()
    assert (info.value.result.records["outcome"] == "failed").sum() >= 2
    assert engine.abort([]) == cfg.num_blocks  # the first request's KV was released in the engine too


def test_a_run_starts_from_an_empty_engine(engine: VLLMEngine) -> None:
    # what an abandoned run left behind (an agent-driven episode whose generator was not closed yet): request 0
    # holds KV, and the next run's request 0 is a different request with the same id
    engine.step([(0, 64, 0, 64)], add=[(0, 64, 5)])
    assert engine.abort([]) < engine.config.num_blocks
    w = chat_workload(6, seed=12, max_out=6)
    sim = run_live(engine, w, make_policy("sarathi", engine=live_spec(engine.config)))
    assert (sim.result().records["outcome"] == "finished").all() and engine.owner is sim


def test_interrupt_while_waiting_for_a_reply_closes_the_engine(model_dir: str) -> None:
    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with VLLMEngine(config(model_dir)) as eng:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(KeyboardInterrupt):
                eng.step([(0, 8, 0, 8)], add=[(0, 8, 2)], hang=3.0)
            # the reply is still on its way: reading it as the next call's answer would be wrong
            assert eng.closed and eng.proc.poll() is not None
            with pytest.raises(EngineError, match="closed"):
                eng.abort([])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_surviving_engines_release_the_failed_requests(model_dir: str) -> None:
    w = chat_workload(30, seed=10, gap=0.003, max_out=60)
    with VLLMEngine(config(model_dir, step_timeout=30.0)) as e0, VLLMEngine(config(model_dir, step_timeout=30.0)) as e1:
        spec = live_spec(e0.config)
        base = make_policy("sarathi", engine=spec)
        pol = Policy("kill1", kill_at(base.scheduler, e1.pid, 40), router=base.router)
        with pytest.raises(EngineError) as info:
            LiveSimulator(w, [e0, e1], pol).run()
        rec = info.value.result.records
        assert e1.closed and not e0.closed
        assert (rec.loc[rec["instance"] == 0, "outcome"] == "failed").any()  # engine 0 held some of them
        assert e0.abort([]) == e0.config.num_blocks


class SlowReset(Scheduler):
    """Wraps a scheduler; its reset takes a while (set-up, JIT compilation) and records who it was reset for."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.resets: list[tuple[bool, float]] = []

    def reset(self, sim: Any) -> None:
        time.sleep(0.3)
        self.inner.reset(sim)
        self.resets.append((sim.live, time.perf_counter()))

    def next_batch(self, inst: Any, now: float) -> Batch | None:
        return self.inner.next_batch(inst, now)


def test_real_clock_starts_after_reset_and_a_simulated_warm_up(engine: VLLMEngine) -> None:
    w = chat_workload(3, seed=11, gap=0.05, max_out=4)
    sched = SlowReset(make_policy("sarathi", engine=live_spec(engine.config)).scheduler)
    steps = engine.iterations
    sim = run_live(engine, w, Policy("slow", sched), clock="real")
    # first a simulated warm-up run (no engine steps), then the live run, whose clock starts after its reset
    assert [live for live, _ in sched.resets] == [False, True]
    assert sim._t0 >= sched.resets[-1][1] and sim.warmup_seconds > 0
    assert engine.iterations - steps == len(sim.iteration_records())


def test_failed_tiny_model_build_is_one_line(tmp_path: Any) -> None:
    with pytest.raises(EngineError, match="head_dim must be an integer >= 32") as info:
        make_tiny_model(tmp_path / "bad", hidden=100, heads=4)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)


def test_hung_step_times_out(model_dir: str) -> None:
    with VLLMEngine(config(model_dir, step_timeout=3.0)) as eng:
        with pytest.raises(EngineError, match="timed out after 3 s"):
            eng.step([(0, 8, 0, 8)], add=[(0, 8, 2)], hang=60.0)
        assert eng.closed and eng.proc.poll() is not None  # the hung process was killed, not left behind
        with pytest.raises(EngineError, match="closed"):
            eng.step([(0, 1, 8, 9)])


def test_engine_exception_is_engine_error(model_dir: str) -> None:
    with VLLMEngine(config(model_dir)) as eng:
        # a plan whose token counts disagree with the engine's ledger
        with pytest.raises(EngineError, match="engine has 0 computed of 8 tokens, planner 5 of 8"):
            eng.step([(0, 3, 5, 8)], add=[(0, 8, 2)])
        assert eng.closed


# ------------------------------------------------------------------------------------------ profile -> fit -> simulate
def test_profile_fit_simulate(engine: VLLMEngine, tmp_path: Any) -> None:
    from slogym.engines.fitting import fit_profile
    from slogym.engines.base import EngineSpec
    from slogym.engines.profiler import ProfileGrid, profile

    grid = ProfileGrid(prefill=[(1, 16), (2, 64), (1, 256), (4, 128)], decode=[(1, 32), (4, 64), (8, 128)],
                       mixed=[(4, 64, 128, 0), (2, 32, 64, 128)])
    with pytest.raises(ValueError, match="measure=2"):
        profile(engine, grid, measure=2)
    df = profile(engine, grid, repeats=2, warmup=1, measure=3)
    assert engine.abort([]) == engine.config.num_blocks
    assert len(df) == 2 * len(grid) and (df["time_s"] > 0).all()
    # norm timing: each row's time is its median-time step's raw CPU time x the factor
    assert (df["cpu_s"] > 0).all() and (df["speed"] > 0).all()
    assert np.allclose(df["time_s"], df["cpu_s"] * df["speed"], rtol=1e-9)
    assert set(df["kind"]) == {"prefill", "decode", "mixed"}
    pre = df[df["kind"] == "prefill"]
    assert sorted(pre["prefill_tokens"]) == sorted(np.repeat([16, 128, 256, 512], 2))
    dec = df[df["kind"] == "decode"]
    assert sorted(dec["decode_seqs"]) == sorted(np.repeat([1, 4, 8], 2))
    assert (dec["prefill_tokens"] == 0).all() and (pre["decode_seqs"] == 0).all()
    mix = df[df["kind"] == "mixed"]
    # a continuation chunk attends to its past: chunk * (past + chunk) token pairs
    assert sorted(mix["prefill_attn"]) == sorted([128 * 128] * 2 + [64 * (128 + 64)] * 2)
    path = tmp_path / "records.csv"
    df.to_csv(path, index=False)
    preset = fit_profile(path, "quadratic", kv_capacity_tokens=engine.config.num_blocks * engine.config.block_size,
                         holdout=0.0)
    spec = EngineSpec.from_dict(preset | {"block_size": engine.config.block_size})
    w = chat_workload(15, seed=7)
    res = Simulator(w, spec, make_policy("sarathi", engine=spec)).run().result()
    assert (res.records["outcome"] == "finished").all()
    assert res.summary["attainment"] >= 0.0


def test_profile_measures_each_batch_after_a_decode_step(engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step before a measured prefill is a one-token decode of a request outside the batch; before a measured
    mixed batch, its decode batch alone (first chunks) or with the prompt's first chunk (continuations)."""
    from slogym.engines.profiler import ProfileGrid, profile

    plans: list[list[tuple[int, int, int, int]]] = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda plan, **kw: plans.append(list(plan)) or step(plan, **kw))
    grid = ProfileGrid(prefill=[(2, 16)], mixed=[(2, 32, 16, 0), (2, 32, 16, 32)])
    df = profile(engine, grid, repeats=1, warmup=1, measure=1)
    assert len(df) == 3 and engine.abort([]) == engine.config.num_blocks
    prefills = [k for k, p in enumerate(plans) if [(n, nc) for _, n, nc, _ in p] == [(16, 0), (16, 0)]]
    assert len(prefills) == 2  # warm-up + measured
    for k in prefills:
        (rid, n, nc, _), = plans[k - 1]
        assert n == 1 and nc > 0 and rid not in {r for r, *_ in plans[k]}
    mixed = [k for k, p in enumerate(plans) if len(p) == 3 and p[-1][1] == 16]
    assert len(mixed) == 4
    for k in mixed:
        decodes, (chunk_rid, _, past, _) = plans[k][:2], plans[k][2]
        before = plans[k - 1]
        assert [(r, n) for r, n, *_ in before[:2]] == [(r, 1) for r, *_ in decodes]
        assert before[2:] == ([] if past == 0 else [(chunk_rid, 32, 0, 49)])


def test_norm_timing_and_noise_floor(engine: VLLMEngine) -> None:
    from slogym.engines.profiler import repeat_noise

    assert engine.config.timing == "norm"
    rid = 10**6
    reply = engine.step([(rid, 16, 0, 16)], add=[(rid, 16, 2)])
    assert reply["speed"] > 0 and reply["cpu_s"] > 0
    assert engine.duration(reply) == pytest.approx(reply["cpu_s"] * reply["speed"])
    engine.config.norm_elasticity, engine.config.norm_preempt = {"prefill": 0.5}, {"decode": 0.2}
    try:
        assert engine.duration(reply, "prefill") == pytest.approx(reply["cpu_s"] * reply["speed"] ** 0.5)
        late = reply | {"time_s": 2.0 * reply["cpu_s"]}  # descheduled for half the step
        assert engine.duration(late, "decode") == pytest.approx(reply["cpu_s"] * reply["speed"] * 2.0 ** -0.2)
        assert engine.duration(late, "mixed") == pytest.approx(reply["cpu_s"] * reply["speed"])
    finally:
        engine.config.norm_elasticity, engine.config.norm_preempt = {}, {}
    engine.abort([rid])
    noise = repeat_noise(engine, n=5, batch=2, context=32, chunk=16)
    assert set(noise) == {"prefill", "decode", "mixed"} and all(np.isfinite(v) and v >= 0 for v in noise.values())
    assert engine.abort([]) == engine.config.num_blocks


def test_profile_visit_median_keeps_features_fixed() -> None:
    from slogym.engines.profiler import _median_step

    feats = [BatchFeatures.build(decode_seqs=2, decode_tokens=2, decode_ctx=c) for c in (40, 42, 44)]
    t, f, raw = _median_step(list(zip([3.0, 1.0, 2.5], feats)), [(1.0, 3.0), (0.5, 2.0), (2.0, 1.25)])
    # the median time, but the middle iteration's features (not the median iteration's): a composition measured
    # in several passes must aggregate into one row whatever its timing noise
    assert t == 2.5 and f is feats[1]
    assert raw == {"cpu_s": 2.0, "speed": 1.25}  # the raw CPU time and norm factor of the median-time step


def test_speed_reference_freezes_its_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    from slogym.engines.live.worker import SpeedReference

    ref = SpeedReference(calibrate=3, window=2)
    times = iter([1.0, 3.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 8.0])
    monkeypatch.setattr(ref, "_kernel", lambda: next(times))
    ref.sample()
    ref.sample()
    # running median of [1, 3] = 2 over the samples' geometric mean sqrt(3)
    assert ref.typical is None and ref.factor() == pytest.approx(2.0 / 3 ** 0.5)
    for _ in range(4):
        ref.sample()
    assert ref.typical == 2.0  # median of the first 3 steps' 6 samples, then frozen
    ref.sample()
    ref.sample()
    assert ref.factor() == 0.5  # the kernel runs twice as slow around this step: its CPU time counts half
    ref.sample()
    assert ref.typical == 2.0 and ref.factor() == pytest.approx(2.0 / 32 ** 0.5)


def test_cli_profile_run_fit_simulate(model_dir: str, tmp_path: Any, capsys: Any) -> None:
    import json

    from slogym.cli import main

    csv, preset = tmp_path / "tiny.csv", tmp_path / "tiny.json"
    rc = main(["profile", "run", "--engine", "vllm", "--model", model_dir, "--out", str(csv), "--quick",
               "--repeats", "1", "--warmup", "0", "--blocks", "16", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "128", "--max-model-len", "256", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["rows"] == report["points"] > 0 and csv.exists()
    assert json.loads(Path(report["limits"]).read_text())["max_num_batched_tokens"] == 128
    # the preset carries the profiled engine's KV pool and limits (from the sidecar: no --kv-tokens needed)
    assert main(["profile", "fit", str(csv), "--family", "quadratic", "--holdout", "0", "--out", str(preset)]) == 0
    capsys.readouterr()
    fitted = json.loads(preset.read_text())
    assert (fitted["kv_capacity_tokens"], fitted["block_size"], fitted["max_num_seqs"],
            fitted["max_num_batched_tokens"]) == (512, 32, 4, 128)
    assert main(["simulate", "--engine", str(preset), "--requests", "20", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["n_requests"] == 20

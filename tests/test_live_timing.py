"""Live engine timing: what an iteration's measured time covers, the speed reference's shapes, the fidelity
script's model configs.

The engine tests need a Python with vLLM (``make vllm-venv``) and skip otherwise; the others run anywhere.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest

from slogym.engines.live import EngineConfig, VLLMEngine, make_tiny_model, vllm_unavailable_reason
from slogym.engines.live.client import model_hidden
from slogym.engines.live.worker import SpeedReference, Worker

REASON = vllm_unavailable_reason()
needs_vllm = pytest.mark.skipif(REASON is not None, reason=REASON or "")
ROOT = Path(__file__).resolve().parents[1]


def _fidelity_module() -> Any:
    spec = importlib.util.spec_from_file_location("fidelity_script", ROOT / "scripts" / "fidelity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_model_hidden_reads_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 384}))
    assert model_hidden(tmp_path) == 384
    assert model_hidden(tmp_path / "missing") == 128
    (tmp_path / "config.json").write_text("{}")
    assert model_hidden(tmp_path, default=64) == 64


def test_speed_reference_is_shaped_like_the_model_layers() -> None:
    ref = SpeedReference(calibrate=1, hidden=256)
    assert [tuple(w.shape) for w in ref._w] == [(256, 768), (256, 256), (256, 1024), (512, 256)]
    assert all(x.shape == (16, w.shape[0]) for x, w in zip(ref._x, ref._w))
    ref.sample()
    ref.sample()
    assert ref.typical is not None and ref.factor() > 0


def test_speed_reference_repeats_the_kernel_and_averages_over_the_previous_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref = SpeedReference(calibrate=1, window=4, hidden=128, reps=3)
    calls: list[int] = []
    monkeypatch.setattr(ref, "_mm", lambda x, w: calls.append(1))
    ref._kernel()
    assert len(calls) == 3 * 4  # reps passes over one layer's four GEMMs
    times = iter([2.0, 2.0, 4.0, 4.0, 4.0, 4.0])
    monkeypatch.setattr(ref, "_kernel", lambda: next(times))
    ref.sample()
    ref.sample()
    assert ref.typical == 2.0 and ref.factor() == 1.0  # calibrated on the first step's two samples
    ref.sample()
    ref.sample()
    assert ref.factor() == pytest.approx(2.0 / 8 ** 0.5)  # geometric mean; the previous step's samples count
    ref.sample()
    ref.sample()
    assert ref.factor() == 0.5


@pytest.mark.parametrize("kw", [{"window": 1}, {"reps": 0}, {"calibrate": 0}])
def test_speed_reference_rejects_bad_parameters(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        SpeedReference(**kw)
    if "calibrate" not in kw:
        with pytest.raises(ValueError, match=f"ref_{next(iter(kw))}"):
            EngineConfig(model="m", **{f"ref_{k}": v for k, v in kw.items()})


def test_executor_timer_accumulates_and_passes_results_through() -> None:
    w = Worker.__new__(Worker)  # only the timer; no engine
    w.exec_s = [0.0, 0.0]

    def busy(x: int, y: int = 0) -> int:
        t = time.thread_time()
        while time.thread_time() - t < 0.01:
            pass
        return x + y

    timed = w._timed(busy)
    assert timed(2, y=3) == 5
    assert timed(1) == 1
    assert w.exec_s[1] >= 0.02 and w.exec_s[0] >= w.exec_s[1] * 0.5

    def fails() -> None:
        raise RuntimeError("boom")

    before = list(w.exec_s)
    with pytest.raises(RuntimeError, match="boom"):
        w._timed(fails)()
    assert w.exec_s[0] >= before[0]  # a failing call is still timed, and the error propagates


@needs_vllm
def test_step_reply_separates_model_execution_from_the_step(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    cfg = EngineConfig(model=str(model), num_blocks=16, max_num_seqs=4, max_num_batched_tokens=256,
                       max_model_len=256, timing="norm")
    with VLLMEngine(cfg) as eng:
        rid = 7
        replies = [eng.step([(rid, 64, 0, 64)], add=[(rid, 64, 3)])]
        replies += [eng.step([(rid, 1, 64 + k, 65 + k)]) for k in range(2)]
        assert eng.abort([]) == cfg.num_blocks  # finished after its 3 output tokens
    for r in replies:
        assert 0 < r["exec_cpu_s"] <= r["cpu_s"] + 1e-4  # model execution + sampling is part of the step
        assert 0 < r["exec_s"] <= r["time_s"]


@needs_vllm
def test_fidelity_archs_build_their_model(tmp_path: Path) -> None:
    archs = _fidelity_module().ARCHS
    assert "small" in archs and "tiny" in archs
    arch = archs["small"]
    model = make_tiny_model(tmp_path / "small", **{k: int(arch[k]) for k in ("hidden", "layers", "heads")})
    conf = json.loads((model / "config.json").read_text())
    assert (conf["hidden_size"], conf["num_hidden_layers"], conf["num_attention_heads"]) == (
        arch["hidden"], arch["layers"], arch["heads"])
    assert model_hidden(model) == arch["hidden"]


def test_repeated_split_separates_noise_from_model_error() -> None:
    import numpy as np
    import pandas as pd

    from slogym.core.batch import BatchFeatures

    a = BatchFeatures.build(decode_seqs=2, decode_tokens=2, decode_ctx=300)
    b = BatchFeatures.build(prefill_tokens=64, prefill_seqs=1)
    rows = [{k: int(v[0]) for k, v in f._asdict().items()} for f in [a] * 5 + [b]]
    it = pd.DataFrame(rows).assign(time_s=[1.0, 1.0, 1.0, 1.2, 0.8, 3.0])
    pred = np.array([1.1] * 5 + [9.0])  # the once-only batch's error must not count
    out = _fidelity_module().repeated_split(it, pred)
    assert out["repeated_share"] == pytest.approx(5 / 6)
    assert out["repeated_noise"] == pytest.approx(100 * (0.2 + 0.2) / 5)  # around the median 1.0
    assert out["repeated_model_error"] == pytest.approx(10.0)
    assert out["oracle_mape"] == pytest.approx(100 * (1 / 0.8 - 1 + 1 - 1 / 1.2) / 5)
    assert out["repeated_mape"] == pytest.approx(100 * np.mean(np.abs(1.1 / it["time_s"][:5] - 1)))
    assert _fidelity_module().repeated_split(it.iloc[4:], pred[4:]) == {}  # nothing repeats 5 times


def test_profile_grid_covers_every_small_decode_batch() -> None:
    """Served replays are mostly decode steps of 1-8 requests, where the engine's time is not linear in the batch
    size: the default grid profiles each of those sizes (App. A's 1, 2, 4, 8 plus SMALL_DECODE), within the KV
    pool, and the fit's piecewise family gets a knot at each."""
    from slogym.engines.fitting import PWL_KNOTS
    from slogym.engines.profiler import SMALL_DECODE, ProfileGrid

    kv = 256 * 32
    grid = ProfileGrid.app_a(32, 1024, kv, 896)
    sizes = {b for b, _ in grid.decode}
    assert set(range(1, 9)) <= sizes and set(range(1, 9)) <= set(PWL_KNOTS)
    assert all(b * (n + 16) <= kv for b, n in grid.decode) and len(set(grid.decode)) == len(grid.decode)
    for b in SMALL_DECODE:  # every other context length, short and long ones
        ctx = sorted(n for s, n in grid.decode if s == b)
        assert len(ctx) >= 4 and ctx[0] <= 32 and ctx[-1] >= 512
    tight = ProfileGrid.app_a(4, 128, 16 * 32, 256, quick=True)  # the CLI test's engine: nothing over its limits
    assert {b for b, _ in tight.decode} <= {1, 2, 3, 4}
    assert all(b * (n + 16) <= 16 * 32 for b, n in tight.decode)


def _visits(elasticity: dict[str, float], preempt: float = 0.0, seed: int = 0) -> "pd.DataFrame":
    """Profile-like rows: 3 kinds x 30 compositions x 4 passes whose raw CPU time follows the speed factor with
    ``elasticity`` (cpu = base * speed ** -e), and a third of them descheduled inside the step (wall / CPU time
    1.1-3) costing ``(wall / cpu) ** preempt`` more CPU time, times a small independent noise."""
    import numpy as np
    import pandas as pd

    from slogym.core.batch import BatchFeatures

    rng = np.random.default_rng(seed)
    rows = []
    for kind in ("prefill", "decode", "mixed"):
        for c in range(30):
            base = 0.01 * (1 + c)
            for _ in range(4):
                speed = float(np.exp(rng.normal(0.0, 0.3)))
                ratio = float(rng.uniform(1.1, 3.0)) if rng.random() < 1 / 3 else 1.0
                cpu = base * speed ** -elasticity[kind] * ratio ** preempt * float(np.exp(rng.normal(0.0, 0.01)))
                rows.append({**dict.fromkeys(BatchFeatures._fields, 0), "kind": kind,
                             "prefill_tokens": 0 if kind == "decode" else 16 * (c + 1),
                             "decode_seqs": 0 if kind == "prefill" else c + 1, "cpu_s": cpu, "speed": speed,
                             "wall_s": cpu * ratio, "time_s": cpu * speed})
    return pd.DataFrame(rows)


def _spread(df: "pd.DataFrame") -> "pd.Series":
    """Per kind, the mean relative standard deviation of a composition's visits."""
    g = df.groupby(["kind", "prefill_tokens", "decode_seqs"])["time_s"]
    return g.agg(lambda t: t.std() / t.mean()).groupby(level="kind").mean()


def test_norm_exponents_recover_each_kinds_elasticity_and_retime_applies_it() -> None:
    import numpy as np

    from slogym.engines.profiler import norm_exponents, retime

    true = {"prefill": 0.5, "decode": 1.0, "mixed": 0.75}
    df = _visits(true)
    est, preempt = norm_exponents(df)
    assert set(est) == set(true) and all(abs(est[k] - true[k]) < 0.05 for k in true)
    assert all(b < 0.05 for b in preempt.values())  # preemption costs nothing here
    # re-timed with the fitted exponents, a composition's visits agree (the factor's swings are removed);
    # the plain norm time (exponent 1) leaves the prefill and mixed visits spread
    assert (_spread(retime(df, est)) < 0.03).all() and not (_spread(retime(df, {})) < 0.03).all()
    # rows without a kind (live iterations) take it from their features
    live = retime(df.drop(columns="kind"), {"prefill": 0.0})
    pre = (df["decode_seqs"] == 0).to_numpy()
    assert np.allclose(live["time_s"][pre], df["cpu_s"][pre])
    assert np.allclose(live["time_s"][~pre], (df["cpu_s"] * df["speed"])[~pre])


def test_norm_exponents_price_preemption_inside_the_step() -> None:
    from slogym.engines.profiler import norm_exponents, retime

    df = _visits({"prefill": 1.0, "decode": 1.0, "mixed": 1.0}, preempt=0.1)
    est, preempt = norm_exponents(df)
    assert set(preempt) == {"prefill", "decode", "mixed"} and all(abs(b - 0.1) < 0.02 for b in preempt.values())
    assert all(abs(e - 1.0) < 0.05 for e in est.values())
    assert (_spread(retime(df, est, preempt)) < _spread(retime(df, est))).all()
    # too few preempted visits of a kind: no preemption exponent for it
    few = df[(df["wall_s"] == df["cpu_s"]) | (df["kind"] != "mixed")]
    assert set(norm_exponents(few)[1]) == {"prefill", "decode"}


def test_norm_exponents_need_repeats_and_factor_spread() -> None:
    from slogym.engines.profiler import norm_exponents

    df = _visits({"prefill": 0.5, "decode": 0.5, "mixed": 0.5})
    assert norm_exponents(df.assign(speed=1.0)) == ({}, {})  # cpu / wall timing: nothing to estimate
    once = df.groupby(["kind", "prefill_tokens", "decode_seqs"]).head(1)  # every composition visited once
    assert norm_exponents(once) == ({}, {})
    assert set(norm_exponents(df[df["kind"] != "mixed"])[0]) == {"prefill", "decode"}


@pytest.mark.parametrize("name, bad", [("norm_elasticity", {"decode": -0.1}), ("norm_elasticity", {"decode": 2.5}),
                                       ("norm_elasticity", {"spec": 1.0}), ("norm_preempt", {"prefill": 1.5})])
def test_engine_config_rejects_bad_norm_exponents(name: str, bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig(model="m", num_blocks=64, max_model_len=1024, **{name: bad})


def test_ops_reference_calibrates_like_the_gemm_reference() -> None:
    from slogym.engines.live.worker import OpsReference

    ref = OpsReference(calibrate=2, window=2)
    for _ in range(4):
        ref.sample()
    assert ref.typical is not None and ref.typical > 0 and ref.factor() > 0


def test_timing_variants_compare_the_same_iterations_under_other_exponents() -> None:
    from slogym.engines.profiler import norm_exponents

    fid = _fidelity_module()
    df = _visits({"prefill": 0.4, "decode": 0.4, "mixed": 0.4})
    df = df[df["kind"] != "mixed"].assign(decode_tokens=df["decode_seqs"])  # each kind linear in its tokens
    est, _ = norm_exponents(df)
    out = fid.timing_variants(df, {"p": df.drop(columns="kind")}, "phase-quadratic", 0, est)
    assert set(out) == {"plain_norm", "speed_only"} and set(out["plain_norm"]) == {"p"}
    # the fitted exponent removes the factor's swings that the plain norm time (e = 1) over-corrects
    assert out["speed_only"]["p"]["iteration_mape"] < out["plain_norm"]["p"]["iteration_mape"] / 2
    assert fid.timing_variants(df.assign(speed=1.0), {"p": df}, None, 0, {}) == {}  # no norm factor: nothing


@pytest.mark.parametrize("bad", [-1, 100])
def test_engine_config_rejects_bad_rt_priority(bad: int) -> None:
    with pytest.raises(ValueError, match="rt_priority"):
        EngineConfig(model="m", num_blocks=64, max_model_len=1024, rt_priority=bad)


class _FakeEngine:
    """Stands in for vLLM's LLMEngine in :meth:`Worker.step`: burns ~10 ms of CPU, notes whether GC was on."""

    def __init__(self) -> None:
        self.gc_during_step: list[bool] = []

    def step(self) -> list[Any]:
        import gc

        self.gc_during_step.append(gc.isenabled())
        t = time.thread_time()
        while time.thread_time() - t < 0.01:
            pass
        return []


def _fake_worker(gc_in_step: bool) -> Worker:
    from types import SimpleNamespace

    w = Worker.__new__(Worker)  # the step protocol only; no vLLM
    pool = SimpleNamespace(get_num_free_blocks=lambda: 8)
    w.sched = SimpleNamespace(plan=None, executed={"1": 1}, kv_cache_manager=SimpleNamespace(block_pool=pool),
                              requests={"1": SimpleNamespace(num_computed_tokens=1, num_tokens=2)})
    w.engine, w.ids, w.speed, w.exec_s = _FakeEngine(), {1: "1"}, None, [0.0, 0.0]
    w.gc_in_step, w.thread_clock = gc_in_step, True
    return w


@pytest.mark.parametrize("gc_in_step", [True, False])
def test_worker_step_times_the_engine_thread_and_can_pause_gc(gc_in_step: bool) -> None:
    import gc

    w = _fake_worker(gc_in_step)
    reply = w.step({"plan": [(1, 1, 0, 1)]})
    assert w.engine.gc_during_step == [gc_in_step] and gc.isenabled()  # re-enabled after the step
    assert reply["executed"] == {1: 1} and reply["state"] == {1: (1, 2)}
    assert 0.009 <= reply["cpu_s"] <= reply["process_cpu_s"] + 1e-6  # the engine thread's share of the process's
    assert reply["nivcsw"] >= 0 and reply["minflt"] >= 0


def _fifo_allowed() -> bool:
    import subprocess
    import sys

    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@needs_vllm
def test_rt_priority_runs_the_engine_thread_under_sched_fifo(tmp_path_factory: pytest.TempPathFactory) -> None:
    import os

    from slogym.engines.live import EngineError

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    cfg = EngineConfig(model=str(model), num_blocks=16, max_num_seqs=4, max_num_batched_tokens=256,
                       max_model_len=256, rt_priority=1)
    if not _fifo_allowed():
        with pytest.raises(EngineError, match="rt_priority=1"):
            VLLMEngine(cfg)
        return
    with VLLMEngine(cfg) as eng:
        assert eng.info["sched_policy"] == os.SCHED_FIFO
        assert os.sched_getscheduler(eng.pid) == os.SCHED_FIFO  # the engine thread (tid = pid) itself
        reply = eng.step([(3, 32, 0, 32)], add=[(3, 32, 1)])
        assert 0 < reply["cpu_s"] <= reply["process_cpu_s"] + 1e-6
        assert eng.abort([]) == cfg.num_blocks


# ---------------------------------------------------------------------------------- refusals, CLI, tiny-model reuse
class _StubEngine:
    """Stands in for a VLLMEngine where the LiveSimulator refuses before any engine is used."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.config = cfg
        self.closed = False


def _live_setup() -> tuple[Any, EngineConfig, Any]:
    from slogym.core.request import Request, Workload, decode, prefill
    from slogym.engines.live import live_spec

    cfg = EngineConfig(model="unused", num_blocks=48, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512)
    w = Workload.from_requests([Request(0.01 * i, [prefill(40), decode(5)]) for i in range(4)])
    return w, cfg, live_spec(cfg)


def test_live_simulator_refuses_pd_scaling_and_multi_engine_real_clock_up_front() -> None:
    from slogym.baselines import make_policy
    from slogym.core.instance import Role
    from slogym.engines.live import LiveSimulator, UnsupportedOnLiveEngine

    w, cfg, spec = _live_setup()
    two = [_StubEngine(cfg), _StubEngine(cfg)]
    with pytest.raises(UnsupportedOnLiveEngine, match=r"pd=\(1, 1\): P/D disaggregation"):
        LiveSimulator(w, two, make_policy("rr-pd", engine=spec), pd=(1, 1))
    with pytest.raises(UnsupportedOnLiveEngine, match="has a scaler"):
        LiveSimulator(w, two[:1], make_policy("hyperflexis-scaling", engine=spec))
    with pytest.raises(UnsupportedOnLiveEngine, match="clock='real' with 2 engines"):
        LiveSimulator(w, two, make_policy("round-robin", engine=spec), clock="real")
    sim = LiveSimulator(w, two, make_policy("round-robin", engine=spec))  # afap with two engines is fine
    with pytest.raises(UnsupportedOnLiveEngine, match=r"add_instance \(scale-out\)"):
        sim.add_instance()
    with pytest.raises(UnsupportedOnLiveEngine, match=r"switch_role\(1, PREFILL\)"):
        sim.switch_role(1, Role.PREFILL)
    assert len(sim.instances) == 2 and all(i.role == Role.COLOCATED for i in sim.instances)


def test_make_tiny_model_refuses_a_model_of_another_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 256, "num_hidden_layers": 4,
                                                      "num_attention_heads": 8, "vocab_size": 512,
                                                      "max_position_embeddings": 4096}))
    with pytest.raises(ValueError, match="another architecture.*hidden_size 256 vs 128"):
        make_tiny_model(tmp_path)
    assert make_tiny_model(tmp_path, hidden=256, layers=4, heads=8) == tmp_path  # the same one is reused
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        make_tiny_model(tmp_path, hidden=256, layers=4, heads=8)


def test_profile_run_rejects_bad_measure_before_starting_an_engine(tmp_path: Path, capsys: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import slogym.engines.live as live
    from slogym.cli import main

    monkeypatch.setattr(live, "VLLMEngine", lambda *a, **k: pytest.fail("engine started"))
    for extra in (["--measure", "2"], ["--measure", "5", "--warmup", "3"]):
        rc = main(["profile", "run", "--model", str(tmp_path), "--out", str(tmp_path / "x.csv"), *extra])
        assert rc == 2 and "--measure" in capsys.readouterr().err


def test_profile_fit_applies_the_profiled_engines_limits(tmp_path: Path, capsys: Any) -> None:
    import numpy as np
    import pandas as pd

    from slogym.cli import main, profile_limits_path
    from slogym.core.batch import BatchFeatures

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        p, d = int(rng.integers(0, 512)), int(rng.integers(0, 16))
        f = dict.fromkeys(BatchFeatures._fields, 0) | {"prefill_tokens": p, "prefill_seqs": int(p > 0),
                                                       "decode_seqs": d, "decode_tokens": d,
                                                       "decode_ctx": 100 * d}
        rows.append(f | {"time_s": 2e-3 + 1e-5 * p + 5e-5 * d})
    csv = tmp_path / "prof.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    out = tmp_path / "fit.json"
    args = ["profile", "fit", str(csv), "--family", "quadratic", "--holdout", "0", "--out", str(out)]
    assert main(args) == 2  # no KV capacity: neither --kv-tokens, --base nor a sidecar
    capsys.readouterr()
    profile_limits_path(csv).write_text(json.dumps({"kv_capacity_tokens": 1536, "block_size": 64,
                                                    "max_num_seqs": 8, "max_num_batched_tokens": 256}))
    assert main(args + ["--max-num-seqs", "4"]) == 0
    capsys.readouterr()
    preset = json.loads(out.read_text())
    assert (preset["kv_capacity_tokens"], preset["block_size"], preset["max_num_seqs"],
            preset["max_num_batched_tokens"]) == (1536, 64, 4, 256)
    assert preset["provenance"]["limits"] == {"block_size": "profile", "max_num_seqs": "flag",
                                              "max_num_batched_tokens": "profile"}

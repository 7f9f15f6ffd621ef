"""Leaderboard: capacity bisection, run cache, Ray == local pool, the quick board end to end."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from slogym.leaderboard import BoardConfig, RunCache, Runner, RunSpec, bisect_capacity, build
from slogym.leaderboard.capacity import CapacitySearch
from slogym.leaderboard.sweep import execute


@pytest.mark.parametrize("threshold_rate", [0.37, 3.0, 17.5, 250.0])
def test_bisection_finds_the_known_threshold_of_a_monotone_curve(threshold_rate):
    def attainment(rate: float) -> float:  # falls through 0.9 exactly at threshold_rate
        return 1.0 - 0.1 * rate / threshold_rate

    cap = bisect_capacity(attainment, start=5.0, iters=20, max_expand=8)
    assert cap <= threshold_rate + 1e-9
    assert cap == pytest.approx(threshold_rate, rel=1e-4)


def test_search_reports_zero_when_nothing_passes_and_the_cap_when_everything_does():
    assert bisect_capacity(lambda r: 0.0, start=1.0, iters=5) == 0.0
    s = CapacitySearch(start=1.0, iters=5, max_expand=3)
    while not s.done:
        s.update(1.0)
    assert s.capacity == 8.0 and len(s.history) == 4


SPEC = RunSpec("sarathi", "chatbot", 4.0, 0, 60)


def test_cache_hits_skip_work_and_a_code_change_invalidates(tmp_path):
    calls = []
    cache = RunCache(tmp_path, version="v1")
    runner = Runner(cache, workers=1, progress=calls.append)
    first = runner.run([SPEC])
    assert len(calls) == 1 and cache.misses == 1
    again = runner.run([SPEC])
    assert len(calls) == 1 and cache.hits == 1 and again == first
    changed = Runner(RunCache(tmp_path, version="v2"), workers=1, progress=calls.append)
    changed.run([SPEC])
    assert len(calls) == 2


def test_a_run_is_a_pure_function_of_its_spec():
    a, b = execute(SPEC), execute(SPEC)
    for k in ("wall_seconds",):
        a.pop(k), b.pop(k)
    assert a == b and a["n_requests"] == 60 and 0.0 <= a["attainment"] <= 1.0


def test_ray_and_local_pool_give_identical_results(tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (extra 'ray')")
    specs = [RunSpec(p, "coder", r, 0, 50) for p in ("vllm", "edf") for r in (0.5, 2.0)]
    local = Runner(RunCache(tmp_path / "local"), workers=2).run(specs)
    try:
        remote = Runner(RunCache(tmp_path / "ray"), ray=True).run(specs)
    finally:
        ray.shutdown()
    drop = ["wall_seconds"]
    assert pd.DataFrame(local).drop(columns=drop).equals(pd.DataFrame(remote).drop(columns=drop))


def test_quick_board_end_to_end_and_resume(tmp_path):
    cfg = BoardConfig.quick(["coder"], ["vllm", "sarathi"])
    cfg.min_duration, cfg.iters, cfg.n_requests = 5.0, 2, 60
    df, cap, md = build(cfg, tmp_path, workers=2, progress=False)
    assert set(cap["policy"]) == {"vllm", "sarathi"} and (cap["capacity"] >= 0).all()
    assert "| vllm |" in md and "**" in md
    for f in ("leaderboard.md", "runs.parquet", "runs.csv", "capacity.csv", "meta.json", "attainment_coder.png"):
        assert (tmp_path / f).stat().st_size > 0
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["config"]["seeds"] == [0] and meta["engine_preset"]["name"] == "llama3-8b-h100"
    # each search's first probe is the default rate, already run as a fixed-load point: served from the cache
    assert "sarathi" in meta["policy_params"] and meta["cache"]["computed"] == len(df)
    _, cap2, _ = build(cfg, tmp_path, workers=2, progress=False)
    meta2 = json.loads((tmp_path / "meta.json").read_text())
    assert meta2["cache"]["computed"] == 0 and meta2["cache"]["hits"] >= len(df)
    assert cap2.equals(cap)


def _lengths_csv(path, n: int, out_tokens: int = 40):
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + f"100,{out_tokens}\n" * n)
    return path


def test_cache_key_follows_the_content_of_trace_engine_and_checkpoint(tmp_path, monkeypatch):
    """A changed trace file, engine preset file or agent checkpoint must not return the old run (each board
    fingerprints them afresh); the same content under another path or spelling may."""
    from slogym.engines import get_engine
    from slogym.leaderboard import InputFingerprints

    def key(spec):  # a fresh board each time: fingerprints are computed once per board
        return RunCache(tmp_path / "c", version="v", inputs=InputFingerprints())._path(spec).name

    trace = _lengths_csv(tmp_path / "t.csv", 50)
    with_trace = RunSpec("vllm", "coder", 1.0, 0, 50, trace=str(trace))
    before = key(with_trace)
    _lengths_csv(trace, 50, out_tokens=41)
    assert key(with_trace) != before
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")  # the same relative name in another folder is another file
    _lengths_csv(tmp_path / "other" / "t.csv", 50, out_tokens=7)
    monkeypatch.chdir(tmp_path)
    here = key(RunSpec("vllm", "coder", 1.0, 0, 50, trace="t.csv"))
    monkeypatch.chdir(tmp_path / "other")
    assert key(RunSpec("vllm", "coder", 1.0, 0, 50, trace="t.csv")) != here

    preset = get_engine("llama3-8b-h100").to_dict()
    (tmp_path / "e.json").write_text(json.dumps(preset))
    on_file = RunSpec("vllm", "coder", 1.0, 0, 50, engine=str(tmp_path / "e.json"))
    assert key(on_file) == key(RunSpec("vllm", "coder", 1.0, 0, 50))  # same content: name and file alike
    preset["kv_capacity_tokens"] //= 2
    (tmp_path / "e.json").write_text(json.dumps(preset))
    assert key(on_file) != key(RunSpec("vllm", "coder", 1.0, 0, 50))

    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "a.json").write_text(json.dumps({"env_kwargs": {"scenario": "coder"}}))
    (agents / "a.zip").write_bytes(b"one")
    monkeypatch.setenv("SLOGYM_AGENTS_DIR", str(agents))
    agent = RunSpec("agent:a", "coder", 1.0, 0, 50)
    before = key(agent)
    (agents / "a.zip").write_bytes(b"two")
    assert key(agent) != before


def test_a_changed_trace_file_is_rerun_not_served_from_the_cache(tmp_path):
    trace = _lengths_csv(tmp_path / "t.csv", 60)
    spec = RunSpec("vllm", "coder", 1.0, 0, 60, trace=str(trace))
    first = Runner(RunCache(tmp_path / "c", version="v"), workers=1).run([spec])[0]
    _lengths_csv(trace, 60, out_tokens=400)
    cache = RunCache(tmp_path / "c", version="v")
    second = Runner(cache, workers=1).run([spec])[0]
    assert cache.misses == 1 and cache.hits == 0 and second["ttlt_p50"] != first["ttlt_p50"]


def test_search_marks_capacities_cut_off_by_its_limits_as_censored():
    s = CapacitySearch(start=1.0, iters=3, max_expand=3)
    while not s.done:
        s.update(1.0)
    assert (s.capacity, s.censored, s.fail_rate) == (8.0, "above", None)
    s = CapacitySearch(start=1.0, iters=3, max_expand=3)
    while not s.done:
        s.update(0.0)
    assert (s.capacity, s.censored, s.fail_rate) == (0.0, "below", 0.125)
    s = CapacitySearch(start=1.0, iters=3, max_expand=3)
    while not s.done:
        s.update(1.0 if s.next_rate() <= 3.0 else 0.0)
    assert s.censored == "" and s.capacity == 3.0 and s.fail_rate == 3.25


def test_censored_capacities_print_as_bounds_and_win_only_above_every_measured_value():
    from slogym.leaderboard.board import _bold_best

    idx = pd.Index(["vllm", "edf", "sa", "sjf"], name="policy")
    cap = pd.DataFrame({"a": [3.0, 5.44, 5.44, 0.0], "b": [5.0, 4.0, 1.0, 0.0]}, index=idx)
    cens = pd.DataFrame({"a": ["", "above", "above", "below"], "b": ["", "above", "", "below"]}, index=idx)
    bound = pd.DataFrame({"a": [4.0, None, None, 0.085], "b": [6.0, None, 2.0, 0.085]}, index=idx)
    out = _bold_best(cap, censored=cens, bound=bound)
    assert list(out["a"]) == ["3.00", "**>= 5.44**", "**>= 5.44**", "< 0.09"]
    assert list(out["b"]) == ["**5.00**", ">= 4.00", "1.00", "< 0.09"]  # a lower bound below a measured value


def test_capacity_csv_and_markdown_carry_the_censoring(tmp_path):
    cfg = BoardConfig.quick(["coder"], ["vllm"])
    cfg.min_duration, cfg.iters, cfg.n_requests, cfg.max_expand = 5.0, 1, 40, 0
    _, cap, md = build(cfg, tmp_path, workers=1, progress=False)
    csv = pd.read_csv(tmp_path / "capacity.csv", keep_default_na=False)
    assert list(csv.columns) == ["policy", "scenario", "capacity", "censored", "fail_rate"]
    # max_expand=0: vllm passes at coder's default rate (attainment 1.0) and nothing above it is tried
    assert csv.iloc[0]["censored"] == "above" and csv.iloc[0]["fail_rate"] == "" and cap.iloc[0]["capacity"] == 0.68
    assert "| vllm | **>= 0.68** |" in md


@pytest.mark.parametrize("argv, bad", [
    (["--trace", "{tmp}/nonexistent.csv"], "trace file not found"),
    (["--trace", "{tmp}/bad.csv"], "bad.csv"),
    (["--engine", "{tmp}/nonexistent.json"], "engine preset file not found"),
    (["--engine", "no-such-engine"], "unknown engine"),
    (["--out", "{tmp}/a_file"], "is a file"),
    (["--policies", ""], "--policies is empty"),
    (["--policies", "vllm,,edf"], "empty name"),
    (["--scenarios", ""], "--scenarios is empty"),
    (["--policies", "nope"], "unknown policy 'nope'"),
])
def test_leaderboard_bad_options_exit_2_with_one_line_before_running(capsys, tmp_path, argv, bad):
    from slogym.cli import main

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad.csv").write_text("num_prefill_tokens,num_decode_tokens\n100,-3\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out_dir = [] if "--out" in argv else ["--out", str(tmp_path / "lb")]
    rc = main(["leaderboard", "--quick", "--scenarios", "coder", "--policies", "vllm", *out_dir, *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.startswith("slogym: error: ") and bad in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "lb" / "cache").exists()
    if "unknown policy" in bad:  # every valid name once
        names = err.split("valid: ", 1)[1].split(" (see")[0].strip().split(", ")
        assert len(names) == len(set(names)) and "vllm" in names


def test_leaderboard_policy_list_drops_duplicates_keeping_order(capsys, tmp_path, monkeypatch):
    from slogym import cli

    seen = {}

    def fake_build(cfg, out, **kw):
        seen["cfg"] = cfg
        return None, None, "md"

    monkeypatch.setattr("slogym.leaderboard.build", fake_build)
    rc = cli.main(["leaderboard", "--quick", "--scenarios", "coder,coder", "--policies", "vllm,edf,vllm",
                   "--out", str(tmp_path / "lb")])
    assert rc == 0 and seen["cfg"].policies == ["vllm", "edf"] and seen["cfg"].scenarios == ["coder"]


def test_bold_is_chosen_on_the_values_as_displayed():
    from slogym.leaderboard.board import _bold_best

    t = pd.DataFrame({"a": [0.9004, 0.9001, 0.5]}, index=pd.Index(["vllm", "edf", "sa"], name="policy"))
    assert list(_bold_best(t, fmt="{:.3f}")["a"]) == ["**0.900**", "**0.900**", "0.500"]


def test_meta_and_csv_describe_the_board_exactly(tmp_path, monkeypatch):
    import hashlib
    import re

    trace = _lengths_csv(tmp_path / "t.csv", 300)
    monkeypatch.chdir(tmp_path)
    cfg = BoardConfig.quick(["coder"], ["vllm"])
    cfg.min_duration, cfg.iters, cfg.n_requests, cfg.max_expand, cfg.trace = 5.0, 2, 40, 1, "t.csv"
    build(cfg, tmp_path / "lb", workers=1, progress=False)
    meta = json.loads((tmp_path / "lb" / "meta.json").read_text())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["created"])
    for dist in ("numba", "pyarrow"):  # installed with slogym's core dependencies
        assert meta["versions"][dist]
    sha = hashlib.sha256(trace.read_bytes()).hexdigest()
    assert meta["inputs"]["trace"] == {"path": str(trace.resolve()), "sha256": sha}
    assert meta["config"]["trace"] == str(trace.resolve())


def test_written_rates_have_no_float_noise(tmp_path):
    from slogym.leaderboard.board import write_tables

    noisy = 3.4000000000000004  # (2.72 + 4.08) / 2, a bisection midpoint
    cap = pd.DataFrame({"policy": ["vllm"], "scenario": ["coder"], "capacity": [noisy], "censored": [""],
                        "fail_rate": [0.1 + 0.2]})
    runs = pd.DataFrame({"policy": ["vllm"], "rate": [noisy], "attainment": [0.95]})
    write_tables(runs, cap, tmp_path)
    assert (tmp_path / "capacity.csv").read_text().splitlines()[1] == "vllm,coder,3.4,,0.3"
    assert (tmp_path / "runs.csv").read_text().splitlines()[1] == "vllm,3.4,0.95"
    assert pd.read_parquet(tmp_path / "runs.parquet")["rate"].iloc[0] == noisy  # the exact value kept


def test_meta_records_each_agent_checkpoint_hash(tmp_path):
    pytest.importorskip("sb3_contrib", reason="needs the rl extra")
    from slogym.agents import available, checkpoint_dir
    from slogym.leaderboard.board import metadata

    if not available():
        pytest.skip("no shipped agent")
    name = available()[0]
    cfg = BoardConfig.quick(["coder"], ["vllm", f"agent:{name}"])
    meta = metadata(cfg, 0.0)
    files = [checkpoint_dir() / f"{name}{ext}" for ext in (".zip", ".json")]
    import hashlib

    want = hashlib.sha256(b"".join(hashlib.sha256(f.read_bytes()).hexdigest().encode() for f in files)).hexdigest()
    assert meta["policy_params"][f"agent:{name}"]["checkpoint_sha256"] == want
    assert meta["inputs"]["agents"][f"agent:{name}"]["sha256"] == want


def test_a_trace_shorter_than_the_board_warns_in_one_line(capsys, tmp_path):
    from slogym.cli import main

    trace = _lengths_csv(tmp_path / "short.csv", 30)
    rc = main(["leaderboard", "--quick", "--scenarios", "coder", "--policies", "vllm", "--requests", "50",
               "--trace", str(trace), "--out", str(tmp_path / "lb"), "--no-progress"])
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert rc == 0 and len(warning) == 1, err
    assert str(trace) in warning[0] and "30 rows" in warning[0] and "50 requests" in warning[0]
    assert (pd.read_csv(tmp_path / "lb" / "runs.csv")["n_requests"] == 30).all()  # runs record what they ran

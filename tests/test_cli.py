"""The ``slogym`` command line: every subcommand, JSON/Parquet schemas, usage errors, the installed entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from slogym import __version__
from slogym.baselines import list_policies, make_policy, policy_params
from slogym.cli import main
from slogym.core.batch import BatchFeatures
from slogym.engines.perf_models import QuadraticPerf
from slogym.engines.registry import get_engine, list_engines
from slogym.workloads.scenarios import list_scenarios

RUN = ["simulate", "--scenario", "chatbot", "--policy", "sarathi", "--rate", "2.0", "--engine", "llama3-8b-h100",
       "--requests", "200"]
SUMMARY_KEYS = {"attainment", "goodput", "throughput", "service_gain", "cost_instance_seconds", "n_requests",
                "wall_seconds"}
RECORD_COLUMNS = {"request_id", "app", "tier", "arrival", "ttft", "max_tpot", "ttlt", "slo_met", "outcome",
                  "service_gain", "instance"}
OUTCOMES = {"finished", "rejected", "best_effort", "dropped", "failed"}
TRUTH = QuadraticPerf(c0=0.01, c_prefill_tok=5e-5, c_prefill_sq=0.0, c_prefill_attn=2e-9, c_decode_tok=1e-4,
                      c_decode_ctx=4e-8)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def batches(n: int, seed: int = 0) -> BatchFeatures:
    rng = np.random.default_rng(seed)
    chunk = rng.integers(0, 2048, n)
    past = rng.integers(0, 2048, n) * (chunk > 0)
    ds = rng.integers(0, 64, n) + (chunk == 0)
    ctx = ds * rng.integers(16, 4096, n)
    return BatchFeatures.build(prefill_tokens=chunk, prefill_seqs=(chunk > 0).astype(np.int64),
                               prefill_attn=chunk * (past + chunk), prefill_sq=chunk * chunk, decode_seqs=ds,
                               decode_tokens=ds, decode_ctx=ctx, kv_tokens=past + chunk + ctx)


@pytest.fixture
def records_csv(tmp_path: Path) -> Path:
    """Profile records timed by a known quadratic model."""
    f = batches(300)
    path = tmp_path / "records.csv"
    pd.DataFrame(f._asdict()).assign(time_s=TRUTH.batch_time(f)).to_csv(path, index=False)
    return path


# ---- simulate ----------------------------------------------------------------------------------------------


def test_simulate_json_is_one_object_with_required_keys(capsys):
    rc, out, err = run_cli(capsys, *RUN, "--json")
    assert rc == 0 and err == ""
    s = json.loads(out)
    assert SUMMARY_KEYS <= s.keys()
    assert 0.0 <= s["attainment"] <= 1.0
    assert s["n_requests"] == 200
    assert s["goodput"] <= s["throughput"] and s["cost_instance_seconds"] > 0 and s["wall_seconds"] > 0
    assert sum(s["outcomes"].values()) == 200


def test_simulate_is_reproducible(capsys):
    first = json.loads(run_cli(capsys, *RUN, "--json", "--seed", "7")[1])
    second = json.loads(run_cli(capsys, *RUN, "--json", "--seed", "7")[1])
    for s in (first, second):
        for key in ("wall_seconds", "requests_per_wall_second"):
            s.pop(key)
    assert first == second


def test_simulate_text_summary_and_parquet(capsys, tmp_path):
    out_path = tmp_path / "run.parquet"
    rc, out, err = run_cli(capsys, *RUN, "--instances", "2", "--router", "least-load",
                           "--param", "token_budget=256", "--attainment", "strict", "--out", str(out_path))
    assert rc == 0 and err == ""
    for label in ("attainment", "by app", "by tier", "TTFT", "TPOT", "TTLT", "goodput", "throughput",
                  "service gain", "SA objective", "instance-seconds", "outcomes", "dropped reasons", "preemptions",
                  "wall time", "2 x llama3-8b-h100", str(out_path)):
        assert label in out
    df = pd.read_parquet(out_path)
    assert RECORD_COLUMNS <= set(df.columns)
    assert len(df) == 200 and df["request_id"].is_unique
    assert set(df["outcome"]) <= OUTCOMES
    assert df["slo_met"].dtype == bool
    assert set(df["instance"]) <= {0, 1}
    assert (df["slo_met"] == df["slo_met_strict"]).all()


def test_simulate_replays_a_trace_file(capsys, tmp_path):
    trace = tmp_path / "azure.csv"
    stamps = pd.date_range("2023-11-16 18:00:00", periods=60, freq="500ms")
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"{t},{100 + i},{20 + i}\n" for i, t in enumerate(stamps)))
    rc, out, _ = run_cli(capsys, "simulate", "--trace", str(trace), "--requests", "50", "--json")
    assert rc == 0
    assert json.loads(out)["n_requests"] == 50


# ---- listings ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command, names, fields", [
    ("scenarios", list_scenarios(), {"name", "description", "default_rate", "source"}),
    ("policies", list_policies(), {"name", "description"}),
    ("engines", list_engines(), {"name", "model", "gpu", "tp", "family", "kv_tokens", "source"}),
])
def test_listings(capsys, command, names, fields):
    rc, out, _ = run_cli(capsys, command)
    assert rc == 0 and all(name in out for name in names)
    rc, out, _ = run_cli(capsys, command, "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["name"] for r in rows] == names
    assert all(fields <= r.keys() for r in rows)


def test_engines_json_matches_presets(capsys):
    rows = {r["name"]: r for r in json.loads(run_cli(capsys, "engines", "--json")[1])}
    e = get_engine("llama3-8b-h100")
    assert rows["llama3-8b-h100"] | {"source": None} == {
        "name": "llama3-8b-h100", "model": e.model, "gpu": e.gpu, "tp": e.tp, "family": e.perf.family,
        "kv_tokens": e.kv_capacity_tokens, "source": None}


def test_version(capsys):
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"slogym {__version__}"


# ---- profile -----------------------------------------------------------------------------------------------


def test_profile_fit_roundtrip(capsys, tmp_path, records_csv):
    preset = tmp_path / "mine.json"
    rc, out, _ = run_cli(capsys, "profile", "fit", str(records_csv), "--family", "quadratic", "--out", str(preset),
                         "--kv-tokens", "200000", "--model", "toy", "--gpu", "h100")
    assert rc == 0 and "held-out MAPE" in out
    spec = get_engine(str(preset))
    assert (spec.name, spec.model, spec.gpu, spec.kv_capacity_tokens) == ("mine", "toy", "h100", 200000)
    f = batches(40, seed=1)
    np.testing.assert_allclose(spec.batch_time(f), TRUTH.batch_time(f), rtol=1e-6)
    rc, out, _ = run_cli(capsys, "simulate", "--engine", str(preset), "--requests", "50", "--json")
    assert rc == 0 and json.loads(out)["engine"] == ["mine"]


def test_profile_fit_auto_reports_the_family_it_chose(capsys, tmp_path, records_csv):
    """``--family auto`` fits every candidate family and keeps the lowest held-out MAPE; the records come from a
    quadratic model, which the quadratic and phase-quadratic families represent exactly."""
    preset = tmp_path / "auto.json"
    rc, out, _ = run_cli(capsys, "profile", "fit", str(records_csv), "--family", "auto", "--out", str(preset),
                         "--kv-tokens", "200000", "--json")
    report = json.loads(out)
    assert rc == 0 and report["family"] in ("quadratic", "phase-quadratic")
    assert report["holdout_mape_pct"] < 1.0
    assert get_engine(str(preset)).perf.family == report["family"]


def test_profile_fit_json_inherits_from_base(capsys, tmp_path, records_csv):
    preset = tmp_path / "roof.json"
    rc, out, _ = run_cli(capsys, "profile", "fit", str(records_csv), "--family", "roofline", "--out", str(preset),
                         "--base", "llama3-8b-h100", "--pieces", "2", "--json")
    report = json.loads(out)
    assert rc == 0 and report["family"] == "roofline" and report["holdout_mape_pct"] >= 0
    spec, base = get_engine(str(preset)), get_engine("llama3-8b-h100")
    assert (spec.model, spec.gpu, spec.kv_capacity_tokens) == (base.model, base.gpu, base.kv_capacity_tokens)


# ---- usage errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, bad", [
    (["simulate", "--scenario", "nope"], "'nope'; valid: chatbot"),
    (["simulate", "--policy", "nope"], "'nope'; valid: vllm"),
    (["simulate", "--engine", "nope"], "'nope'; valid: llama2-70b"),
    (["simulate", "--engine", "{tmp}/missing.json"], "missing.json"),
    (["simulate", "--rate", "-1"], "'-1'"),
    (["simulate", "--rate", "fast"], "'fast'"),
    (["simulate", "--requests", "0"], "'0'"),
    (["simulate", "--trace", "{tmp}/missing.csv"], "missing.csv"),
    (["simulate", "--trace", "{tmp}/bad.csv"], "'GeneratedTokens'"),
    (["simulate", "--param", "token_budget"], "'token_budget'"),
    (["simulate", "--policy", "sarathi", "--param", "bogus=1"], "bogus=1"),
    (["simulate", "--router", "nope"], "'nope'; valid: round-robin"),
    (["simulate", "--attainment", "nope"], "'nope'"),
    (["simulate", "--slo", "nope"], "'nope'"),
    (["simulate", "--out", "{tmp}/no/dir/run.parquet"], "run.parquet"),
    (["profile", "fit", "{tmp}/missing.csv", "--family", "quadratic", "--out", "{tmp}/p.json", "--kv-tokens", "9"],
     "missing.csv"),
    (["profile", "fit", "{tmp}/bad.csv", "--family", "cubic", "--out", "{tmp}/p.json"], "'cubic'"),
    (["profile", "fit", "{tmp}/bad.csv", "--family", "quadratic", "--out", "{tmp}/p.json", "--kv-tokens", "9"],
     "time_s"),
    (["profile", "run"], "required: --model, --out"),
    (["nope"], "'nope'"),
])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, argv, bad):
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,abc\n")
    rc, out, err = run_cli(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert rc == 2 and out == ""
    assert err.startswith("slogym: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert bad.replace("{tmp}", str(tmp_path)) in err


def test_installed_entry_point_help():
    exe = Path(sys.executable).parent / "slogym"
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for command in ("simulate", "scenarios", "policies", "engines", "profile"):
        assert command in proc.stdout


# ---- policy parameters -------------------------------------------------------------------------------------

SAMPLE = {  # one valid value per parameter key (policy_params lists every key with an entry here)
    "max_num_seqs": 64, "max_num_batched_tokens": 4096, "watermark": 0.02, "token_budget": 256, "whole_prompt": False,
    "pd": None, "eta": 0.8, "max_batch_size": 8, "search": "anneal", "predictor": "gaussian", "prior_len": 100.0,
    "seed": 1, "t0": 50.0, "t_min": 10.0, "alpha": 0.5, "iters": 100, "max_entries": 1024, "exhaustive_max": 6,
    "history": None, "history_requests": 500, "length_error": 0.0, "preemptive": False, "quantum": 64,
    "multiplier": 3.0, "n_levels": 5, "starvation_ratio": 3.0, "oracle": True, "history_fraction": 0.3,
    "quantile": 0.8, "graph": "match", "order": "lsdf", "reserve": 0.2, "fairness": 0.5, "refresh_tokens": 64,
    "max_sl": 2, "mem_units": 16, "route_limit": 2, "backup": "reject", "admission": False, "dynamic_batch": False,
    "grid_step": 8, "tiers": None, "avg_decode_len": 100.0, "prefill_budget": 512, "remaining": "residual",
    "min_chunk": 16, "interval": 0.2, "admit_threshold": 0.2, "cv": 0.4, "monitor_interval": 2.0, "spread": 0.4,
    "window": 128, "offset_quantile": 0.4, "reject": "reject", "prefill_fraction": 0.4, "scale_interval": 2.0,
    "max_instances": 4, "cold_start": "d2d",
}
SAMPLE_BY_FAMILY = {("tempo", "predictor"): "qrf"}


def _sample(policy: str, key: str) -> object:
    return SAMPLE_BY_FAMILY.get((policy.split("-")[0], key), SAMPLE[key])


@pytest.mark.parametrize("name", list_policies())
def test_policy_params_are_exactly_what_make_policy_accepts(name):
    """Every listed key is accepted (with a valid value); every other key that some policy accepts is refused
    by name, so the list is neither too long nor too short over all keys the registry knows."""
    engine = get_engine("llama3-8b-h100")
    listed = policy_params(name)
    assert len(set(listed)) == len(listed) and "router" not in listed and "engine" not in listed
    for key in listed:
        make_policy(name, engine, **{key: _sample(name, key)})
    for key in sorted({k for p in list_policies() for k in policy_params(p)} - set(listed)):
        with pytest.raises((TypeError, ValueError), match=key):
            make_policy(name, engine, **{key: _sample(name, key)})


@pytest.mark.parametrize("policy, present, absent", [
    ("slos-serve", {"max_sl", "backup", "admission"}, {"state"}),
    ("polyserve-co", {"tiers", "prefill_budget", "interval"}, {"core", "token_budget"}),
    ("polyserve-co-chunk", {"token_budget"}, {"core", "interval"}),
    ("hyperflexis", {"admit_threshold", "max_num_seqs", "prefill_fraction"}, {"state", "pd", "scale_interval"}),
    ("rr-pd", {"prefill_fraction", "max_num_batched_tokens"}, {"inner"}),
    ("sarathi", {"token_budget", "whole_prompt"}, {"self"}),
])
def test_unknown_param_error_lists_what_the_policy_accepts(capsys, policy, present, absent):
    rc, out, err = run_cli(capsys, "simulate", "--policy", policy, "--param", "foo=1", "--requests", "5")
    assert rc == 2 and out == "" and "foo" in err
    accepted = err.rsplit("accepted: ", 1)[1].strip().split(", ")
    assert accepted == policy_params(policy)
    assert present <= set(accepted) and not absent & set(accepted)


def test_policies_json_lists_params(capsys):
    rows = json.loads(run_cli(capsys, "policies", "--json")[1])
    assert all(r["params"] == policy_params(r["name"]) for r in rows)


# ---- non-finite and non-integer parameter values -----------------------------------------------------------


@pytest.mark.parametrize("policy", ["edf", "sarathi", "autellix", "sjf", "tempo"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2.5, 0, True, "512"])
def test_token_budget_must_be_a_finite_integer(policy, value):
    with pytest.raises(ValueError, match=f"token_budget={value!r}"):
        make_policy(policy, None, token_budget=value)


def test_integer_valued_token_budget_is_an_int():
    assert make_policy("edf", None, token_budget=256.0, max_num_seqs=np.int64(8)).scheduler.token_budget == 256
    assert type(make_policy("edf", None, max_num_seqs=np.int64(8)).scheduler.max_num_seqs) is int


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity"])
def test_param_refuses_non_finite_numbers(capsys, raw):
    rc, out, err = run_cli(capsys, "simulate", "--policy", "edf", "--param", f"token_budget={raw}")
    assert rc == 2 and out == "" and f"token_budget={raw}" in err and "not a finite number" in err


# ---- profile records errors name the line ------------------------------------------------------------------


@pytest.mark.parametrize("column, value", [("time_s", -0.01), ("time_s", float("nan")), ("decode_ctx", -5)])
def test_profile_fit_bad_record_names_file_field_and_line(capsys, tmp_path, records_csv, column, value):
    df = pd.read_csv(records_csv)
    df.loc[6, column] = value  # data row 7: line 8 of the file, line 9 after the blank line below
    lines = df.to_csv(index=False).splitlines()
    path = tmp_path / "bad_records.csv"
    path.write_text("\n".join([*lines[:3], "", *lines[3:]]) + "\n")
    rc, out, err = run_cli(capsys, "profile", "fit", str(path), "--family", "quadratic", "--out",
                           str(tmp_path / "p.json"), "--kv-tokens", "1000")
    assert rc == 2 and out == ""
    assert str(path) in err and repr(column) in err and "line 9 " in err


def test_profile_fit_records_with_a_field_too_many_raise(capsys, tmp_path, records_csv):
    """Every row one field longer than the header: pandas would shift the columns under the header."""
    lines = records_csv.read_text().splitlines()
    path = tmp_path / "shifted.csv"
    path.write_text("\n".join([lines[0], *(f"0,{row}" for row in lines[1:])]) + "\n")
    rc, out, err = run_cli(capsys, "profile", "fit", str(path), "--family", "quadratic", "--out",
                           str(tmp_path / "p.json"), "--kv-tokens", "1000")
    assert rc == 2 and str(path) in err and "line 2 has more fields than the header" in err


# ---- trace skips in the summary, learned agents ------------------------------------------------------------


def test_simulate_reports_trace_skips(capsys, tmp_path):
    """BurstGPT failed requests (Response tokens = 0) are dropped by the reader; the summary counts them."""
    trace = tmp_path / "burst.csv"
    rows = [f"{i},ChatGPT,{100 + i},{0 if i in (3, 7) else 20 + i},0,Conversation log" for i in range(40)]
    trace.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "\n".join(rows))
    rc, out, err = run_cli(capsys, "simulate", "--trace", str(trace), "--json")
    s = json.loads(out)
    assert rc == 0 and err == ""
    assert s["trace_skipped"] == {"failed_request": 2} and s["n_requests"] == 38
    rc, out, _ = run_cli(capsys, "simulate", "--trace", str(trace))
    assert rc == 0 and "trace skipped     failed_request 2" in out
    rc, out, _ = run_cli(capsys, *RUN, "--json")
    assert "trace_skipped" not in json.loads(out)


@pytest.mark.parametrize("argv, bad", [
    (["--policy", "agent:nope"], "unknown agent 'nope'"),
    (["--policy", "agent:admission-coder"], "trained on scenario 'coder' with 1 instance(s)"),
    (["--policy", "agent:admission-coder", "--scenario", "coder", "--param", "token_budget=8"], "takes no --param"),
])
def test_simulate_agent_usage_errors(capsys, argv, bad):
    rc, out, err = run_cli(capsys, "simulate", *argv)
    assert rc == 2 and out == "" and bad in err


def test_simulate_runs_a_shipped_agent(capsys):
    pytest.importorskip("sb3_contrib")
    from slogym.agents import available

    if "admission-coder" not in available():
        pytest.skip("admission-coder checkpoint not shipped")
    rc, out, err = run_cli(capsys, "simulate", "--policy", "agent:admission-coder", "--scenario", "coder",
                           "--requests", "40", "--json")
    assert rc == 0 and json.loads(out)["n_requests"] == 40


def test_simulate_kv_gbps_sets_the_transfer_link(capsys: pytest.CaptureFixture[str]) -> None:
    tpot = {}
    for gbps in ("0.5", "3600"):
        rc, out, _ = run_cli(capsys, "simulate", "--scenario", "chatbot", "--policy", "distserve", "--pd", "1:1",
                             "--requests", "60", "--json", "--kv-gbps", gbps)
        assert rc == 0
        tpot[gbps] = json.loads(out)["tpot_p50"]
    assert tpot["0.5"] > tpot["3600"]
    rc, _, err = run_cli(capsys, "simulate", "--kv-gbps", "nan")
    assert rc == 2 and "--kv-gbps" in err

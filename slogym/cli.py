"""The ``slogym`` command line (see ``docs/cli.md``).

Subcommands: ``simulate`` (one run, printed summary or ``--json``, per-request Parquet with ``--out``),
``scenarios`` / ``policies`` / ``engines`` (what the names mean), ``profile fit`` (perf-model preset from
profile records). A usage error -- unknown name, bad value, unreadable file -- prints one line to stderr and exits
with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from slogym import __version__

PROG = "slogym"
FAMILY_ONLY = {"pieces": "roofline", "fixed": "analytic"}  # profile-fit flags that apply to one family


class UsageError(Exception):
    """A bad command line or input file: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """Reports parse errors as one line (instead of usage + message) so every usage error looks alike."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ---------------------------------------------------------------------------------------------- value parsing
def _bounded(cast: Callable[[str], float], low: float, strict: bool = False) -> Callable[[str], Any]:
    """argparse ``type=``: a finite ``cast`` value ``>= low`` (``> low`` if ``strict``)."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text!r}")
        return value

    return parse


def _slo(text: str) -> float | str:
    """argparse ``type=`` of ``--slo``: a float scale, else a preset name (checked by the scenario)."""
    try:
        return float(text)
    except ValueError:
        return text


def parse_value(raw: str) -> bool | int | float | str:
    """``true``/``false`` (any case) -> bool, then int, then finite float, else the string itself.

    ``nan``, ``inf`` and their spellings are refused (``ValueError``): no policy parameter means them, and a NaN
    passes every ``x < low`` range check."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            value = cast(raw)
        except ValueError:
            continue
        if not math.isfinite(value):
            raise ValueError(f"{raw!r} is not a finite number")
        return value
    return raw


def parse_params(items: Sequence[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: parse_value(value)}``."""
    params = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"bad --param {item!r}; expected key=value, e.g. token_budget=256")
        try:
            params[key] = parse_value(raw)
        except ValueError as e:
            raise UsageError(f"bad --param {item!r}: {e}") from None
    return params


def _check_choice(kind: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise UsageError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")


def json_safe(obj: Any) -> Any:
    """``obj`` with NumPy scalars as Python numbers, tuples as lists and NaN/inf as ``None``."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _print_json(obj: Any) -> None:
    print(json.dumps(json_safe(obj), allow_nan=False))


def _print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    for row in [list(columns), *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def _check_out_dir(path: str) -> None:
    if not Path(path).resolve().parent.is_dir():
        raise UsageError(f"--out {path!r}: directory {str(Path(path).parent)!r} does not exist")


def _load_engine(name: str) -> Any:
    """A shipped preset by name or a preset JSON file by path."""
    from slogym.engines.registry import get_engine, list_engines

    if name.endswith(".json") and not Path(name).is_file():
        raise UsageError(f"engine preset file not found: {name!r}")
    if not name.endswith(".json") and name not in list_engines():
        raise UsageError(f"unknown engine {name!r}; valid: {', '.join(list_engines())}, or a preset .json path")
    try:
        return get_engine(name)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"cannot load engine preset {name!r}: {e}") from None


# ---------------------------------------------------------------------------------------------- simulate
def _make_policy(name: str, engine: Any, router: str | None, params: dict[str, Any]) -> Any:
    from slogym.baselines import make_policy, policy_params

    try:
        return make_policy(name, engine, router=router, **params)
    except (TypeError, ValueError) as e:
        bad = ", ".join(f"{k}={v!r}" for k, v in params.items())
        raise UsageError(f"bad --param for policy {name!r} ({bad}): {e}; "
                         f"accepted: {', '.join(policy_params(name))}") from None


def _load_agent(policy: str, scenario: str, n_instances: int, params: dict[str, Any], router: str | None) -> Any:
    """A shipped learned agent ``agent:<name>`` as the leaderboard resolves it, on the scenario and cluster size it
    was trained for only (its observations fit nothing else)."""
    from slogym.leaderboard.board import agent_setting
    from slogym.leaderboard.sweep import RunSpec, make_policy_for

    if params or router is not None:
        raise UsageError(f"{policy} takes no --param or --router (its decisions are learned)")
    try:
        setting = agent_setting(policy)
    except ValueError as e:  # unknown agent: lists the shipped ones
        raise UsageError(str(e)) from None
    trained = (setting["scenario"], setting["n_instances"])
    if (scenario, n_instances) != trained:
        raise UsageError(f"{policy} was trained on scenario {trained[0]!r} with {trained[1]} instance(s); "
                         f"run it with --scenario {trained[0]} --instances {trained[1]}")
    try:
        return make_policy_for(RunSpec(policy, scenario, 0.0, 0, 0, n_instances=n_instances), None)
    except ImportError as e:
        raise UsageError(f"{policy} needs the rl extra (pip install 'slogym[rl]'): {e}") from None


def _read_trace(path: str) -> Any:
    """The ``--trace`` file read by :func:`~slogym.workloads.readers.read_trace` (``on_error="raise"``); the rows
    it still drops (BurstGPT's failed requests) are counted in ``Trace.skipped``, which the summary reports as
    ``trace_skipped``, instead of the reader's warning."""
    from slogym.workloads.readers import read_trace

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(f"{Path(path)}: "), category=UserWarning)
        return read_trace(path)


def _fmt(x: Any, scale: float = 1.0, spec: str = ".1f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x * scale, spec)


def _pct(x: float) -> str:
    return _fmt(x, 100.0) + "%"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def _shares(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {_pct(v)}" for k, v in d.items()) or "n/a"


def format_summary(s: dict[str, Any], header: str) -> str:
    """The human-readable report of a run summary (``RunResult.summary``)."""
    modes = " | ".join(f"{m} {_pct(v)}" for m, v in s["attainment_modes"].items())
    lat = [f"{'latency (ms)':<18}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}"]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT (mean/req)"), ("ttlt", "TTLT")):
        lat.append(f"  {label:<16}" + "".join(f"{_fmt(s[f'{key}_{q}'], 1e3):>10}"
                                             for q in ("p50", "p90", "p99", "mean")))
    rps = s.get("requests_per_wall_second")
    lines = [
        header,
        f"{'attainment':<18}{_pct(s['attainment'])} ({s['attainment_mode']})   [{modes}]",
        f"{'  by app':<18}{_shares(s['attainment_by_app'])}",
        f"{'  by tier':<18}{_shares(s['attainment_by_tier'])}",
        *lat,
        f"{'goodput':<18}{_fmt(s['goodput'], spec='.3f')} req/s",
        f"{'throughput':<18}{_fmt(s['throughput'], spec='.3f')} req/s, "
        f"{_fmt(s['token_throughput'])} tokens/s",
        f"{'service gain':<18}{_fmt(s['service_gain'])} ({_fmt(s['service_gain_rate'])}/s)",
        f"{'SA objective':<18}{_fmt(s['sa_objective'], spec='.4f')}",
        f"{'cost':<18}{_fmt(s['cost_instance_seconds'])} instance-seconds "
        f"(utilization {_pct(s['utilization'])}; {_fmt(s.get('cost_per_request'), spec='.3f')} per served request)",
        *([f"{'KV transfers':<18}{s['kv_transfers']}"] if s.get("pd") else []),
        *([f"{'trace skipped':<18}{_counts(s['trace_skipped'])}"] if "trace_skipped" in s else []),
        f"{'outcomes':<18}{_counts(s['outcomes'])}",
        f"{'dropped reasons':<18}{_counts(s['dropped_reasons'])}",
        f"{'preemptions':<18}{s['preemptions']} ({s['recomputed_tokens']} tokens recomputed)",
        f"{'simulated':<18}{_fmt(s['sim_seconds'])} s, {s['iterations']} iterations "
        f"({s['ff_iterations']} fast-forwarded, {s['pilot_iterations']} compiled)",
        f"{'wall time':<18}{_fmt(s['wall_seconds'], spec='.2f')} s "
        f"({_fmt(rps, spec='.0f')} simulated requests per wall second)",
    ]
    return "\n".join(lines)


def _pd_split(text: str) -> tuple[int, int]:
    """``P:D`` -> (P, D), both >= 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D (e.g. 2:1), got {text!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"needs at least one prefill and one decode instance, got {text!r}")
    return p, d


def _cluster_size(args: argparse.Namespace) -> int:
    if args.pd is None:
        return 1 if args.instances is None else args.instances
    if args.instances is not None and args.instances != sum(args.pd):
        raise UsageError(f"--instances {args.instances} disagrees with --pd {args.pd[0]}:{args.pd[1]} "
                         f"({sum(args.pd)} instances)")
    return sum(args.pd)


def cmd_simulate(args: argparse.Namespace) -> int:
    from slogym.baselines import ROUTERS, list_policies
    from slogym.core.cluster import KVTransfer
    from slogym.core.simulator import Simulator
    from slogym.workloads.scenarios import SCENARIOS, list_scenarios, make_workload

    _check_choice("scenario", args.scenario, list_scenarios())
    agent = args.policy.startswith("agent:")
    if not agent:
        _check_choice("policy", args.policy, list_policies())
    if args.router is not None:
        _check_choice("router", args.router, list(ROUTERS))
    params = parse_params(args.param)
    if args.trace is not None and not Path(args.trace).is_file():
        raise UsageError(f"trace file not found: {args.trace!r}")
    if args.out is not None:
        _check_out_dir(args.out)
    engine = _load_engine(args.engine)
    if agent:
        if args.pd is not None:
            raise UsageError(f"{args.policy} runs on the colocated cluster it was trained on, not with --pd")
        policy = _load_agent(args.policy, args.scenario, _cluster_size(args), params, args.router)
    else:
        policy = _make_policy(args.policy, engine, args.router, params)
    try:
        trace = None if args.trace is None else _read_trace(args.trace)
        workload = make_workload(args.scenario, rate=args.rate, n_requests=args.requests, duration=args.duration,
                                 seed=args.seed, trace=trace, slo=args.slo, engine=engine)
    except (OSError, ValueError) as e:  # TraceFormatError is a ValueError naming file, row and field
        raise UsageError(str(e).splitlines()[0]) from None

    n_inst = _cluster_size(args)
    note = ""
    if args.pd is not None and not policy.router.pd_aware:
        # a router of colocated replicas would send new requests to decode instances
        from slogym.core.policy import SingleOrRoundRobin

        note = f" | router round-robin over prefill instances ({type(policy.router).__name__} is not PD-aware)"
        policy.router = SingleOrRoundRobin()
    progress = not (args.json or args.no_progress) and sys.stderr.isatty()
    sim = Simulator(workload, engine, policy, n_inst, pd=args.pd, seed=args.seed, attainment=args.attainment,
                    progress=progress, transfer=KVTransfer(bandwidth_gbps=args.kv_gbps))
    result = sim.run().result()
    if args.out is not None:
        result.to_parquet(args.out)
    summary = result.summary | ({} if trace is None else {"trace_skipped": dict(trace.skipped)})
    if args.json:
        _print_json(summary)
        return 0
    if args.rate is not None:
        rate = f"{args.rate:g} req/s"
    else:
        rate = "trace timestamps" if args.trace else f"{SCENARIOS[args.scenario].default_rate:g} req/s (default)"
    source = f" (trace {args.trace})" if args.trace else ""
    shape = f"{n_inst} x {engine.name}" + (f" (PD {args.pd[0]}:{args.pd[1]})" if args.pd else "")
    header = (f"{args.scenario}{source} | policy {args.policy} | {shape}{note} | rate {rate} | "
              f"{len(workload)} requests | seed {args.seed}")
    print(format_summary(summary, header))
    if args.out is not None:
        print(f"{'records':<18}{args.out} ({len(result.records)} rows)")
    return 0


# ---------------------------------------------------------------------------------------------- listings
def cmd_scenarios(args: argparse.Namespace) -> int:
    from slogym.workloads.scenarios import SCENARIOS

    rows = [{"name": s.name, "description": s.description, "default_rate": s.default_rate,
             "default_requests": s.default_n, "slo_presets": list(s.slo_presets), "source": s.source}
            for s in SCENARIOS.values()]
    if args.json:
        _print_json(rows)
    else:
        _print_table(rows, ("name", "default_rate", "description", "source"))
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from slogym.baselines import POLICY_DESCRIPTIONS, policy_params

    rows = [{"name": k, "description": v, "params": policy_params(k)} for k, v in POLICY_DESCRIPTIONS.items()]
    if args.json:
        _print_json(rows)
    else:
        _print_table(rows, ("name", "description"))
    return 0


def _engine_source(provenance: dict[str, Any]) -> str:
    """Where a preset's numbers come from: an explicit source, else the profile it was fitted on."""
    fit = provenance.get("fit")
    fitted_on = fit.get("fitted_on") if isinstance(fit, dict) else None
    return str(provenance.get("source") or fitted_on or provenance.get("profile") or "unknown")


def cmd_engines(args: argparse.Namespace) -> int:
    from slogym.engines.registry import get_engine, list_engines

    rows = []
    for name in list_engines():
        e = get_engine(name)
        rows.append({"name": name, "model": e.model, "gpu": e.gpu, "tp": e.tp, "family": e.perf.family,
                     "kv_tokens": e.kv_capacity_tokens, "source": _engine_source(e.provenance)})
    if args.json:
        _print_json(rows)
    else:
        _print_table(rows, ("name", "model", "gpu", "tp", "family", "kv_tokens", "source"))
    return 0


# ---------------------------------------------------------------------------------------------- profile
def cmd_profile_fit(args: argparse.Namespace) -> int:
    from slogym.engines.fitting import fit_profile
    from slogym.engines.perf_models import AnalyticPerf

    for flag, family in FAMILY_ONLY.items():
        if getattr(args, flag) is not None and args.family != family:
            raise UsageError(f"--{flag} applies to --family {family} only, not {args.family!r}")
    if args.holdout >= 1.0:
        raise UsageError(f"--holdout must be < 1, got {args.holdout!r}")
    if not Path(args.records).is_file():
        raise UsageError(f"records file not found: {args.records!r}")
    _check_out_dir(args.out)
    base = _load_engine(args.base) if args.base else None
    options: dict[str, Any] = {} if args.pieces is None else {"pieces": args.pieces}
    meta = ({"model": "unknown", "gpu": "unknown", "tp": 1, "kv_capacity_tokens": None, "kv_bytes_per_token": 0}
            if base is None else {k: getattr(base, k) for k in
                                  ("model", "gpu", "tp", "kv_capacity_tokens", "kv_bytes_per_token")})
    given = {"model": args.model, "gpu": args.gpu, "tp": args.tp, "kv_capacity_tokens": args.kv_tokens,
             "kv_bytes_per_token": args.kv_bytes_per_token}
    meta |= {k: v for k, v in given.items() if v is not None}
    profiled = _read_profile_limits(args.records)
    if profiled is not None and args.kv_tokens is None:
        meta["kv_capacity_tokens"] = profiled["kv_capacity_tokens"]
    if meta["kv_capacity_tokens"] is None:
        raise UsageError("--kv-tokens is required without --base or a profile sidecar (the preset's KV capacity "
                         "in tokens)")
    if args.family == "analytic":
        if base is None or base.perf.family != "analytic":
            raise UsageError("--family analytic needs --base ENGINE, an analytic preset whose architecture and "
                             "GPU numbers seed the fit (e.g. --base llama3-8b-h100)")
        fixed = tuple(x for x in (args.fixed or "").split(",") if x)
        for name in fixed:
            _check_choice("--fixed parameter", name, AnalyticPerf.fit_names)
        options |= {"init": base.perf.params() | {"tp": float(meta["tp"])}, "fixed": fixed}
    try:
        preset = fit_profile(args.records, args.family, engine_name=args.name or Path(args.out).stem,
                             holdout=args.holdout, seed=args.seed, **meta, **options)
    except (OSError, ValueError) as e:
        raise UsageError(f"{args.records}: {e}") from None
    # batch limits: the flags, else the profiled engine's (the records' sidecar), else --base's
    sources = (("flag", {k: getattr(args, k) for k in PROFILE_LIMITS}), ("profile", profiled or {}),
               ("base", {} if base is None else {k: getattr(base, k) for k in PROFILE_LIMITS}))
    limits = {k: next(((int(vals[k]), src) for src, vals in sources if vals.get(k) is not None), None)
              for k in PROFILE_LIMITS}
    limits = {k: v for k, v in limits.items() if v is not None}
    preset.update({k: v for k, (v, _) in limits.items()})
    preset["provenance"]["limits"] = {k: src for k, (_, src) in limits.items()}
    Path(args.out).write_text(json.dumps(json_safe(preset), indent=1) + "\n")
    report = preset["provenance"]["fit"]
    if args.json:
        _print_json(report | {"out": args.out, "limits": {k: v for k, (v, _) in limits.items()}})
        return 0
    print(f"fitted {report['family']} on {report['n_train']} of {report['n_rows']} rows "
          f"({report['n_holdout']} held out)")
    print(f"train MAPE     {report['train_mape_pct']:.2f}%")
    held = report["holdout_mape_pct"]
    print(f"held-out MAPE  {held:.2f}%" if held is not None else "held-out MAPE  n/a (no rows held out: --holdout 0)")
    if limits:
        print("limits         " + ", ".join(f"{k}={v} ({src})" for k, (v, src) in limits.items()))
    print(f"wrote {args.out} (use it with --engine {args.out})")
    return 0


PROFILE_LIMITS = ("block_size", "max_num_seqs", "max_num_batched_tokens")


def profile_limits_path(records: str | Path) -> Path:
    """The sidecar ``slogym profile run`` writes beside its records: ``X.csv`` -> ``X.engine.json``, the
    profiled engine's KV pool and batch limits (read by ``slogym profile fit``)."""
    return Path(records).with_suffix(".engine.json")


def _read_profile_limits(records: str | Path) -> dict[str, Any] | None:
    path = profile_limits_path(records)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return {k: int(data[k]) for k in (*PROFILE_LIMITS, "kv_capacity_tokens")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a profile sidecar with {PROFILE_LIMITS} and kv_capacity_tokens ({e})") \
            from None


def cmd_profile_run(args: argparse.Namespace) -> int:
    """Sweep batch compositions on a live vLLM engine and write profile records (see docs/live_engine.md)."""
    from slogym.engines.live import EngineConfig, EngineError, VLLMEngine, make_tiny_model, vllm_unavailable_reason
    from slogym.engines.profiler import ProfileGrid, check_visits, profile

    _check_out_dir(args.out)
    try:  # profiler.profile's visit rule, checked before the engine starts
        check_visits(args.repeats, args.warmup, args.measure)
    except ValueError as e:
        raise UsageError(f"--repeats / --warmup / --measure: {e}") from None
    reason = vllm_unavailable_reason()
    if reason is not None:
        raise UsageError(reason)
    model = Path(args.model)
    if args.make_tiny:
        try:
            make_tiny_model(model)
        except ValueError as e:  # an unreadable config.json or a model of another architecture there
            raise UsageError(f"--make-tiny: {e}") from None
        except (EngineError, OSError) as e:
            print(f"{PROG}: --make-tiny: {e}", file=sys.stderr)
            return 1
    elif not (model / "config.json").is_file():
        raise UsageError(f"--model {args.model!r}: no config.json there (pass --make-tiny to build a tiny "
                         "random-weight model in that directory)")
    try:
        cfg = EngineConfig(model=str(model), block_size=args.block_size, num_blocks=args.blocks,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.max_model_len, step_timeout=args.step_timeout,
                           timing=args.timing)
    except ValueError as e:
        raise UsageError(str(e)) from None
    grid = ProfileGrid.app_a(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_blocks * cfg.block_size,
                             cfg.max_model_len, quick=args.quick)
    say = (lambda m: print(m, file=sys.stderr)) if not args.json and sys.stderr.isatty() else None
    try:
        with VLLMEngine(cfg) as engine:
            df = profile(engine, grid, repeats=args.repeats, warmup=args.warmup, progress=say,
                         warm=args.warm_shapes, measure=args.measure)
    except EngineError as e:
        print(f"{PROG}: engine error: {e}", file=sys.stderr)
        return 1
    if args.median:
        from slogym.engines.profiler import aggregate

        df = aggregate(df)
    df.to_csv(args.out, index=False)
    kv_tokens = cfg.num_blocks * cfg.block_size
    sidecar = profile_limits_path(args.out)  # the profiled engine, for 'profile fit' (PROFILE_LIMITS)
    sidecar.write_text(json.dumps({"engine": "vllm", "vllm": engine.info.get("vllm"), "model": str(model),
                                   "timing": cfg.timing, "kv_capacity_tokens": kv_tokens, "num_blocks": cfg.num_blocks,
                                   "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
                                   "max_num_batched_tokens": cfg.max_num_batched_tokens,
                                   "max_model_len": cfg.max_model_len}, indent=1) + "\n")
    report = {"out": args.out, "limits": str(sidecar), "rows": len(df), "points": len(grid), "kv_tokens": kv_tokens,
              "median_time_s": {k: float(v) for k, v in df.groupby("kind")["time_s"].median().items()}}
    if args.json:
        _print_json(report)
        return 0
    print(f"measured {len(df)} iterations over {len(grid)} batch compositions; wrote {args.out} and {sidecar} "
          "(the engine's KV pool and batch limits)")
    print(f"fit it: slogym profile fit {args.out} --family quadratic --out PRESET.json")
    return 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from slogym.leaderboard import (QUICK_POLICIES, QUICK_SCENARIOS, BoardConfig, build, default_policies,
                                    shipped_agents)
    from slogym.workloads.scenarios import list_scenarios

    scenarios = (_name_list("--scenarios", args.scenarios) if args.scenarios is not None
                 else list(QUICK_SCENARIOS) if args.quick else list_scenarios())
    policies = (_name_list("--policies", args.policies) if args.policies is not None
                else list(QUICK_POLICIES) + shipped_agents() if args.quick else default_policies())
    for sc in scenarios:
        _check_choice("scenario", sc, list_scenarios())
    for pol in policies:
        _check_choice("policy", pol, list(dict.fromkeys(default_policies() + _all_policy_names())))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out!r} is a file; expected a directory (created if missing)")
    if args.trace is not None:
        if not Path(args.trace).is_file():
            raise UsageError(f"trace file not found: {args.trace!r}")
        try:
            _read_trace(args.trace)
        except (OSError, ValueError) as e:  # TraceFormatError is a ValueError naming file, row and field
            raise UsageError(str(e).splitlines()[0]) from None
    engine = _load_engine(args.engine)
    cfg = (BoardConfig.quick if args.quick else BoardConfig.full)(scenarios, policies)
    if args.seeds is not None:
        cfg.seeds = list(range(args.seeds))
    if args.requests is not None:
        cfg.n_requests = args.requests
    cfg.engine = args.engine if args.engine.endswith(".json") else engine.name
    cfg.trace = args.trace
    try:
        with warnings.catch_warnings():  # the board's warnings (a short trace) as one line each
            warnings.showwarning = lambda message, *_a, **_k: print(f"{PROG}: warning: {message}", file=sys.stderr)
            _, _, md = build(cfg, out, workers=args.workers, ray=args.ray or bool(args.ray_address),
                             ray_address=args.ray_address, progress=not args.no_progress and sys.stderr.isatty())
    except KeyboardInterrupt:
        print(f"interrupted: completed runs are cached in {args.out}/cache; run the same command to resume",
              file=sys.stderr)
        return 130
    print(md)
    print(f"written: {args.out}/leaderboard.md, runs.parquet, runs.csv, capacity.csv, meta.json, attainment_*.png")
    return 0


def _name_list(option: str, text: str) -> list[str]:
    """A comma-separated list of names, duplicates dropped (first kept); an empty list or name is an error."""
    names = [n.strip() for n in text.split(",")]
    if not any(names):
        raise UsageError(f"{option} is empty; give comma-separated names or leave the option out for the default")
    if "" in names:
        raise UsageError(f"{option} {text!r} has an empty name")
    return list(dict.fromkeys(names))


def _all_policy_names() -> list[str]:
    from slogym.baselines import list_policies

    return list_policies()


# ---------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The full ``slogym`` argument parser."""
    import slogym.engines.perf_models  # noqa: F401  (registers the perf-model families)
    from slogym.core.simulator import ATTAINMENT_MODES
    from slogym.engines.base import PERF_FAMILIES

    p = _Parser(prog=PROG, description="Gymnasium environments and a fast simulator for multi-SLO LLM serving.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("simulate", help="run one policy on one scenario and print the summary",
                       description="Run one policy on one scenario and print attainment, latency, goodput, cost.")
    s.add_argument("--scenario", default="chatbot", metavar="NAME",
                   help="scenario name (slogym scenarios); default chatbot")
    s.add_argument("--policy", default="vllm", metavar="NAME", help="policy name (slogym policies); default vllm")
    s.add_argument("--engine", default="llama3-8b-h100", metavar="NAME",
                   help="engine preset name (slogym engines) or preset .json path; default llama3-8b-h100")
    s.add_argument("--rate", type=_bounded(float, 0.0, strict=True), metavar="R",
                   help="requests/s; drives the generator or rescales the trace (default: scenario's rate, "
                        "or the trace's own timestamps)")
    s.add_argument("--trace", metavar="FILE", help="trace file (azure, burstgpt, mooncake, length table)")
    n = s.add_mutually_exclusive_group()
    n.add_argument("--requests", type=_bounded(int, 1), metavar="N", help="number of requests (default: scenario's)")
    n.add_argument("--duration", type=_bounded(float, 0.0, strict=True), metavar="S", help="seconds of arrivals")
    s.add_argument("--instances", type=_bounded(int, 1), default=None, metavar="N",
                   help="number of replicas; default 1 (or P + D with --pd)")
    s.add_argument("--pd", type=_pd_split, metavar="P:D",
                   help="prefill/decode disaggregation: P prefill and D decode instances (docs/cluster.md)")
    s.add_argument("--kv-gbps", type=_bounded(float, 0.0, strict=True), default=100.0, metavar="G",
                   help="KV-transfer link of P/D disaggregation, Gb/s per GPU; default 100 (NVLink ~3600)")
    s.add_argument("--seed", type=_bounded(int, 0), default=0, metavar="N", help="random seed; default 0")
    s.add_argument("--router", metavar="NAME", help="override the policy's router: round-robin, random, least-load")
    s.add_argument("--attainment", choices=ATTAINMENT_MODES, default="dslo",
                   help="SLO judging mode; default dslo")
    s.add_argument("--slo", type=_slo, default="paper", metavar="PRESET|SCALE",
                   help="SLO preset (paper, tight, loose) or a float scale; default paper")
    s.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="policy parameter, repeatable (values parsed as bool, int, float, else string)")
    s.add_argument("--out", metavar="FILE", help="write one row per request to this Parquet file")
    s.add_argument("--json", action="store_true", help="print the summary as one JSON object, nothing else")
    s.add_argument("--no-progress", action="store_true", help="no progress bar (it goes to stderr, TTY only)")
    s.set_defaults(func=cmd_simulate)

    for name, func, what in (("scenarios", cmd_scenarios, "scenario presets"),
                             ("policies", cmd_policies, "baseline policies and routers"),
                             ("engines", cmd_engines, "shipped engine presets")):
        c = sub.add_parser(name, help=f"list {what}", description=f"List the {what}.")
        c.add_argument("--json", action="store_true", help="print a JSON array of objects")
        c.set_defaults(func=func)

    prof = sub.add_parser("profile", help="fit perf-model presets from profile records",
                          description="Build engine presets from profiled iterations.")
    psub = prof.add_subparsers(dest="profile_command", required=True, metavar="ACTION")
    f = psub.add_parser("fit", help="fit a perf-model family to a records CSV and write a preset JSON",
                        description="Fit a perf-model family to profile records (one row per iteration: "
                                    "BatchFeatures columns + time_s) and write an engine preset.")
    f.add_argument("records", metavar="RECORDS.csv", help="one row per measured iteration")
    f.add_argument("--family", required=True, choices=sorted(PERF_FAMILIES) + ["auto"],
                   help="perf-model family to fit (auto: every family of fitting.AUTO_FAMILIES, lowest held-out MAPE)")
    f.add_argument("--out", required=True, metavar="PRESET.json", help="where to write the preset")
    f.add_argument("--name", help="preset name (default: the --out file's stem)")
    f.add_argument("--base", metavar="ENGINE",
                   help="preset whose model, gpu, tp, KV and batch limits the new one inherits (required for "
                        "--family analytic: its architecture/GPU numbers and starting values)")
    f.add_argument("--model", help="model name (default: --base's, else unknown)")
    f.add_argument("--gpu", help="GPU name (default: --base's, else unknown)")
    f.add_argument("--tp", type=_bounded(int, 1), metavar="N",
                   help="tensor-parallel degree (default: --base's, else 1)")
    f.add_argument("--kv-tokens", type=_bounded(int, 1), metavar="N",
                   help="KV capacity in tokens (default: the profiled engine's from the records' .engine.json "
                        "sidecar, else --base's; required without either)")
    f.add_argument("--kv-bytes-per-token", type=_bounded(int, 0), metavar="B",
                   help="KV bytes per token (default: --base's)")
    f.add_argument("--holdout", type=_bounded(float, 0.0), default=0.2, metavar="F",
                   help="fraction of rows held out for the reported error; default 0.2")
    f.add_argument("--seed", type=_bounded(int, 0), default=0, metavar="N", help="seed of the holdout split; default 0")
    f.add_argument("--pieces", type=_bounded(int, 1), metavar="K", help="roofline: number of lines (default 2)")
    f.add_argument("--fixed", metavar="NAMES", help="analytic: comma-separated fit parameters kept at --base's")
    for flag, what in (("--block-size", "tokens per KV block"), ("--max-num-seqs", "batch size limit"),
                       ("--max-num-batched-tokens", "token budget per iteration")):
        f.add_argument(flag, type=_bounded(int, 1), metavar="N",
                       help=f"{what} of the preset (default: the profiled engine's, from the records' .engine.json "
                            "sidecar that 'profile run' writes, else --base's, else the preset default)")
    f.add_argument("--json", action="store_true", help="print the fit report as one JSON object")
    f.set_defaults(func=cmd_profile_fit)
    lb = sub.add_parser("leaderboard", help="every policy on every scenario: serving capacity, metrics, plots",
                        description="Run the leaderboard (cached, resumable) and write leaderboard.md, runs.parquet, "
                                    "runs.csv, capacity.csv, meta.json and attainment plots to --out.")
    lb.add_argument("--out", required=True, metavar="DIR", help="output directory (also holds the run cache)")
    lb.add_argument("--quick", action="store_true",
                    help="4 representative scenarios, 1 seed, >= 200 requests and 15 s per run, 3 bisection steps")
    lb.add_argument("--scenarios", metavar="A,B", help="comma-separated scenarios (default: all; --quick: 4)")
    lb.add_argument("--policies", metavar="A,B",
                    help="comma-separated policies (default: every scheduling policy; --quick: one per family)")
    lb.add_argument("--seeds", type=_bounded(int, 1), metavar="N", help="seeds 0..N-1 (default 1 quick, 3 full)")
    lb.add_argument("--requests", type=_bounded(int, 1), metavar="N", help="requests per run")
    lb.add_argument("--engine", default="llama3-8b-h100", metavar="NAME", help="engine preset; default llama3-8b-h100")
    lb.add_argument("--trace", metavar="FILE", help="replay this trace (with each scenario's SLOs) instead")
    lb.add_argument("--workers", type=_bounded(int, 1), default=2, metavar="N", help="local processes; default 2")
    lb.add_argument("--ray", action="store_true", help="run the sweep as Ray tasks (local Ray with 2 CPUs)")
    lb.add_argument("--ray-address", metavar="ADDR", help="run on this Ray cluster (implies --ray)")
    lb.add_argument("--no-progress", action="store_true", help="no progress bar")
    lb.set_defaults(func=cmd_leaderboard)
    r = psub.add_parser("run", help="profile a live vLLM engine into a records CSV",
                        description="Sweep batch compositions (HyperFlexis App. A grid) on a live vLLM engine "
                                    "and write one row per measured iteration (BatchFeatures + time_s), the "
                                    "input of 'slogym profile fit'.")
    r.add_argument("--engine", choices=["vllm"], default="vllm", help="live engine kind; default vllm")
    r.add_argument("--model", required=True, metavar="DIR", help="local model directory (no downloads)")
    r.add_argument("--make-tiny", action="store_true",
                   help="first build a tiny random-weight Llama model in DIR (kept if already there)")
    r.add_argument("--out", required=True, metavar="RECORDS.csv", help="where to write the records")
    r.add_argument("--quick", action="store_true", help="every other grid value (a smoke-sized sweep)")
    r.add_argument("--repeats", type=_bounded(int, 1), default=3, metavar="N",
                   help="passes over the grid (shuffled), one measured iteration per composition each; default 3")
    r.add_argument("--median", action="store_true",
                   help="write one row per composition with the median time of its repeats (robust fits)")
    r.add_argument("--warmup", type=_bounded(int, 0), default=2, metavar="N",
                   help="unmeasured iterations before each composition; default 2")
    r.add_argument("--blocks", type=_bounded(int, 1), default=256, metavar="N", help="KV blocks; default 256")
    r.add_argument("--block-size", type=_bounded(int, 1), default=32, metavar="N",
                   help="tokens per KV block (a multiple of 32 on CPU); default 32")
    r.add_argument("--max-num-seqs", type=_bounded(int, 1), default=64, metavar="N", help="default 64")
    r.add_argument("--max-num-batched-tokens", type=_bounded(int, 1), default=2048, metavar="N", help="default 2048")
    r.add_argument("--max-model-len", type=_bounded(int, 1), default=2048, metavar="N", help="default 2048")
    r.add_argument("--warm-shapes", action="store_true",
                   help="first run one batch of every token count up to --max-num-batched-tokens (vLLM's CPU path "
                        "pays a one-time cost per new batch shape)")
    r.add_argument("--timing", choices=["wall", "cpu", "norm"], default="wall",
                   help="record the wall time of each engine step, its CPU time (single-threaded engine on a "
                        "shared machine: the time without the OS running other work), or that CPU time scaled to "
                        "the machine's quiet speed by a reference computation timed around each step (norm, the "
                        "most stable on a loaded machine); default wall")
    r.add_argument("--measure", type=_bounded(int, 1), default=1, metavar="K",
                   help="record the median of K back-to-back iterations per visit of a composition; default 1")
    r.add_argument("--step-timeout", type=_bounded(float, 0.0, strict=True), default=60.0, metavar="S",
                   help="seconds before a hung engine step is an error; default 60")
    r.add_argument("--json", action="store_true", help="print a JSON report")
    r.set_defaults(func=cmd_profile_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``slogym``; returns the exit status."""
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0)
        return args.func(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Calibrate every scenario's ``default_rate``: serving capacity of Sarathi and vLLM on one engine replica.

Capacity (SLOs-Serve §6, "Metric"): the highest request rate with >= ``--target`` (0.9) SLO attainment, here in
the simulator's default ``dslo`` mode, averaged over ``--seeds``. It is found per (scenario, policy) by
bracketing (doubling / halving from the scenario's current default) and then geometric bisection until the
bracket is within ``--tol`` (relative). Seeds are common random numbers across rates: the arrival processes
scale exactly with the rate, so attainment is (nearly) monotone in the rate.

The proposed default is ``--fraction`` (0.8) x the better of the two capacities, rounded to 2 significant
digits, and the table shows both policies' attainment (and utilization) there.

A scenario whose attainment stays below the target even at ``rate_min`` has no capacity ("pathological"): the
script then also reports, as a diagnosis, the capacity with Poisson arrivals and, when the Azure trace the
scenario's arrival pattern fingerprints is available (``--trace-dir``), with the real trace timestamps
time-scaled to the rate (what SLOs-Serve does); the default falls back to the trace-replay capacity (Poisson
when no trace is found). See docs/scenarios.md "Calibration".

    .venv/bin/python scripts/calibrate_scenarios.py        # all scenarios, 2 seeds x default_n requests
    .venv/bin/python scripts/calibrate_scenarios.py --scenarios coder toolllm --json out.json
    .venv/bin/python scripts/calibrate_scenarios.py --arrival-stats   # fingerprints vs the real traces
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from slogym.baselines import make_policy
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads import arrivals as arr
from slogym.workloads.scenarios import SCENARIOS, make_workload

ROOT = Path(__file__).resolve().parent.parent
TRACE_FILES = {"code": "azure_code_2023.csv.gz", "chat": "azure_conv_2023.csv.gz"}


def round_sig(x: float, sig: int = 2) -> float:
    if x <= 0 or not math.isfinite(x):
        return 0.0
    return float(f"{x:.{sig}g}")


def _trace_times(path: Path) -> np.ndarray:
    import pandas as pd

    ts = pd.to_datetime(pd.read_csv(path, usecols=["TIMESTAMP"])["TIMESTAMP"]).astype("int64").to_numpy()
    return np.sort(ts / 1e9)


def n_for(cfg: dict[str, Any], scenario: str, rate: float) -> int:
    """Arrivals per run: ``--n`` (default: the scenario's ``default_n``, what ``slogym simulate`` runs), raised
    so that a run spans at least ``--min-duration`` s (else a short burst of a high rate drains within loose
    SLOs and fakes capacity), capped at ``--max-n``."""
    n = cfg["n"] or SCENARIOS[scenario].default_n
    return int(min(max(n, math.ceil(rate * cfg["min_duration"])), max(cfg["max_n"], n)))


def run_one(cfg: dict[str, Any], scenario: str, policy: str, rate: float, seed: int) -> dict[str, float]:
    """One simulation; ``cfg['arrival']`` is "scenario", "poisson" or a trace path (time-scaled replay)."""
    eng = get_engine(cfg["engine"])
    n = n_for(cfg, scenario, rate)
    w = make_workload(scenario, rate=rate, n_requests=n, seed=seed, engine=eng)
    mode = cfg.get("arrival", "scenario")
    if mode != "scenario":
        if len(w) != n:
            raise ValueError(f"{scenario}: arrival override needs one workload row per arrival")
        if mode == "poisson":
            t = arr.poisson(rate, n=n, rng=np.random.default_rng([seed, 7]))
        else:
            full = arr.replay(_trace_times(Path(mode)), rate)
            off = (seed * 2 * n) % max(full.size - n, 1)  # disjoint window per seed
            t = full[off:off + n] - full[off]
        w.arrival[:] = t
    pol = make_policy(policy, eng)
    sim = Simulator(w, eng, pol, seed=seed)
    sim.run()
    s = sim.result().summary
    return {"attainment": float(s["attainment"]), "utilization": float(s["utilization"])}


def measure(cfg: dict[str, Any], scenario: str, policy: str, rate: float) -> dict[str, float]:
    rs = [run_one(cfg, scenario, policy, rate, seed) for seed in cfg["seeds"]]
    return {k: float(np.mean([r[k] for r in rs])) for k in rs[0]}


def capacity(cfg: dict[str, Any], scenario: str, policy: str) -> dict[str, Any]:
    """Highest rate with mean attainment >= target (bracket, then geometric bisection)."""
    target, tol = cfg["target"], cfg["tol"]
    probes: dict[float, float] = {}

    def ok(r: float) -> bool:
        if r not in probes:
            probes[r] = measure(cfg, scenario, policy, r)["attainment"]
        return probes[r] >= target

    t0 = time.perf_counter()
    r = float(cfg.get("start") or SCENARIOS[scenario].default_rate)
    if ok(r):
        lo, hi = r, 2 * r
        while ok(hi):
            lo, hi = hi, 2 * hi
            if hi > cfg["rate_max"]:
                break
    else:
        lo, hi = r / 2, r
        while not ok(lo):
            if lo < cfg["rate_min"]:
                return {"capacity": 0.0, "probes": probes, "seconds": time.perf_counter() - t0,
                        "note": f"attainment < {target} at {lo:.3g} req/s"}
            lo, hi = lo / 2, lo
    while hi / lo > 1 + tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"capacity": lo, "probes": probes, "seconds": time.perf_counter() - t0, "note": ""}


def _cap_task(args: tuple) -> tuple:
    cfg, scenario, policy = args
    return scenario, policy, cfg.get("arrival", "scenario"), capacity(cfg, scenario, policy)


def _at_task(args: tuple) -> tuple:
    cfg, scenario, policy, rate = args
    return scenario, policy, measure(cfg, scenario, policy, rate)


def arrival_stats(trace_dir: Path, seeds: int = 16) -> None:
    """Statistics (``arrivals.gap_statistics``, plus the most arrivals in any 100 ms window) of each arrival
    fingerprint at its trace's own rate, mean over ``seeds`` runs of one trace length, next to the embedded
    reference and, where the trace is available, the real trace."""
    keys = list(arr.REFERENCE_KEYS) + ["max_in_100ms"]

    def stats(t: np.ndarray) -> dict[str, float]:
        s = arr.gap_statistics(t)
        s["max_in_100ms"] = float(np.bincount(((t - t[0]) / 0.1).astype(np.int64)).max())
        return s

    for name, p in arr.PATTERNS.items():
        cols: dict[str, dict[str, float]] = {"reference": dict(p.reference)}
        tf = trace_dir / TRACE_FILES[name]
        if tf.is_file():
            cols["real trace"] = stats(_trace_times(tf))
        n = int(round(p.trace_rate * 3440))
        runs = [stats(arr.pattern(name, p.trace_rate, n=n, rng=s)) for s in range(seeds)]
        cols[f"model (mean of {seeds})"] = {k: float(np.mean([r[k] for r in runs])) for k in keys}
        print(f"{name}: {p.source}; model {type(p).__name__}")
        print(f"  {'statistic':<16}" + "".join(f"{c:>20}" for c in cols))
        for k in keys:
            print(f"  {k:<16}" + "".join(f"{c[k]:>20.4g}" if k in c else f"{'-':>20}" for c in cols.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="llama3-8b-h100")
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS))
    ap.add_argument("--policies", nargs="*", default=["sarathi", "vllm"])
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--n", type=int, default=None, help="user-level arrivals per run (default: default_n)")
    ap.add_argument("--min-duration", type=float, default=60.0, help="raise n so a run spans this many s")
    ap.add_argument("--max-n", type=int, default=8000)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--tol", type=float, default=0.05, help="relative width of the final bracket")
    ap.add_argument("--fraction", type=float, default=0.8, help="default rate = fraction x best capacity")
    ap.add_argument("--rate-min", type=float, default=0.01)
    ap.add_argument("--rate-max", type=float, default=1000.0)
    ap.add_argument("--trace-dir", default=str(ROOT.parent / "shared" / "traces"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--arrival-stats", action="store_true",
                    help="only print the arrival fingerprints' statistics vs the real traces")
    a = ap.parse_args(argv)
    if a.arrival_stats:
        arrival_stats(Path(a.trace_dir))
        return 0
    for s in a.scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; valid: {list(SCENARIOS)}")

    base = {"engine": a.engine, "n": a.n, "min_duration": a.min_duration, "max_n": a.max_n, "seeds": a.seeds,
            "target": a.target, "tol": a.tol, "rate_min": a.rate_min, "rate_max": a.rate_max, "arrival": "scenario"}
    t0 = time.perf_counter()
    caps: dict[str, dict[str, Any]] = {s: {} for s in a.scenarios}
    with ProcessPoolExecutor(a.jobs) as ex:
        tasks = [(base, s, p) for s in a.scenarios for p in a.policies]
        for s, p, _, c in ex.map(_cap_task, tasks):
            caps[s][p] = c
            print(f"  {s:<18} {p:<8} capacity {c['capacity']:.3g} req/s  ({len(c['probes'])} rates, "
                  f"{c['seconds']:.0f} s) {c['note']}", file=sys.stderr, flush=True)

        # pathological scenarios: diagnose with Poisson and real-trace arrivals
        diag: dict[str, dict[str, Any]] = {}
        tasks = []
        for s in a.scenarios:
            if max(c["capacity"] for c in caps[s].values()) > 0:
                continue
            spec = SCENARIOS[s]
            modes = ["poisson"]
            tf = Path(a.trace_dir) / TRACE_FILES.get(spec.arrival, "-")
            if tf.is_file():
                modes.append(str(tf))
            diag[s] = {}
            for m in modes:
                cfg = dict(base, arrival=m, start=spec.default_rate)
                tasks += [(cfg, s, p) for p in a.policies]
        for s, p, m, c in ex.map(_cap_task, tasks):
            key = "poisson" if m == "poisson" else "trace"
            diag[s].setdefault(key, {})[p] = c
            print(f"  {s:<18} {p:<8} capacity with {key} arrivals {c['capacity']:.3g} req/s", file=sys.stderr,
                  flush=True)

        chosen: dict[str, float] = {}
        basis: dict[str, str] = {}
        for s in a.scenarios:
            best = max(c["capacity"] for c in caps[s].values())
            basis[s] = "scenario arrivals"
            if best <= 0 and s in diag:
                key = "trace" if "trace" in diag[s] else "poisson"
                best = max(c["capacity"] for c in diag[s][key].values())
                basis[s] = f"{key} arrivals (pathological)"
            chosen[s] = round_sig(a.fraction * best)
        at: dict[str, dict[str, Any]] = {s: {} for s in a.scenarios}
        tasks = [(base, s, p, chosen[s]) for s in a.scenarios for p in a.policies if chosen[s] > 0]
        for s, p, m in ex.map(_at_task, tasks):
            at[s][p] = m

    hdr = (f"{'scenario':<18} " + " ".join(f"{'cap ' + p:>12}" for p in a.policies) + f" {'default':>8} "
           + " ".join(f"{'att ' + p:>12}" for p in a.policies) + " " + " ".join(f"{'util ' + p:>12}"
                                                                                 for p in a.policies) + "  basis")
    print(f"engine {a.engine} x1 | target attainment {a.target} (dslo) | seeds {a.seeds} | n {a.n or 'default_n'} "
          f"(>= {a.min_duration:g} s of arrivals, <= {a.max_n}) | "
          f"default = {a.fraction} x best capacity, 2 significant digits | {time.strftime('%Y-%m-%d')}")
    print(hdr)
    for s in a.scenarios:
        row = f"{s:<18} " + " ".join(f"{caps[s][p]['capacity']:>12.3g}" for p in a.policies)
        row += f" {chosen[s]:>8.3g} "
        row += " ".join(f"{at[s][p]['attainment']:>12.3f}" if p in at[s] else f"{'-':>12}" for p in a.policies)
        row += " " + " ".join(f"{at[s][p]['utilization']:>12.3f}" if p in at[s] else f"{'-':>12}"
                              for p in a.policies)
        print(row + f"  {basis[s]}")
    for s, d in diag.items():
        for key, cs in d.items():
            print(f"  diagnosis {s}: capacity with {key} arrivals: "
                  + ", ".join(f"{p} {c['capacity']:.3g}" for p, c in cs.items()))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.json:
        out = {"engine": a.engine, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "n": a.n,
               "seeds": a.seeds, "target": a.target, "fraction": a.fraction,
               "scenarios": {s: {"capacity": {p: caps[s][p]["capacity"] for p in a.policies},
                                 "probes": {p: {f"{r:.6g}": v for r, v in sorted(caps[s][p]["probes"].items())}
                                            for p in a.policies},
                                 "default_rate": chosen[s], "basis": basis[s], "at_default": at[s],
                                 "diagnosis": {k: {p: c["capacity"] for p, c in cs.items()}
                                               for k, cs in diag.get(s, {}).items()}}
                           for s in a.scenarios}}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

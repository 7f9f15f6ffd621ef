"""Reproduce Tempo's headline comparison (Zhang et al. 2025, §6.2 Fig. 9/10/12/13, Fig. 15 ablation) in slogym.

    python scripts/reproduce/tempo.py [--requests 600] [--loads 1.5,2.5] [--seeds 1] [--quick]

Workloads: ``tempo-mix`` (Chatbot, Table 2) and a long-context variant with the LC-Workload lengths of Table 2
(registered here at run time as ``tempo-mix-lc``), each with Poisson arrivals and with the bursty ``code``
arrival fingerprint (correlated gaps, a stand-in for BurstGPT, Fig. 19; registered at run time as
``<name>-bursty``). Both belong in slogym.workloads.scenarios once its owner adds them. Loads are multiples of
tempo-mix's default rate (9.2 user arrivals/s on one llama3-8b-h100); the default 2.5x is past the knee where
FCFS collapses on 600-arrival runs (the paper's "high load", Fig. 13), 1.5x is moderate. For every setting it
prints service gain (Eq. 1-3, w_i:w_o = 1:2, alpha = 1) and SLO goodput (requests meeting their SLO per second,
dslo mode) of every policy, then Tempo's ratios over vLLM / Sarathi / Autellix beside the paper's 1.3-8.3x
(service gain) and 4.0-10.3x (goodput), Tempo / Tempo-Precise, and the ablations relative to Tempo. Every Tempo
variant is trained on a held-out seeded draw of the same workload (1500 user arrivals). The default sweep
(4 settings x 2 loads x 8 policies, 600 arrivals) takes about 6-8 minutes on one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Callable

import numpy as np

from slogym.baselines import make_policy
from slogym.baselines.tempo import POLICIES as TEMPO
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import SCENARIOS, ChatApp, CollectiveApp, LengthDist, make_workload

PAPER = {"service_gain": (1.3, 8.3), "goodput": (4.0, 10.3)}


def _register_lc() -> None:
    """Tempo Table 2 LC-Workload lengths (lighteval-math singles, ToT collectives), same SLOs and mix."""
    base = SCENARIOS["tempo-mix"]
    ls, ti, coll = base.apps
    s_in = LengthDist.moments(76, 100, p50=49, p95=229)
    s_out = LengthDist.moments(482, 236, p50=422, p95=1024, hi=1024)
    apps = (dataclasses.replace(ls, input=s_in, output=s_out), dataclasses.replace(ti, input=s_in, output=s_out),
            dataclasses.replace(coll, input=LengthDist.moments(1064, 389, p50=983, p95=1713),
                                output=LengthDist.moments(6744, 819, p50=6703, p95=8120)))
    assert isinstance(apps[0], ChatApp) and isinstance(apps[2], CollectiveApp)
    SCENARIOS["tempo-mix-lc"] = dataclasses.replace(base, name="tempo-mix-lc", apps=apps,
                                                    description="Tempo LC-Workload lengths, 3:1:1 mix",
                                                    source="Tempo (Zhang et al. 2025) Table 2 (LC-Workload)")


def _bursty(name: str) -> str:
    key = f"{name}-bursty"
    if key not in SCENARIOS:
        SCENARIOS[key] = dataclasses.replace(SCENARIOS[name], name=key, arrival="code")
    return key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600, help="user arrivals per run")
    ap.add_argument("--loads", default="1.5,2.5", help="multiples of 9.2 arrivals/s")
    ap.add_argument("--seeds", type=int, default=1, help="average each run over seeds 0..N-1")
    ap.add_argument("--engine", default="llama3-8b-h100")
    ap.add_argument("--quick", action="store_true", help="Poisson tempo-mix only")
    a = ap.parse_args()
    _register_lc()
    eng = get_engine(a.engine)
    baselines = ["vllm", "sarathi", "autellix"]
    names = list(TEMPO) + baselines
    rate0 = SCENARIOS["tempo-mix"].default_rate
    settings = [(w, arr) for w in ("tempo-mix", "tempo-mix-lc") for arr in ("poisson", "bursty")]
    if a.quick:
        settings = settings[:1]
    table: list[tuple[str, dict[str, float]]] = []
    started = time.perf_counter()
    for wname, arrival in settings:
        scen = wname if arrival == "poisson" else _bursty(wname)
        histories = [make_workload(scen, n_requests=1500, seed=s + 1_000_003) for s in range(a.seeds)]
        for load in (float(x) for x in a.loads.split(",")):
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for seed, history in enumerate(histories):
                w = make_workload(scen, rate=load * rate0, n_requests=a.requests, seed=seed, engine=eng)
                for name in names:
                    pol = TEMPO[name](eng, history=history) if name in TEMPO else make_policy(name, eng)
                    runs[name].append(Simulator(w, eng, pol, seed=seed).run().result().summary)
            res = {name: _mean(s) for name, s in runs.items()}
            print(f"\n{wname} {arrival} load {load:g}x ({load * rate0:.1f}/s, {a.requests} arrivals, "
                  f"{len(w)} requests{f', mean of {a.seeds} seeds' if a.seeds > 1 else ''})")
            print(f"  {'policy':20s} {'service_gain':>13s} {'goodput':>8s} {'attain':>7s}  per-app attainment")
            for name in names:
                s = res[name]
                apps = " ".join(f"{k[:4]}={v:.2f}" for k, v in s["attainment_by_app"].items())
                print(f"  {name:20s} {s['service_gain']:13.0f} {s['goodput']:8.3f} {s['attainment']:7.3f}  {apps}")
            table.append((f"{wname[6:] or 'mix'}-{arrival[0]} {load:g}x", _ratios(res, baselines)))
    _print_ratios(table, time.perf_counter() - started)
    print(NOTE)


def _mean(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Service gain, goodput and attainment (overall and per app) averaged over seeds."""
    out: dict[str, Any] = {k: float(np.mean([s[k] for s in summaries]))
                           for k in ("service_gain", "goodput", "attainment")}
    out["attainment_by_app"] = {app: float(np.mean([s["attainment_by_app"][app] for s in summaries]))
                                for app in summaries[0]["attainment_by_app"]}
    return out


def _ratios(res: dict[str, dict[str, Any]], baselines: list[str]) -> dict[str, float]:
    """Tempo over each baseline and Tempo-Precise, each ablation over Tempo, for both metrics."""
    t = res["tempo"]
    out = {}
    for m in ("service_gain", "goodput"):
        for b in baselines + ["tempo-precise"]:
            out[f"{m} tempo/{b}"] = t[m] / max(res[b][m], 1e-12)
        for abl in ("tempo-no-graph", "tempo-no-predictor", "tempo-sjf"):
            out[f"{m} {abl}/tempo"] = res[abl][m] / max(t[m], 1e-12)
    return out


MARGIN = 0.01
"""A ratio within 1% of 1 is a tie, not a win: the "shape met" column needs the margin."""


def _expected(key: str) -> tuple[str, Callable[[float], bool]]:
    """The paper's figure for a ratio and the shape test it implies."""
    metric = key.split()[0]
    if "precise" in key:
        return ">= 0.9 (near oracle, Fig. 12)", lambda v: v >= 0.9
    if key.split()[1].startswith("tempo/"):
        lo, hi = PAPER[metric]
        return f"{lo:g}-{hi:g}x (> 1)", lambda v: v > 1.0 + MARGIN
    return "< 1 (ablation, Fig. 15)", lambda v: v < 1.0 - MARGIN


def _print_ratios(table: list[tuple[str, dict[str, float]]], seconds: float) -> None:
    labels = [label for label, _ in table]
    print(f"\nratios per setting ({seconds:.0f} s in all)")
    print(f"  {'ratio':38s} " + " ".join(f"{x:>11s}" for x in labels) + "   shape met   paper")
    for key in table[0][1]:
        vals = [r[key] for _, r in table]
        paper, ok = _expected(key)
        met = sum(ok(v) for v in vals)
        print(f"  {key:38s} " + " ".join(f"{v:11.2f}" for v in vals) + f"   {met:>3d}/{len(vals):<3d}     {paper}")


NOTE = """
"shape met" counts settings where the ratio clears 1 by more than 1% (0.9 for Tempo / Tempo-Precise).
Where slogym differs from the paper, and why (figures: the default settings, one seed):
* Service gain ties (about 1.0x over Sarathi, 1.01-1.05x over vLLM and Autellix): every output token is worth
  w_o whatever its class, latency-sensitive output tokens are judged per gap (Eq. 3), which decode-first
  batching keeps under the TBT SLO, and every run drains its backlog, so the total gain hardly depends on the
  order; only the TTLT decay of late throughput-intensive and collective requests moves it. The paper's
  1.3-8.3x come from a one-hour overloaded online run (Fig. 9) where FCFS's backlog grows without bound.
* Goodput: Tempo leads vLLM everywhere (prefill-first vLLM stalls decodes) but by 1.1-1.6x, not 4-10.3x: the
  runs are finite, Sarathi already batches decode-first, and the long-context collectives (about 1.1k output
  tokens per request, two stages in 40 s) are mostly infeasible for every policy. Under bursts on the
  long-context mix Tempo falls behind Autellix and Sarathi at 2.5x.
* Ablations: dropping the predictor lowers goodput in one-seed runs (a 3-seed mean at 2.5x Poisson ties);
  without graph matching and Tempo-SJF are about as good or a few percent better (SJF under bursts): on this
  fixed two-stage DAG the matched stage split adds little, and the SLO-bound mix rewards short-job order.
"""


if __name__ == "__main__":
    main()

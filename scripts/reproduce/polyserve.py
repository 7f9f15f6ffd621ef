"""Reproduce PolyServe's evaluation (Zhu et al. 2025, §5.2-5.5) in slogym, co-located (CO) and disaggregated (PD).

    python scripts/reproduce/polyserve.py                 # paper scale: 20 instances, 6 loads, 5 traces (slow)
    python scripts/reproduce/polyserve.py --quick         # reduced: fewer instances, requests, loads, traces
    python scripts/reproduce/polyserve.py --quick --pd-only   # only the disaggregated policies

Setup (§5.1): llama3-8b-h200 (the paper: LLaMA3.1-8B on H200), TPOT tiers 20/30/50/100 ms at 10/20/30/40 %, TTFT
uniform from 0.3/0.5/1 s, each request given only SLOs an idle server achieves (the ``polyserve-tiers`` scenario's
rule); Poisson arrivals; DSLO attainment. Lengths: Azure conv / code 2023 and Mooncake conversation (sampled
rows of ``../shared/traces``), and the synthetic uniform-4096-1024 (input U[1, 8192], output U[1, 2048]) and
uniform-512-512 (U[1, 1024] both).

PD variants run on ``Simulator(pd=(P, D))`` with the split of :func:`pd_split` (same instance count).

Experiments:

* goodput (§5.2): loads of 20-120 % of the *optimal* rate (below); per policy the highest rate with >= 90 %
  attainment (linear interpolation between loads), per-tier attainment, and PolyServe's ratio to the best baseline.
* burst (§5.3): uniform-4096-1024 lengths, the first half of the requests with the tier mix 10/20/30/40 %, the
  second half inverted (40/30/20/10 %); goodput at 90 %.
* cost (§5.4): PolyServe on an "unlimited" fleet (2x the servers the optimum needs), cost = instance-seconds
  outside the best-effort pool per request; CO-Chunk (best budget) on the fewest servers that reach 90 %.
* scaling-env (not in the paper; not run by default): PolyServe's tier autoscaling as ``slogym/Scaling-v0``'s
  expert (``PolyServeScaler.deltas``) served natively beside static provisioning and the env's threshold scaler.
* servers (§5.5, Fig. 9): uniform-4096-1024, goodput per instance at 90 % for fleets of ``--servers`` sizes (full:
  8, 16, 32, 64; the paper steps 8-64 by 8), PolyServe's ratio to the best baseline per size, and the CPU seconds
  each size took.

Optimal rate (§3.4-3.5; the equations are lost in the extracted text, reconstructed): an instance serving one tier
of TPOT ``tau`` at its largest batch runs iterations of ``T`` tokens, the largest token batch whose predicted time
at the steady KV size stays within ``tau``; the decode share of those tokens is ``B = T O/(P+O)`` (mean prompt
``P``, output ``O`` of the tier), holding ``B (P + O/2)`` KV tokens; the prefill share ``T P/(P+O)`` attends its
past (§3.4 counts "prefill attention time" in the co-located iteration; the profile table alone leaves it out, so
it is read from the prefill profile at the tier's mean past of a prompt token, ``sum(P^2) / (2 sum(P))``); ``T`` is
that fixed point, capped by ``max_num_seqs`` decodes (then the iteration is shorter than ``tau``) and by KV
capacity. The tier's rate per instance is ``T / (t(T) (P + O))``; the cluster optimum is ``N / sum_tiers(share /
rate)`` (perfect packing, no fragmentation, no TTFT wait). Best-effort requests count at the loosest tier. The
header of each sweep also prints the estimate without prefill attention (the reconstruction before it was added:
on Mooncake, whose prompts reach 85K tokens, it was 1.6x too high).

Run length: ``--requests`` per run; ``--min-span S`` raises it so that the arrivals span at least ``S`` seconds
(steady state needs arrivals over several request lifetimes; the paper samples 300,000 requests per dataset).

Paper figures: the extracted text lost every number; the published abstract (arXiv 2507.17769) states 1.23x goodput
over existing policies and up to 92.5 % of the optimal goodput. Those are printed beside slogym's.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from slogym.baselines import make_policy
from slogym.baselines import polyserve_kernels as pk
from slogym.baselines.polyserve import pd_split as polyserve_pd_split
from slogym.baselines.polyserve import prefill_profile_table, profile_table, request_tiers
from slogym.core.cluster import KVTransfer
from slogym.core.request import Workload
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.readers import read_trace
from slogym.workloads.scenarios import SCENARIOS, make_workload
from slogym.workloads.trace import Trace

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"
TRACES = {"azure-conv": "azure_conv_2023.csv.gz", "azure-code": "azure_code_2023.csv.gz",
          "mooncake-conv": "mooncake_conversation_fast25.jsonl.gz", "uniform-4096-1024": (8192, 2048),
          "uniform-512-512": (1024, 1024)}
PAPER = {"goodput_gain": 1.23, "of_optimal": 0.925}
TIER_MIX = {0.020: 0.1, 0.030: 0.2, 0.050: 0.3, 0.100: 0.4}
CO_POLICIES = ("polyserve-co", "polyserve-co-random", "polyserve-co-minimal", "polyserve-co-chunk")
PD_POLICIES = ("polyserve-pd", "polyserve-pd-random", "polyserve-pd-minimal")
TARGET = 0.9
FULL = dict(instances=20, requests=4000, loads="0.2,0.4,0.6,0.8,1.0,1.2", traces=",".join(TRACES),
            budgets="256,512,1024,2048", servers="8,16,32,64", cost_rates="2,5,10")
QUICK = dict(instances=6, requests=1200, loads="0.6,0.9,1.2", traces="azure-conv,uniform-4096-1024",
             budgets="256,1024", servers="4,8", cost_rates="2,4")


# ---------------------------------------------------------------------------------------------- workloads
def lengths(trace: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (input, output) lengths: rows sampled from a shared trace, or the uniform synthetic ones."""
    rng = np.random.default_rng(seed + 101)
    spec = TRACES[trace]
    if isinstance(spec, tuple):
        return rng.integers(1, spec[0] + 1, n), rng.integers(1, spec[1] + 1, n)
    tr = read_trace(SHARED / spec)
    rows = rng.choice(len(tr), n, replace=len(tr) < n)
    return tr.input_tokens[rows], tr.output_tokens[rows]


def _scenario(mix: dict[float, float]) -> str:
    """``polyserve-tiers`` with another tier mix, registered at run time."""
    name = "polyserve-tiers" if mix == TIER_MIX else "polyserve-tiers-" + "-".join(f"{p:g}" for p in mix.values())
    if name not in SCENARIOS:
        base = SCENARIOS["polyserve-tiers"]
        app = dataclasses.replace(base.apps[0], tiers=mix)
        SCENARIOS[name] = dataclasses.replace(base, name=name, apps=(app,))
    return name


def workload(trace: str, rate: float, n: int, seed: int, eng: Any, mix: dict[float, float] = TIER_MIX) -> Workload:
    inp, out = lengths(trace, n, seed)
    return make_workload(_scenario(mix), rate=rate, n_requests=n, seed=seed, trace=Trace(None, inp, out),
                         engine=eng)


def flipped(trace: str, rate: float, n: int, seed: int, eng: Any) -> Workload:
    """§5.3: the first half with the paper's tier mix, the second half with it inverted, back to back."""
    inv = dict(zip(TIER_MIX, reversed(list(TIER_MIX.values()))))
    a = workload(trace, rate, n // 2, seed, eng)
    b = workload(trace, rate, n - n // 2, seed + 1, eng, inv)
    names = a.tier_names
    remap = np.array([names.index(x) for x in b.tier_names])
    t_b = b.arrival + a.arrival[-1] + 1.0 / rate
    cat = np.concatenate
    return Workload.two_stage(cat((a.arrival, t_b)), cat((a.input_tokens, b.input_tokens)),
                              cat((a.output_tokens, b.output_tokens)), cat((a.first_ttft, b.first_ttft)),
                              cat((a.min_tpot, b.min_tpot)), tier=cat((a.tier, remap[b.tier])), tier_names=names,
                              best_effort=cat((a.best_effort, b.best_effort)), name=f"{trace}-flip")


def optimal_rate(w: Workload, eng: Any, n_inst: int, attention: bool = True) -> float:
    """The perfect-packing cluster rate of the module docstring (requests/s); ``attention=False``: without the
    prefill chunks' attention over their past (the estimate before it was added)."""
    table = profile_table(eng)
    ptable = prefill_profile_table(eng)
    tiers = np.array(sorted(TIER_MIX))
    rt = np.minimum(request_tiers(w.min_tpot, w.best_effort, tiers), tiers.size - 1)
    inv_rate = 0.0
    for t, tau in enumerate(tiers):
        sel = rt == t
        if not sel.any():
            continue
        inp = w.input_tokens[sel].astype(np.float64)
        p, o = float(inp.mean()), float(w.output_tokens[sel].mean())
        past = float((inp * inp).sum() / (2.0 * inp.sum())) if attention else 0.0  # a prefill token's mean past
        seqs_cap = float(eng.max_num_seqs) * (p + o) / o

        def kv_of(tokens: float) -> float:
            return min(min(tokens * o / (p + o), float(eng.max_num_seqs)) * (p + o / 2), float(eng.kv_capacity_tokens))

        def iteration(tokens: float) -> float:  # T tokens, the prefill share attending the mean past
            chunk = tokens * p / (p + o)
            return table.time_one(tokens, kv_of(tokens)) + pk.attn_extra(ptable.tokens, ptable.kv, ptable.times,
                                                                           chunk, past)

        lo, hi = 0.0, min(float(table.token_budget(np.array([0.0]), float(tau))[0]), seqs_cap)
        for _ in range(40):  # largest T whose iteration fits tau: the time rises with T and with the KV
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if iteration(mid) <= tau else (lo, mid)
        if lo < 1.0:
            return 0.0  # this tier cannot be served at steady state
        per_inst = lo / (iteration(lo) * (p + o))
        inv_rate += sel.mean() / per_inst
    return n_inst / inv_rate


# ---------------------------------------------------------------------------------------------- runs
def pd_split(w: Workload, eng: Any, n_inst: int) -> tuple[int, int]:
    """Prefill/decode instances for a disaggregated run: the library's rule
    (:func:`slogym.baselines.polyserve.pd_split`, the split PD-PolyServe makes of a colocated cluster itself)
    for this script's TPOT tiers."""
    return polyserve_pd_split(w, eng, n_inst, len(TIER_MIX))


def run(w: Workload, eng: Any, policy: str, n_inst: int, transfer: KVTransfer | None = None,
        **params: Any) -> tuple[dict, Any]:
    """One run; a PD policy on :func:`pd_split`'s cluster with the KV link ``transfer`` (None: the simulator's
    default, 100 Gb/s)."""
    pol = make_policy(policy, eng, **params)
    cluster = ({"pd": pd_split(w, eng, n_inst), "transfer": transfer} if policy in PD_POLICIES
               else {"n_instances": n_inst})
    sim = Simulator(w, eng, pol, attainment="dslo", **cluster).run()
    return sim.result().summary, (pol, sim)


def sweep(make: Any, eng: Any, n_inst: int, rates: list[float], budgets: list[int],
          policies: tuple[str, ...] = CO_POLICIES + PD_POLICIES,
          transfer: KVTransfer | None = None) -> dict[str, list[dict]]:
    """Summaries per policy per rate; CO-Chunk keeps its best budget at each rate (the paper's sweep)."""
    out: dict[str, list[dict]] = {p: [] for p in policies}
    for rate in rates:
        w = make(rate)
        for p in policies:
            if p == "polyserve-co-chunk":
                runs = [run(w, eng, p, n_inst, token_budget=b)[0] | {"token_budget": b} for b in budgets]
                out[p].append(max(runs, key=lambda s: s["attainment"]))
            else:
                out[p].append(run(w, eng, p, n_inst, transfer)[0])
    return out


def goodput_at(rates: list[float], att: list[float], target: float = TARGET) -> float:
    """Highest rate with attainment >= target, interpolated between the first failing load and the one below."""
    if att[0] < target:
        return rates[0] * att[0] / target if att[0] > 0 else 0.0
    for i in range(1, len(rates)):
        if att[i] < target:
            f = (att[i - 1] - target) / (att[i - 1] - att[i])
            return rates[i - 1] + f * (rates[i] - rates[i - 1])
    return rates[-1]


def _fmt(x: float) -> str:
    return f"{x:6.3f}"


def ratios(rates: list[float], good: dict[str, float]) -> dict[str, tuple[float, str, bool]]:
    """Per variant (``co``, ``pd``) with results: PolyServe's goodput / the best baseline's, that baseline, and
    whether PolyServe met the target at the top load (then the ratio is a lower bound)."""
    out = {}
    for mode in ("co", "pd"):
        mine = f"polyserve-{mode}"
        rivals = [p for p in good if p.startswith(mine + "-")]
        if mine not in good or not rivals:
            continue
        best = max(rivals, key=lambda p: good[p])
        ratio = good[mine] / good[best] if good[best] > 0 else float("inf")
        out[mode] = (ratio, best, good[mine] >= rates[-1])
    return out


def n_requests(a: argparse.Namespace, rate: float) -> int:
    """Requests of a run at ``rate``: ``--requests``, more when needed for the arrivals to span ``--min-span``
    seconds (steady state needs arrivals over several request lifetimes; the paper samples 300,000 requests)."""
    return max(a.requests, int(np.ceil(rate * a.min_span)))


def probe_requests(a: argparse.Namespace) -> int:
    """Requests whose lengths the optimal-rate estimate reads: ``--requests``, at least 1000 (``--requests 1
    --min-span S`` sizes every run by its span alone)."""
    return max(a.requests, 1000)


def report_sweep(title: str, rates: list[float], opt: float, res: dict[str, list[dict]],
                 opt_flat: float | None = None) -> dict[str, float]:
    flat = f"; {opt_flat:.2f} without prefill attention" if opt_flat is not None else ""
    print(f"\n## {title}  (optimal rate {opt:.2f} req/s{flat})")
    print("load   " + "".join(f"{p:>22s}" for p in res))
    for i, r in enumerate(rates):
        cells = []
        for p, rows in res.items():
            extra = f" b{rows[i]['token_budget']}" if "token_budget" in rows[i] else ""
            cells.append(f"{rows[i]['attainment']:.3f}{extra}")
        print(f"{r / opt:5.0%}  " + "".join(f"{c:>22s}" for c in cells))
    good = {p: goodput_at(rates, [s["attainment"] for s in rows]) for p, rows in res.items()}
    print("goodput@90% (req/s): " + ", ".join(f"{p} {g:.2f}" for p, g in good.items()))
    for mode, (ratio, best, capped) in ratios(rates, good).items():
        ps = good[f"polyserve-{mode}"]
        cap = " (>= the top load: a lower bound)" if capped else ""
        print(f"{mode.upper()}-PolyServe / best {mode.upper()} baseline ({best}): slogym {ratio:.2f}x{cap}   paper "
              f"{PAPER['goodput_gain']:.2f}x (abstract, over all traces);   / optimal (co-located): slogym "
              f"{ps / opt:.1%}   paper up to {PAPER['of_optimal']:.1%}")
    # per-tier attainment at the load nearest CO-PolyServe's 90% point (PD-PolyServe's without the CO policies)
    ref = good.get("polyserve-co", good.get("polyserve-pd", rates[0]))
    i = int(np.argmin([abs(r - ref) for r in rates]))
    print(f"per-tier attainment at {rates[i] / opt:.0%} load:")
    for p, rows in res.items():
        tiers = rows[i]["attainment_by_tier"]
        print(f"  {p:22s} " + "  ".join(f"{k}={v:.3f}" for k, v in sorted(tiers.items())))
    for p in (x for x in ("polyserve-co", "polyserve-pd") if x in res):  # near-uniform across the load range?
        print(f"per-tier attainment of {p} by load (spread: highest - lowest tier):")
        for r, row in zip(rates, res[p]):
            tiers = row["attainment_by_tier"]
            spread = max(tiers.values()) - min(tiers.values())
            print(f"  {r / opt:5.0%}  " + "  ".join(f"{k}={v:.3f}" for k, v in sorted(tiers.items()))
                  + f"  spread {spread:.3f}")
    return good


# ---------------------------------------------------------------------------------------------- experiments
def exp_goodput(a: argparse.Namespace, eng: Any) -> None:
    summary = []
    for trace in a.traces:
        probe = workload(trace, 1.0, probe_requests(a), a.seed, eng)
        opt = optimal_rate(probe, eng, a.instances)
        rates = [f * opt for f in a.loads]
        res = sweep(lambda r: workload(trace, r, n_requests(a, r), a.seed, eng), eng, a.instances, rates, a.budgets,
                    a.policies, a.transfer)
        counts = sorted({n_requests(a, r) for r in rates})
        span = f"{counts[0]}{f'-{counts[-1]}' if len(counts) > 1 else ''}"
        good = report_sweep(f"goodput, {trace}, {a.instances} instances (PD split "
                            f"{pd_split(probe, eng, a.instances)}), {span} requests", rates, opt, res,
                            optimal_rate(probe, eng, a.instances, attention=False))
        summary.append((trace, ratios(rates, good)))
    print(f"\n## summary: goodput at {TARGET:.0%} attainment, PolyServe / best baseline of its variant "
          f"({a.instances} instances; '>=': PolyServe met the target at the top load)")
    print(f"{'trace':20s}{'variant':>8s}{'slogym':>10s}{'paper':>8s}  best baseline")
    for trace, rows in summary:
        for mode, (ratio, best, capped) in rows.items():
            print(f"{trace:20s}{mode.upper():>8s}{('>=' if capped else '') + f'{ratio:.2f}x':>10s}"
                  f"{PAPER['goodput_gain']:>7.2f}x  {best}")


def exp_burst(a: argparse.Namespace, eng: Any) -> None:
    trace = "uniform-4096-1024"
    probe = flipped(trace, 1.0, probe_requests(a), a.seed, eng)
    opt = optimal_rate(probe, eng, a.instances)
    rates = [f * opt for f in a.loads]
    res = sweep(lambda r: flipped(trace, r, n_requests(a, r), a.seed, eng), eng, a.instances, rates, a.budgets,
                a.policies, a.transfer)
    report_sweep(f"burst: tier mix flips half-way, {trace}, {a.instances} instances", rates, opt, res,
                 optimal_rate(probe, eng, a.instances, attention=False))


def exp_cost(a: argparse.Namespace, eng: Any) -> None:
    trace = "azure-conv"
    print(f"\n## cost per request (instance-seconds), {trace}, attainment target {TARGET:.0%}")
    print("rate    polyserve-co (servers used, attainment)        co-chunk (servers, budget, attainment)   ratio")
    one = optimal_rate(workload(trace, 1.0, probe_requests(a), a.seed, eng), eng, 1)
    for frac in a.cost_rates:
        rate = frac * one
        w = workload(trace, rate, a.requests, a.seed, eng)
        n_big = max(2, int(np.ceil(2 * frac)))
        s, (pol, sim) = run(w, eng, "polyserve-co", n_big)
        ps_cost = pol.router.core.fleet.instance_seconds(sim.end_time) / len(w)
        chunk = None
        for n in range(1, 4 * n_big + 1):
            best = max(({**run(w, eng, "polyserve-co-chunk", n, token_budget=b)[0], "b": b} for b in a.budgets),
                       key=lambda x: x["attainment"])
            if best["attainment"] >= TARGET:
                chunk = (n, best["b"], best["attainment"], n * best["sim_seconds"] / len(w))
                break
        used = pol.router.core.fleet.instance_seconds(sim.end_time) / sim.end_time
        c_txt = "never reached" if chunk is None else f"{chunk[3]:.3f} ({chunk[0]}, b{chunk[1]}, {chunk[2]:.3f})"
        ratio = "" if chunk is None else f"{chunk[3] / ps_cost:.2f}x"
        print(f"{rate:6.2f}  {ps_cost:.3f} ({used:.1f} of {n_big}, {s['attainment']:.3f})"
              f"{'':18s}{c_txt:38s} {ratio}")


def exp_servers(a: argparse.Namespace, eng: Any) -> None:
    """§5.5 (Fig. 9): goodput per instance at 90 % for each fleet size, PolyServe's ratio to the best baseline of
    its variant, beside the paper's two claims (its numbers are lost in the extracted text): PolyServe ahead of
    every baseline at every size, and its per-instance goodput rising with the fleet ("reduced fragmentation")."""
    trace = "uniform-4096-1024"
    print(f"\n## servers: goodput per instance at {TARGET:.0%} attainment, {trace} ('>=': met the target at the "
          f"top load)")
    print("servers " + "".join(f"{p:>22s}" for p in a.policies) + "   PolyServe / best baseline    CPU s")
    per_inst: dict[str, list[float]] = {p: [] for p in a.policies}
    ahead: dict[str, list[bool]] = {}
    for n in a.servers:
        t0 = time.process_time()
        opt = optimal_rate(workload(trace, 1.0, probe_requests(a), a.seed, eng), eng, n)
        rates = [f * opt for f in a.loads]
        res = sweep(lambda r: workload(trace, r, n_requests(a, r), a.seed, eng), eng, n, rates, a.budgets,
                    a.policies, a.transfer)
        good = {p: goodput_at(rates, [s["attainment"] for s in rows]) for p, rows in res.items()}
        cells = []
        for p in a.policies:
            per_inst[p].append(good[p] / n)
            cells.append((">=" if good[p] >= rates[-1] else "") + f"{good[p] / n:.3f}")
        rat = ratios(rates, good)
        for mode, (ratio, _, _) in rat.items():
            ahead.setdefault(mode, []).append(ratio > 1.0)
        rtxt = "  ".join(f"{m.upper()} {'>=' if capped else ''}{ratio:.2f}x ({best.split('-')[-1]})"
                         for m, (ratio, best, capped) in rat.items())
        print(f"{n:7d} " + "".join(f"{c:>22s}" for c in cells) + f"   {rtxt:27s} "
              f"{time.process_time() - t0:6.0f}")
    print("paper (§5.5, Fig. 9; numbers lost): PD- and CO-PolyServe ahead of every baseline at every size; "
          "per-instance goodput rises with the number of servers")
    for mode, flags in ahead.items():
        mine = per_inst[f"polyserve-{mode}"]
        rising = all(b >= x for x, b in zip(mine, mine[1:]))
        print(f"slogym {mode.upper()}-PolyServe: ahead of every {mode.upper()} baseline at {sum(flags)} of "
              f"{len(flags)} sizes; per-instance goodput {' -> '.join(f'{x:.3f}' for x in mine)} "
              f"({'rising' if rising else 'not monotone'})")


def exp_scaling_env(a: argparse.Namespace, eng: Any) -> None:
    """PolyServe's tier autoscaling as ``slogym/Scaling-v0``'s expert (``PolyServeScaler.deltas``; one pool per
    tier, PolyServe's scheduler, the env's router), served natively (the run its replay gives), beside static
    provisioning and the env's threshold scaler on held-out windows: reward (goodput - lam x instance-seconds),
    instance-seconds, attainment, goodput. Not a paper experiment (the paper's scaling is instant, on a fixed
    fleet: the cost experiment above); the env's engine and cold start apply."""
    from slogym.agents.evaluation import windows

    kw = dict(scenario="polyserve-tiers", engine=a.engine, policy="polyserve-co", pools="tiers", rate_scale=10.0,
              episode=60.0, control_interval=2.0, n_instances=1, max_instances=4, cold_start="disk", lam=0.1,
              split="test", pool_requests=60000)
    seeds = [0] if a.quick else [0, 1, 2]
    env, wins = windows("slogym/Scaling-v0", kw, seeds)
    print(f"\n## Scaling-v0: PolyServe's tier autoscaling as the expert, {len(wins)} held-out window(s), mean (std)")
    print(f"env: {', '.join(f'{k}={v}' for k, v in kw.items())}")
    rows = [(f"static-{n}", n) for n in (1, 2, 3)] + [("threshold", 1), ("policy", 1)]
    keys = ("reward", "instance_seconds", "attainment", "goodput")
    print(f"{'scaler':24s}" + "".join(f"{k:>24s}" for k in keys))
    for name, n in rows:
        label = "polyserve-co's scaler" if name == "policy" else name
        r = env.evaluate(lambda i: env.baseline_policy(name.split("-")[0], n), wins, n)
        cells = [f"{r[k]:.3f} ({r[k + '_std']:.3f})" for k in keys]
        print(f"{label:24s}" + "".join(f"{c:>24s}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, help="default 20 (quick: 6)")
    ap.add_argument("--requests", type=int, help="requests per run, default 4000 (quick: 1200)")
    ap.add_argument("--loads", help="fractions of the optimal rate, default 0.2,0.4,...,1.2 (quick: 0.6,0.9,1.2)")
    ap.add_argument("--traces", help=f"default {','.join(TRACES)} (quick: azure-conv,uniform-4096-1024)")
    ap.add_argument("--min-span", type=float, default=0.0,
                    help="seconds the arrivals of a goodput / burst / servers run span at least (more requests at "
                         "high rates; default 0: --requests alone)")
    ap.add_argument("--budgets", help="CO-Chunk static budgets swept, default 256,512,1024,2048 (quick: 256,1024)")
    ap.add_argument("--servers", help="default 8,16,32,64 (quick: 4,8)")
    ap.add_argument("--cost-rates", help="cost experiment rates in single-instance optima, default 2,5,10 "
                                         "(quick: 2,4)")
    ap.add_argument("--experiments", default="goodput,burst,cost,servers",
                    help="comma-separated: goodput, burst, cost, servers, scaling-env (PolyServe's tier autoscaling "
                         "as the Scaling-v0 expert; not in the default set)")
    ap.add_argument("--engine", default="llama3-8b-h200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-gbps", type=float, default=KVTransfer.bandwidth_gbps,
                    help="PD runs' KV-transfer link in Gb/s (default: the simulator's, one 100 Gb/s NIC per GPU; "
                         "the paper states no transfer model, and its §4.6 times the second token by wait and "
                         "iteration alone; NVLink is ~3600)")
    ap.add_argument("--policies", dest="policy_subset",
                    help="comma-separated subset of the policies to run (default: all of the variants selected)")
    ap.add_argument("--quick", action="store_true", help="the reduced run (defaults in parentheses above)")
    ap.add_argument("--co-only", action="store_true", help="skip the disaggregated (PD) policies")
    ap.add_argument("--pd-only", action="store_true", help="only the disaggregated (PD) policies (no cost "
                                                           "experiment: it compares CO policies)")
    a = ap.parse_args(argv)
    defaults = QUICK if a.quick else FULL
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.loads = [float(x) for x in a.loads.split(",")]
    a.traces = a.traces.split(",")
    a.budgets = [int(x) for x in a.budgets.split(",")]
    a.servers = [int(x) for x in a.servers.split(",")]
    a.cost_rates = [float(x) for x in a.cost_rates.split(",")]
    a.transfer = KVTransfer(bandwidth_gbps=a.kv_gbps)
    unknown = set(a.traces) - set(TRACES)
    if unknown:
        ap.error(f"unknown traces {sorted(unknown)}; known: {list(TRACES)}")
    eng = get_engine(a.engine)
    pd = "pd" in inspect.signature(Simulator).parameters and not a.co_only
    if a.pd_only and not pd:
        ap.error("--pd-only needs the simulator's prefill/decode roles and excludes --co-only")
    a.policies = (() if a.pd_only else CO_POLICIES) + (PD_POLICIES if pd else ())
    if a.policy_subset:
        unknown_p = set(a.policy_subset.split(",")) - set(a.policies)
        if unknown_p:
            ap.error(f"unknown or deselected policies {sorted(unknown_p)}; known: {list(a.policies)}")
        a.policies = tuple(p for p in a.policies if p in a.policy_subset.split(","))
    if a.pd_only:
        a.experiments = ",".join(e for e in a.experiments.split(",") if e != "cost")
    link = f"; KV link {a.kv_gbps:g} Gb/s" if pd else ""
    mode = "PD only" if a.pd_only else "CO and PD" if pd else "CO only"
    print(f"# PolyServe reproduction ({a.engine}; {mode}{link})")
    t0 = time.perf_counter()
    for e in a.experiments.split(","):
        {"goodput": exp_goodput, "burst": exp_burst, "cost": exp_cost, "servers": exp_servers,
         "scaling-env": exp_scaling_env}[e](a, eng)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

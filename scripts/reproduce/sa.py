"""Reproduce the SA scheduler's Fig. 7 setting (Huang et al. 2025 §5.2) on the ``sa-mix`` scenario.

N requests arrive together on one qwen2.5-7b-v100-tp2 instance (Table 2's latency model); for max batch sizes 1, 2,
4 print G (attainment / mean latency), attainment and mean latency of SA with the online Gaussian length predictor
as registered (``sa``: warmed before the run on the profiling slice, 1500 requests of a fresh ``sa-mix`` draw with
seed ``1_000_003 + s``, disjoint from the evaluated ``100 N + s`` -- §5.3 "utilizes profiling data from tasks",
§4.2) and cold (``sa-cold``, ``history=()``: every app at the 128-token prior until its first completion), SA with
the true lengths and with §5.3's "actual output lengths with variations of 2.5%, 5%, and 10%" (``sa-err*``,
Fig. 9), the exhaustive search (N <= 7, warm like ``sa``) and vLLM FCFS, beside the paper's claims. Per SA variant
it counts the cells where its seed-mean G reaches FCFS's and the cells where it is below / above FCFS beyond the
seeds' noise (the per-seed paired ratio G / G_FCFS on the same arrivals: mean + 2 standard errors < 1 / mean - 2
s.e. > 1), then prints that ratio per cell (mean +- s.e.). Last, the search alone: on the plan of all N requests at
time 0 (true lengths), G of the annealer vs the exhaustive optimum.
Usage: ``python scripts/reproduce/sa.py [--seeds 10]``.
"""

from __future__ import annotations

import argparse

import numpy as np

from slogym.baselines import make_policy
from slogym.baselines.sa import POLICIES, anneal, build_problem, exhaustive
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload

ENGINE = get_engine("qwen2.5-7b-v100-tp2")
PAPER = ("paper: SA above vLLM in G 'in most cases', by up to 46.5%, with 'a slightly degradation' at N=6, B=4\n"
         "(Fig. 7, section 5.2); SA within 1.0% of exhaustive; a more accurate length predictor raises G (Fig. 9)")
ERRORS = (0.025, 0.05, 0.1)
"""§5.3's relative variations of the true output length (``SAScheduler(length_error=...)``)."""
SA_VARIANTS = ("sa", "sa-cold", "sa-oracle") + tuple(f"sa-err{100 * e:g}" for e in ERRORS)


def workload(n: int, seed: int):
    w = make_workload("sa-mix", n_requests=n, seed=seed, engine=ENGINE)
    return w.with_arrivals(np.zeros(len(w)))


def search_gap(b: int, n: int, seed: int) -> float:
    """1 - G(anneal) / G(exhaustive) on the time-0 plan of the whole workload with its true lengths."""
    w = workload(n, seed)
    z = np.zeros(n)
    p = build_problem(ENGINE, b, w.input_tokens, w.output_tokens, w.ttlt, w.first_ttft, w.min_tpot, z, w.arrival)
    return 1 - anneal(p, np.random.default_rng(seed))[1] / exhaustive(p)[1]


def run(policy, n: int, seed: int) -> tuple[float, float, float]:
    w = workload(n, seed)
    s = Simulator(w, ENGINE, policy, attainment="mean_tpot").run().result().summary
    return s["sa_objective"], s["attainment"], s["attainment"] / s["sa_objective"]  # G = attainment / latency


def _stderr(ratio: np.ndarray) -> float:
    """Standard error of the mean of per-seed ratios (nan with one seed)."""
    return float(ratio.std(ddof=1) / np.sqrt(ratio.size)) if ratio.size > 1 else float("nan")


def _beyond_noise(ratio: np.ndarray) -> int:
    """-1 / +1 where per-seed ratios G / G_FCFS (same arrivals) are below / above 1 by more than two standard
    errors, else 0."""
    if ratio.size < 2:
        return 0
    m, se = ratio.mean(), _stderr(ratio)
    return -1 if m + 2 * se < 1 else 1 if m - 2 * se > 1 else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--sizes", type=int, nargs="*", default=[4, 6, 8, 10, 20, 40])
    args = ap.parse_args()
    print(PAPER)
    print(f"{'B':>2} {'N':>3} {'policy':>14} {'G':>8} {'attain':>7} {'latency':>8}  (mean of {args.seeds} seeds)")
    wins = {name: 0 for name in SA_VARIANTS}
    below = {name: 0 for name in SA_VARIANTS}
    above = {name: 0 for name in SA_VARIANTS}
    ratios: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for b in (1, 2, 4):
        for n in args.sizes:
            pols = {"sa": lambda s: POLICIES["sa"](ENGINE, max_batch_size=b, seed=s),
                    "sa-cold": lambda s: POLICIES["sa"](ENGINE, max_batch_size=b, seed=s, history=()),
                    "sa-oracle": lambda s: POLICIES["sa"](ENGINE, max_batch_size=b, seed=s, predictor="oracle")}
            for e in ERRORS:
                pols[f"sa-err{100 * e:g}"] = lambda s, e=e: POLICIES["sa"](ENGINE, max_batch_size=b, seed=s,
                                                                          predictor="oracle", length_error=e)
            pols["vllm-fcfs"] = lambda s: make_policy("vllm", ENGINE, max_num_seqs=b)
            if n <= 7:
                pols["sa-exhaustive"] = lambda s: POLICIES["sa-exhaustive"](ENGINE, max_batch_size=b, seed=s)
            g_of = {}
            for name, mk in pols.items():
                vals = np.array([run(mk(s), n, 100 * n + s) for s in range(args.seeds)])
                g_of[name] = vals[:, 0]
                g, a, lat = vals.mean(axis=0)
                print(f"{b:>2} {n:>3} {name:>14} {g:8.4f} {a:7.3f} {lat:8.2f}")
            ratios[b, n] = {name: g_of[name] / g_of["vllm-fcfs"] for name in SA_VARIANTS}
            for name in SA_VARIANTS:
                wins[name] += bool(g_of[name].mean() >= g_of["vllm-fcfs"].mean())
                below[name] += _beyond_noise(ratios[b, n][name]) < 0
                above[name] += _beyond_noise(ratios[b, n][name]) > 0
    cells = 3 * len(args.sizes)
    print("SA >= FCFS in G (mean over seeds): " + ", ".join(f"{k} {v}/{cells}" for k, v in wins.items())
          + "  (sa = Gaussian predictor warmed on the profiling slice, as registered; sa-cold = history=())")
    if args.seeds > 1:
        print("SA below FCFS beyond noise (per-seed G / G_FCFS: mean + 2 s.e. < 1): "
              + ", ".join(f"{k} {v}/{cells}" for k, v in below.items()))
        print("SA above FCFS beyond noise (per-seed G / G_FCFS: mean - 2 s.e. > 1): "
              + ", ".join(f"{k} {v}/{cells}" for k, v in above.items()))
    print(f"per cell G / G_FCFS, per-seed paired ratio: mean +- standard error over {args.seeds} seeds "
          "(< / > : below / above 1 by more than 2 s.e.)")
    print(f"{'B':>2} {'N':>3} " + " ".join(f"{name:>17}" for name in SA_VARIANTS))
    for (b, n), r in ratios.items():
        mark = {-1: "<", 0: " ", 1: ">"}
        print(f"{b:>2} {n:>3} " + " ".join(f"{x.mean():7.3f} +-{_stderr(x):6.3f}{mark[_beyond_noise(x)]}"
                                           for x in r.values()))
    print("search alone, time-0 plan of all N requests with true lengths: worst 1 - G(SA)/G(exhaustive) over seeds")
    for b in (1, 2, 4):
        gaps = {n: max(search_gap(b, n, 100 * n + s) for s in range(args.seeds)) for n in (4, 5, 6, 7)}
        print(f"B={b}: " + ", ".join(f"N={n} {gap:.2%}" for n, gap in gaps.items()))
    print(NOTE)


NOTE = """
Where this differs from the paper, and why (docs/baselines/sa.md, "Reproduction"):
* SA >= FCFS in G in every cell: the paper does not claim it. Fig. 7 has SA above vLLM "in most cases" and
  "a slightly degradation (as seen with 6 requests and a batch size of 4 in Figure 7 (C)), as the result of
  variations in execution time". Here: with exact lengths and with section 5.3's "actual output lengths with
  variations of 2.5%, 5%, and 10%" (sa-oracle, sa-err*) SA reaches FCFS in every cell; with the section 5.1
  Gaussian predictor warmed on profiling data (sa, as registered: section 5.3 "utilizes profiling data from
  tasks", section 4.2) in most cells, about as often as cold (sa-cold, the 128-token prior): 40 seeds, sa
  13/18 and sa-cold 16/18 by seed-mean G. Below FCFS beyond noise: sa in one cell, B=4 N=4, by 0.5%
  (the paper's own small-N, B=4 case: the draws sometimes split the one batch FCFS runs), sa-cold in none.
  Why: the predictor draws one random integer per request from its app's fitted Gaussian (section 5.1), the
  app's mean and spread and nothing about the request; on sa-mix the spread is wide (chat 265 +- 160 tokens,
  code 151 +- 121), so the draws are mostly noise and SA reorders and re-batches requests on it. Cold, every
  request has the same predicted output, so the plan ranks requests by prompt length, which on sa-mix tracks
  the app (chat prompts 760 tokens, code 150) and so the output length, without the draws' noise. The code
  follows the paper there (per-app mean and std from profiling data and completions, one draw per request,
  the plan's G on predicted lengths, the run's G on realized ones); it is not tuned.
* SA within 1% of exhaustive: every N <= 7 cell above has sa = sa-exhaustive and the search alone is at the
  optimum; over many problems and annealing seeds a rare run misses by more than 1% (docs/baselines/sa.md,
  "Search quality"), so tests/test_sa.py checks the paper's 1% as a rate."""


if __name__ == "__main__":
    main()

"""Reproduce the SA scheduler's Fig. 7 setting (Huang et al. 2025 §5.2) on the ``sa-mix`` scenario.

N requests arrive together on one qwen2.5-7b-v100-tp2 instance (Table 2's latency model); for max batch sizes 1, 2,
4 print G (attainment / mean latency), attainment and mean latency of SA (online Gaussian length predictor), SA
with the true lengths (§5.3's accurate predictor), the exhaustive search (N <= 7) and vLLM FCFS, beside the paper's
claims. Then the search alone: on the plan of all N requests at time 0 (true lengths), G of the annealer vs the
exhaustive optimum. Usage: ``python scripts/reproduce/sa.py [--seeds 3]``.
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
PAPER = "paper: SA >= vLLM in G by 0.3%..46.5% (Fig. 7), SA within 1.0% of exhaustive"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="*", default=[4, 6, 8, 10, 20, 40])
    args = ap.parse_args()
    print(PAPER)
    print(f"{'B':>2} {'N':>3} {'policy':>14} {'G':>8} {'attain':>7} {'latency':>8}  (mean of {args.seeds} seeds)")
    for b in (1, 2, 4):
        for n in args.sizes:
            pols = {"sa": lambda s: POLICIES["sa"](ENGINE, max_batch_size=b, seed=s),
                    "sa-oracle": lambda s: POLICIES["sa"](ENGINE, max_batch_size=b, seed=s, predictor="oracle"),
                    "vllm-fcfs": lambda s: make_policy("vllm", ENGINE, max_num_seqs=b)}
            if n <= 7:
                pols["sa-exhaustive"] = lambda s: POLICIES["sa-exhaustive"](ENGINE, max_batch_size=b, seed=s)
            for name, mk in pols.items():
                vals = np.array([run(mk(s), n, 100 * n + s) for s in range(args.seeds)])
                g, a, lat = vals.mean(axis=0)
                print(f"{b:>2} {n:>3} {name:>14} {g:8.4f} {a:7.3f} {lat:8.2f}")
    print("search alone, time-0 plan of all N requests with true lengths: worst 1 - G(SA)/G(exhaustive) over seeds")
    for b in (1, 2, 4):
        gaps = {n: max(search_gap(b, n, 100 * n + s) for s in range(args.seeds)) for n in (4, 5, 6, 7)}
        print(f"B={b}: " + ", ".join(f"N={n} {gap:.2%}" for n, gap in gaps.items()))


if __name__ == "__main__":
    main()

"""SA plan-search overhead for 10 requests (Huang et al. 2025 Table 1: 0.48 ms; exhaustive 287 s at B_max = 1).

Prints the median wall time of :func:`slogym.baselines.sa.anneal` on seeded 10-request ``sa-mix``-like problems and
the ratio against the exhaustive search measured in the same run (N = 10, B_max = 1: 10! plans; ``--n-exh`` lowers
it on a slow machine). Run under ``nice``; one core.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from slogym.baselines.sa import anneal, build_problem, exhaustive
from slogym.engines.registry import get_engine

ENGINE = get_engine("qwen2.5-7b-v100-tp2")


def problem(n: int, bmax: int, seed: int):
    rng = np.random.default_rng(seed)
    chat = rng.random(n) < 0.5
    L = np.where(chat, rng.integers(200, 1500, n), rng.integers(50, 400, n))
    O = np.where(chat, rng.integers(50, 600, n), rng.integers(50, 400, n))
    return build_problem(ENGINE, bmax, L, O, np.where(chat, np.inf, 30.0), np.where(chat, 10.0, np.inf),
                         np.where(chat, 0.05, np.inf), np.zeros(n), np.arange(n, dtype=float))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--n-exh", type=int, default=10)
    args = ap.parse_args()
    p = problem(10, 1, 0)
    times = []
    for i in range(args.reps):
        t = time.perf_counter()
        anneal(p, np.random.default_rng(i))
        times.append(time.perf_counter() - t)
    sa = float(np.median(times))
    pe = problem(args.n_exh, 1, 0)
    t = time.perf_counter()
    exhaustive(pe)
    ex = time.perf_counter() - t
    print(f"SA search, N=10, B_max=1: median {sa * 1e3:.3f} ms over {args.reps} runs (paper 0.48 ms; target 0.5 ms)")
    print(f"exhaustive, N={args.n_exh}, B_max=1: {ex:.2f} s (paper 287 s at N=10); ratio exhaustive/SA = {ex / sa:.0f}x")


if __name__ == "__main__":
    main()

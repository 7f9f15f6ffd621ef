"""SA plan-search overhead for 10 requests (Huang et al. 2025 Table 1: 0.48 ms at B_max = 1; exhaustive 287 s).

For seeded 10-request ``sa-mix``-like problems (the paper's SLOs: code e2e 30 s, chat TTFT 10 s / TPOT 50 ms),
prints the median time of :func:`slogym.baselines.sa.anneal` (its levels run in one compiled Numba call; the first
call, which loads or compiles it, is not timed) per population size ``L`` (the paper's default 500 and smaller
ones), as CPU time of this thread (robust to other processes on a shared machine) and wall time, and its ``G``
against the exhaustive optimum. References measured in the same run: the paper-literal sequential annealing in
Python (one move at a time, Metropolis per move, the same ``L`` x 32 evaluations, NumPy moves and objective) and
the exhaustive search (N = 10, B_max = 1: 10! plans; ``--n-exh`` lowers it on a slow machine). A breakdown line
splits the default search into its compiled loop and the rest (start solutions, seeding its generator). Run on one quiet
core: ``taskset -c 1 nice ...``.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import numpy as np

from slogym.baselines import sa
from slogym.baselines.sa import AnnealConfig, PlanProblem, _propose, anneal, build_problem, exhaustive
from slogym.engines.registry import get_engine

ENGINE = get_engine("qwen2.5-7b-v100-tp2")


def problem(n: int, bmax: int, seed: int) -> PlanProblem:
    rng = np.random.default_rng(seed)
    chat = rng.random(n) < 0.5
    L = np.where(chat, rng.integers(200, 1500, n), rng.integers(50, 400, n))
    O = np.where(chat, rng.integers(50, 600, n), rng.integers(50, 400, n))
    return build_problem(ENGINE, bmax, L, O, np.where(chat, np.inf, 30.0), np.where(chat, 10.0, np.inf),
                         np.where(chat, 0.05, np.inf), np.zeros(n), np.arange(n, dtype=float))


def sequential_anneal(p: PlanProblem, rng: np.random.Generator, cfg: AnnealConfig) -> float:
    """Algorithm 1 read literally: one plan, ``L`` moves per level one after another, Metropolis per move."""
    starts = np.concatenate([p.fill(np.arange(p.n)), p.fill(np.argsort(p.exec_time[-1], kind="stable"))])
    gs = p.objective(starts)
    j = int(np.argmax(gs))
    cur, g_cur = starts[j:j + 1], float(gs[j])
    size = p.score(cur)[2]
    best, scale = g_cur, 100.0 / g_cur
    for t in cfg.temperatures():
        for _ in range(cfg.iters):
            kind, r, r2 = rng.integers(0, 3, 1), rng.integers(0, p.n, 1), rng.integers(0, p.n, 1)
            prop = _propose(cur, size, p.max_batch, kind, r, r2)
            met, lat, prop_size = p.score(prop)
            g = float(met[0] / lat[0])
            if g >= g_cur or rng.random() < math.exp((g - g_cur) * scale / t):
                cur, g_cur, size = prop, g, prop_size
                best = max(best, g)
    return best


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median CPU (thread) time and median wall time of ``fn`` over ``reps`` calls, in seconds."""
    cpu, wall = [], []
    for _ in range(reps):
        c, w = time.thread_time(), time.perf_counter()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return float(np.median(cpu)), float(np.median(wall))


def search_time(pb: PlanProblem, reps: int, size: int = 500) -> tuple[float, float]:
    """Median CPU (thread) and wall seconds of one search (``L = size`` x 32 levels) on ``pb``; the first call,
    which loads or compiles the compiled loop, is not timed."""
    anneal(pb, np.random.default_rng(0))
    cfg = AnnealConfig(iters=size)
    seeds = iter(range(10 ** 6))
    return timed(lambda: anneal(pb, np.random.default_rng(next(seeds)), cfg), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--seq-reps", type=int, default=3)
    ap.add_argument("--n-exh", type=int, default=10)
    ap.add_argument("--sizes", type=int, nargs="*", default=[500, 128, 32])
    args = ap.parse_args()
    p = problem(10, 1, 0)
    c = time.thread_time()
    g_ex = exhaustive(problem(args.n_exh, 1, 0))[1]
    ex = time.thread_time() - c
    print(f"exhaustive, N={args.n_exh}, B_max=1: {ex:.2f} s CPU (paper 287 s at N=10), G* = {g_ex:.5f}")
    seq_cfg = AnnealConfig()
    rng = np.random.default_rng(0)
    seq_cpu, _ = timed(lambda: sequential_anneal(p, rng, seq_cfg), args.seq_reps)
    print(f"sequential SA (paper-literal, L=500 x 32 levels one move at a time): median {seq_cpu * 1e3:.1f} ms CPU")
    for bmax in (1, 4):
        pb = problem(10, bmax, 0)
        for size in args.sizes:
            cfg = AnnealConfig(iters=size)
            cpu, wall = search_time(pb, args.reps, size)
            line = (f"SA search, N=10, B_max={bmax}, L={size:>3}: median {cpu * 1e3:.3f} ms CPU, {wall * 1e3:.3f} ms "
                    f"wall over {args.reps} runs (paper 0.48 ms; target 0.5 ms)")
            if bmax == 1:
                gaps = [1 - anneal(p, np.random.default_rng(s), cfg)[1] / g_ex for s in range(10)]
                line += (f"; ratio sequential/SA = {seq_cpu / cpu:.1f}x, exhaustive/SA = {ex / cpu:.0f}x" +
                         (f"; G within {max(gaps):.2%} of exhaustive (worst of 10 seeds)" if args.n_exh == 10 else ""))
            print(line)
    print(breakdown(p, args.reps))


def breakdown(p: PlanProblem, reps: int) -> str:
    """Median CPU time of the compiled loop inside the default search vs the whole search (same calls)."""
    loop: list[float] = []

    def timed_loop(*a: object) -> object:
        c = time.thread_time()
        out = kernel(*a)
        loop.append(time.thread_time() - c)
        return out

    kernel, sa.anneal_population = sa.anneal_population, timed_loop
    try:
        seeds = iter(range(10 ** 6))
        total, _ = timed(lambda: anneal(p, np.random.default_rng(next(seeds))), reps)
    finally:
        sa.anneal_population = kernel
    return (f"breakdown, N=10, B_max=1, L=500: compiled loop median {np.median(loop) * 1e3:.3f} ms CPU of "
            f"{total * 1e3:.3f} ms (the rest: start solutions, seeding, call overhead)")


if __name__ == "__main__":
    main()

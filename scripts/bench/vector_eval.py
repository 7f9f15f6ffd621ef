"""Batch-time evaluations per second of the vectorized evaluator: NumPy and (where a GPU exists) CuPy, measured in
the same run, for batch counts from 1 to 1M, with the NumPy/CuPy ratio.

    .venv/bin/python scripts/bench/vector_eval.py [--engine llama3-8b-h100]
"""

from __future__ import annotations

import argparse
import time

from slogym.core.batch import BatchFeatures
from slogym.engines import get_engine
from slogym.engines.arrays import BatchTimeEvaluator, array_module


def rate(ev: BatchTimeEvaluator, f, repeat: int = 5) -> float:
    ev(f)  # warm-up (CuPy compiles its kernels on first use)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        ev(f)
        best = min(best, time.perf_counter() - t0)
    return len(f) / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="llama3-8b-h100")
    a = ap.parse_args()
    eng = get_engine(a.engine)
    backends = {"numpy": BatchTimeEvaluator(eng, "numpy")}
    try:
        array_module("cupy")
        backends["cupy"] = BatchTimeEvaluator(eng, "cupy")
    except RuntimeError as e:
        print(f"CuPy: unavailable here ({e})")
    print(f"{'batches':>9s} " + " ".join(f"{b + ' evals/s':>16s}" for b in backends)
          + ("   cupy/numpy" if "cupy" in backends else ""))
    for m in (1, 64, 4096, 65536, 1 << 20):
        f = BatchFeatures.random(m)
        r = {b: rate(ev, f) for b, ev in backends.items()}
        ratio = f"   {r['cupy'] / r['numpy']:10.2f}x" if "cupy" in r else ""
        print(f"{m:9d} " + " ".join(f"{v:16.3e}" for v in r.values()) + ratio)


if __name__ == "__main__":
    main()

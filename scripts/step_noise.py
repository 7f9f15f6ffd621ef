"""Spread of repeated identical engine steps, per engine set-up (A/B/...), on one machine at one time.

Starts one live engine per arm (same model, same config except the arm's environment / CPU pinning), warms each
(``--warm`` decode steps: the ``norm`` reference's calibration), then runs ``--rounds`` rounds; in each round
every arm runs one block of ``--block`` identical steps of each batch (a decode batch after 8 settling steps, or
a prefill after a one-request decode step, as the profiler measures them), the arms' blocks interleaved so the
machine's load phases fall on all arms alike. Printed per arm and batch, for each clock -- ``wall`` (elapsed
time of ``LLMEngine.step()``), ``process`` (the engine process's CPU time), ``cpu`` (the engine thread's CPU
time, what ``timing="cpu"`` uses with one thread) and ``norm`` (CPU time x the reference kernel's factor,
``e = 1``) -- the mean |t / median - 1| in % within each block (``blk``: step-to-step noise) and over the whole
run (``run``: with the drift between blocks), the median step, and per step the mean minor page faults and
involuntary context switches inside the step.

    python scripts/step_noise.py --arms base,thp --rounds 12
    python scripts/step_noise.py --arms base,pin1 --gap-ms 3

Arms (``ARMS``): ``base`` (the engine as the fidelity script runs it), ``thp`` (transparent huge pages for torch's
and glibc's large allocations: ``THP_MEM_ALLOC_ENABLE=1``, ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``; the
machine's THP mode is ``madvise``), ``malloc`` (glibc never trims or unmaps freed memory: no page faults from
re-growing the heap), ``pin0`` / ``pin1`` (the engine thread pinned to one core), ``nogc`` (Python's GC
disabled inside the step), ``fifo`` (the engine thread under the real-time policy ``SCHED_FIFO``: other
processes cannot preempt it inside a step; it still blocks between steps), ``fifo_thp`` (both).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from slogym.engines.live import EngineConfig, VLLMEngine, make_tiny_model
from slogym.engines.profiler import _Driver

ROOT = Path(__file__).resolve().parents[1]
ARMS: dict[str, dict[str, Any]] = {
    "base": {},
    "thp": {"env": {"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}},
    "malloc": {"env": {"MALLOC_TRIM_THRESHOLD_": str(2 ** 40), "MALLOC_MMAP_THRESHOLD_": str(2 ** 40),
                       "MALLOC_TOP_PAD_": str(2 ** 28)}},
    "pin0": {"cpu": 0},
    "pin1": {"cpu": 1},
    "nogc": {"gc_in_step": False},
    "fifo": {"rt_priority": 1},
    "fifo_thp": {"rt_priority": 1, "env": {"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}},
}
CLOCKS = ("wall", "process", "cpu", "norm")


def batches(spec: str) -> list[tuple[str, int, int]]:
    """``decode:2:256,prefill:128`` -> [("decode", 2, 256), ("prefill", 128, 0)]."""
    out = []
    for item in spec.split(","):
        kind, *nums = item.split(":")
        if kind not in ("decode", "prefill") or len(nums) != (2 if kind == "decode" else 1):
            raise ValueError(f"batch {item!r}: expected decode:SEQS:CONTEXT or prefill:TOKENS")
        out.append((kind, int(nums[0]), int(nums[1]) if kind == "decode" else 0))
    return out


def block(engine: VLLMEngine, batch: tuple[str, int, int], n: int, gap: float) -> list[dict[str, float]]:
    """``n`` measured identical steps of ``batch`` (from an empty engine), their raw timings."""
    d = _Driver(engine)
    kind, a, ctx = batch
    rows: list[dict[str, float]] = []

    def measured(items: list[tuple[int, int]]) -> None:
        norm = d.step(items)[0]
        r = d.last
        rows.append({"wall": r["time_s"], "process": r["process_cpu_s"], "cpu": r["cpu_s"], "norm": norm,
                     "minflt": r["minflt"], "nivcsw": r["nivcsw"]})
        if gap:
            time.sleep(gap)

    if kind == "decode":
        rids = [d.new(ctx, n + 12) for _ in range(a)]
        d.prefill_all(rids, engine.config.max_num_batched_tokens)
        for _ in range(8):
            d.step([(r, 1) for r in rids])
        for _ in range(n):
            measured([(r, 1) for r in rids])
    else:
        res = d.new(16, n + 4)
        d.prefill_all([res], engine.config.max_num_batched_tokens)
        for _ in range(n):
            d.step([(res, 1)])
            p = d.new(a, 1)
            measured([(p, a)])
            d.release([p])
    d.release()
    return rows


def spread(blocks: list[list[dict[str, float]]], clock: str) -> tuple[float, float, float]:
    """(within-block spread %, whole-run spread %, median) of ``clock`` over ``blocks``."""
    per = [np.array([r[clock] for r in b]) for b in blocks]
    allv = np.concatenate(per)
    blk = np.concatenate([np.abs(v / np.median(v) - 1.0) for v in per]).mean() * 100.0
    return float(blk), float(np.abs(allv / np.median(allv) - 1.0).mean() * 100.0), float(np.median(allv))


def huge_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="base,thp", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--model", default=str(ROOT / ".cache" / "medium-llama"),
                    help="model dir (default: the fidelity script's medium model, built if absent)")
    ap.add_argument("--batches", default="decode:2:256,decode:16:128,prefill:128",
                    help="decode:SEQS:CONTEXT / prefill:TOKENS, comma-separated")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=25, help="measured steps per block")
    ap.add_argument("--warm", type=int, default=600, help="unmeasured decode steps per engine first")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="sleep between measured steps (a replay's gaps)")
    args = ap.parse_args(argv)
    names = args.arms.split(",")
    if bad := [a for a in names if a not in ARMS]:
        raise SystemExit(f"unknown arm(s) {bad}; known: {list(ARMS)}")
    model = make_tiny_model(args.model, hidden=512, layers=4, heads=16)
    todo = batches(args.batches)
    engines: dict[str, VLLMEngine] = {}
    try:
        for name in names:
            arm = ARMS[name]
            cfg = EngineConfig(model=str(model), num_blocks=256, max_num_seqs=32, max_num_batched_tokens=1024,
                               max_model_len=896, timing="norm", step_timeout=300.0, env=arm.get("env", {}),
                               gc_in_step=arm.get("gc_in_step", True), rt_priority=arm.get("rt_priority", 0))
            engines[name] = e = VLLMEngine(cfg)
            if "cpu" in arm:
                os.sched_setaffinity(e.pid, {arm["cpu"]})
            left = args.warm
            while left > 0:
                left -= len(block(e, ("decode", 4, 128), min(left, 200), 0.0))
        for name, e in engines.items():
            print(f"{name}: engine {e.pid}, AnonHugePages {huge_kb(e.pid)} kB", file=sys.stderr)
        res: dict[tuple[str, int], list[list[dict[str, float]]]] = {}
        t0 = time.time()
        for rnd in range(args.rounds):
            for j in range(len(todo)):
                for k in range(len(names)):  # rotate the arms' order every round
                    name = names[(k + rnd) % len(names)]
                    res.setdefault((name, j), []).append(block(engines[name], todo[j], args.block,
                                                               args.gap_ms / 1e3))
            print(f"round {rnd + 1}/{args.rounds} ({time.time() - t0:.0f} s), load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr)
    finally:
        for e in engines.values():
            e.close()
    print(f"load average at the end: {' / '.join(f'{v:.2f}' for v in os.getloadavg())}; "
          f"{args.rounds} rounds x {args.block} steps per arm and batch; spread = mean |t / median - 1| %")
    print(f"{'arm':7s} {'batch':16s} " + " ".join(f"{c + ' blk/run':>15s}" for c in CLOCKS)
          + f" {'median cpu ms':>13s} {'minflt':>7s} {'nivcsw':>7s}")
    for j, b in enumerate(todo):
        for name in names:
            blocks = res[(name, j)]
            cells = [spread(blocks, c) for c in CLOCKS]
            flat = [r for bl in blocks for r in bl]
            print(f"{name:7s} {':'.join(map(str, b)):16s} "
                  + " ".join(f"{s[0]:7.2f}/{s[1]:7.2f}" for s in cells)
                  + f" {cells[2][2] * 1e3:13.3f} {np.mean([r['minflt'] for r in flat]):7.2f}"
                  f" {np.mean([r['nivcsw'] for r in flat]):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

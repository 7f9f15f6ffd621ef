"""SLOs-Serve scheduler overhead: one invocation of the multi-SLO DP (§3.2.1) with 10 new + 100 running requests
in 2 TPOT tiers (the paper's §3.2.1 "zero to ten new requests and dozens to hundreds of running requests").

    taskset -c 1 python scripts/bench/scheduler_overhead.py [--new 10] [--running 100] [--repeats 300]

One invocation = :meth:`Planner.problem` (reading the replica's state, building ``time2bs`` with one vectorized
perf-model call) + :func:`solve_admission` (the PB* table over every count vector via App. D, the vectorized DP,
reconstruction). The state: a ``mixed`` workload (tight and loose TPOT tiers) on one llama3-8b-h100 replica with
``--running`` admitted requests (90% decoding, 10% mid-prefill) and ``--new`` arrived requests. Target: median
<= 1 ms on one core. As a same-run reference it also times one Sarathi ``next_batch`` on the same replica.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from slogym.baselines.sarathi import SarathiScheduler
from slogym.baselines.slos_serve import POLICIES, solve_admission
from slogym.core.simulator import Simulator
from slogym.core.state import Status
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload


def _times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def build(n_new: int, n_running: int, seed: int = 0):
    """A simulator whose replica 0 holds ``n_running`` admitted requests and ``n_new`` arrived ones."""
    eng = get_engine("llama3-8b-h100")
    w = make_workload("mixed", rate=50.0, n_requests=n_new + n_running, seed=seed, engine=eng)
    pol = POLICIES["slos-serve"](eng)
    sim = Simulator(w, eng, pol, seed=seed)
    pol.reset(sim)
    rs, inst, st = sim.rs, sim.instances[0], pol.router.state
    now = float(w.arrival[n_running - 1])
    rng = np.random.default_rng(seed)
    for k in range(n_running):
        r = k
        rs.ready[r] = w.arrival[r]
        rs.instance[r] = rs.slot[r] = 0
        st.admitted_on[r] = 0
        if k % 10:  # decoding: some output tokens generated, KV resident
            g = int(rng.integers(1, max(2, w.output_tokens[r] // 2)))
            rs.stage[r] = w.stage_ptr[r] + 1
            rs.num_computed[r] = w.input_tokens[r] + g - 1
            rs.num_tokens[r] = rs.num_computed[r] + 1
            rs.gen_in_stage[r] = g
            rs.tpot[r] = w.stage_tpot[w.stage_ptr[r] + 1]
            rs.dl_base[r] = w.arrival[r] + w.stage_ttft[w.stage_ptr[r]]
        else:  # mid-prefill, arrived within the last 20 ms
            rs.ready[r] = now - float(rng.uniform(0.0, 0.02))
            rs.num_tokens[r] = w.input_tokens[r]
            rs.num_computed[r] = w.input_tokens[r] // 2
        rs.kv_blocks[r] = -(-int(rs.num_computed[r]) // inst.block_size)
        rs.status[r] = Status.RUNNING
        inst.running.append(r)
    inst.free_blocks = inst.total_blocks - int(rs.kv_blocks[:n_running].sum())
    inst.running_changed()
    new = np.arange(n_running, n_running + n_new)
    for r in new.tolist():  # arrived within the last 10 ms (a burst the scheduler decides on together)
        rs.ready[r] = now - float(rng.uniform(0.0, 0.01))
        rs.num_tokens[r] = w.input_tokens[r]
    return sim, pol, inst, new, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=10)
    ap.add_argument("--running", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args()
    sim, pol, inst, new, now = build(a.new, a.running)
    planner = pol.router.state.planner(inst)

    def dp() -> None:
        prob, _, plan, inv = planner.problem(new, now)
        solve_admission(prob, plan, inv)

    prob, pos, plan, inv = planner.problem(new, now)
    res = solve_admission(prob, plan, inv)
    print(f"instance: {a.running} running ({int(prob.base.sum())} decoding, {int(prob.forced.sum())} prefilling), "
          f"{a.new} new, tiers TPOT {prob.tpot.tolist()} s, memory units {prob.mem_units}; "
          f"DP admits {int(res.accepted[~prob.forced].sum())}/{a.new} new")
    _times(dp, 20)  # warm-up
    t = np.array(_times(dp, a.repeats)) * 1e3
    sar = SarathiScheduler(token_budget=512)
    sar.reset(sim)
    ref = np.array(_times(lambda: sar.next_batch(inst, now), a.repeats)) * 1e3
    print(f"DP invocation: median {np.median(t):.3f} ms, p99 {np.percentile(t, 99):.3f} ms "
          f"(target <= 1 ms median: {'met' if np.median(t) <= 1.0 else 'NOT met'})")
    print(f"reference Sarathi next_batch on the same replica: median {statistics.median(ref):.3f} ms; "
          f"ratio DP / Sarathi {np.median(t) / statistics.median(ref):.1f}x")


if __name__ == "__main__":
    main()

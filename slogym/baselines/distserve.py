"""DistServe: prefill/decode disaggregation with a static instance ratio and FCFS in each pool.

DistServe (Zhong et al., OSDI'24, "Disaggregating prefill and decoding for goodput-optimized LLM serving") runs
prompts on prefill instances and decode steps on decode instances, moving each request's KV cache in between,
and sizes the two pools for the workload offline. SLOs-Serve uses it as its disaggregated baseline (§2.3,
Fig. 4: capacity depends on the prefill:decode ratio) and derives the capacity-optimal ratio in Appendix A
(:func:`optimal_pd_ratio`). Its three statements of the ChatBot / Coder ratios disagree (§2.3's prose, Appendix
A's prose and Appendix A's formula; docs/baselines/distserve.md): slogym implements the formula alone.

Mechanisms and where they live:

* Static ratio: the cluster's ``pd=(P, D)`` split (``Simulator(pd=...)``, ``slogym simulate --pd P:D``). On a
  colocated cluster of ``n >= 2`` instances :class:`DistServeRouter` splits it at reset with ``pd=(P, D)`` given
  as a policy parameter, else with the Appendix A ratio for the run's workload (:func:`pd_split_for`). One
  instance cannot be split: it runs colocated FCFS.
* Dispatch (DistServe's online scheduling; the DistServe paper is not in this repository, so this is
  reconstructed from its description): a new request goes to the prefill instance with the shortest queue
  (fewest resident requests), its KV to the least-loaded decode instance (most free KV blocks, the
  simulator's default ``route_decode``). The KV transfer time is the simulator's :class:`KVTransfer` model.
* FCFS in each pool: vLLM's FCFS scheduler (:class:`~slogym.baselines.vllm.VLLMScheduler`) on both roles. A
  prefill instance only ever prefills (requests leave it when their prefill completes). Deviation from plain
  vLLM on decode instances: requests whose KV arrived join the running decode batch in FCFS order, within
  ``max_num_seqs`` and free KV, instead of being admitted by a separate prefill-first iteration (a
  decode instance has nothing to prefill, and DistServe batches new arrivals with the running decodes).
* :func:`ratio_sweep` replays a workload under every split of ``n`` instances (Fig. 4's experiment).

Deviations: DistServe's placement search over parallelism configurations (intra-op/inter-op degrees per
pool) is not modelled -- both pools use the engine preset; follow-up prefills after a tool call or a new user
turn run on the instance holding the KV (the decode instance), as a recompute after preemption does.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from slogym.baselines.common import decode_batch, make_room_for_decodes, split_colocated, split_running
from slogym.baselines.vllm import VLLMScheduler
from slogym.core.batch import Batch, BatchFeatures
from slogym.core.cluster import KVTransfer
from slogym.core.instance import Instance, Role
from slogym.core.policy import DEFER, Policy, Router
from slogym.core.request import StageKind, Workload
from slogym.core.simulator import Simulator


# ---------------------------------------------------------------------------------------------- SLOs-Serve App. A
def optimal_pd_ratio(mean_input: float, mean_output: float, tpot: float = math.inf, overhead: float = 0.0) -> float:
    """Capacity-optimal ``n_prefill / n_decode`` (SLOs-Serve §2.3 and Appendix A).

    Appendix A assumes devices at maximum token throughput ``MaxTokenTpt``, perfect scaling, and a batch time
    linear in its tokens, ``BatchTime(n) = n / MaxTokenTpt + Overhead``. Prefill devices must keep up with the
    input tokens, ``g E[I] <= MaxTokenTpt n_prefill``; decode devices run one token of every resident request
    per batch within the TPOT, which gives ``g <= (1 - Overhead / TPOT) MaxTokenTpt n_decode / E[O]``. Both
    bounds meet at

        n_prefill / n_decode = (1 - Overhead / TPOT) * E[I] / E[O]

    (the paper's ``C / T_OPT`` is ``Overhead / TPOT``). ``tpot`` = inf (no TPOT SLO) gives ``E[I] / E[O]``.
    """
    for name, v in (("mean_input", mean_input), ("mean_output", mean_output)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name}={v!r}; must be a positive finite number of tokens")
    if not tpot > 0 or not overhead >= 0:
        raise ValueError(f"tpot={tpot!r} must be > 0 and overhead={overhead!r} >= 0")
    if overhead >= tpot:
        raise ValueError(f"overhead={overhead!r} s >= tpot={tpot!r} s: no decode batch meets the TPOT")
    return (1.0 - overhead / tpot) * mean_input / mean_output


def optimal_goodput(max_token_tpt: float, mean_input: float, mean_output: float, tpot: float = math.inf,
                    overhead: float = 0.0) -> float:
    """SLOs-Serve Appendix A Eq. 4: the best per-device goodput of disaggregation at the optimal ratio,
    ``g* = MaxTokenTpt / (TPOT / (TPOT - Overhead) E[O] + E[I])`` requests per second per device."""
    optimal_pd_ratio(mean_input, mean_output, tpot, overhead)  # validates the arguments
    stretch = 1.0 if math.isinf(tpot) else tpot / (tpot - overhead)
    return max_token_tpt / (stretch * mean_output + mean_input)


def batch_time_line(engine: Any, tokens_per_request: int = 128, max_tokens: int = 4096) -> tuple[float, float]:
    """``(MaxTokenTpt, Overhead)`` of Appendix A's linear batch time, fitted (least squares) to the engine's
    perf model on prefill batches of ``tokens_per_request``-token requests, 1..``max_tokens`` tokens."""
    n_req = np.arange(1, max_tokens // tokens_per_request + 1, dtype=np.int64)
    tok = n_req * tokens_per_request
    zero = np.zeros_like(n_req)
    f = BatchFeatures(tok, n_req, tok * tokens_per_request, tok * tokens_per_request, zero, zero, zero, zero, zero)
    t = np.asarray(engine.batch_time(f), dtype=np.float64)
    slope, overhead = np.polyfit(tok.astype(np.float64), t, 1)
    return float(1.0 / slope), float(max(overhead, 0.0))


def workload_stats(w: Workload) -> tuple[float, float, float]:
    """Mean prompt tokens, mean output tokens, and the tightest finite TPOT SLO (inf if none) of ``w``."""
    dec = w.stage_kind == StageKind.DECODE
    tp = w.stage_tpot[dec]
    tp = tp[np.isfinite(tp)]
    tpot = float(tp.min()) if tp.size else math.inf
    return float(w.input_tokens.mean()), float(max(w.output_tokens.mean(), 1.0)), tpot


def pd_split(n: int, ratio: float) -> tuple[int, int]:
    """Integer (P, D) with P + D = n, both >= 1, closest to ``P / D = ratio``."""
    if n < 2:
        raise ValueError(f"n={n}: a prefill/decode split needs at least 2 instances")
    best = min(range(1, n), key=lambda p: (abs(math.log(p / (n - p)) - math.log(ratio)), p))
    return best, n - best


def pd_split_for(w: Workload, engine: Any, n: int) -> tuple[int, int]:
    """The Appendix A split of ``n`` instances for workload ``w`` on ``engine``."""
    mean_in, mean_out, tpot = workload_stats(w)
    _, overhead = batch_time_line(engine)
    return pd_split(n, optimal_pd_ratio(mean_in, mean_out, tpot, min(overhead, 0.5 * tpot)))


# ---------------------------------------------------------------------------------------------- policy
class DistServeRouter(Router):
    """Shortest-queue dispatch over prefill instances; KV to the least-loaded decode instance (the default
    ``route_decode``). At reset it splits a colocated cluster of n >= 2 instances into ``pd`` (or the
    Appendix A split) through ``sim.switch_role``; it leaves the cluster colocated when the KV transfer size
    is unknown (an engine without a KV size and no ``KVTransfer(bytes_per_token=...)``: test engines)."""

    pd_aware = True

    def __init__(self, pd: tuple[int, int] | None = None) -> None:
        self.pd = None if pd is None else (int(pd[0]), int(pd[1]))

    def reset(self, sim: Simulator) -> None:
        split_colocated(sim, lambda n: self.pd if self.pd is not None else pd_split_for(sim.w, sim.engines[0], n),
                        "distserve")

    def route(self, req: int, sim: Simulator, now: float) -> int:
        cands = sim.accepting_instances(Role.PREFILL) or sim.accepting_instances(Role.COLOCATED)
        if not cands:
            return DEFER
        return min(cands, key=lambda i: (sim.instances[i].n_resident, i))


class DistServeScheduler(VLLMScheduler):
    """vLLM FCFS on every instance; on DECODE instances, requests whose KV arrived join the decode batch."""

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        if inst.role != Role.DECODE or not inst.waiting:
            return super().next_batch(inst, now)
        arrived = np.asarray(inst.waiting, dtype=np.int64)
        dec, pre = split_running(inst)
        if pre.size or (inst.remaining(arrived) != 1).any():  # a recompute after preemption: vLLM's path
            return super().next_batch(inst, now)
        arrival = inst.sim.w.arrival
        keep, victims, free = make_room_for_decodes(inst, dec, arrival[inst.running_array()])
        if victims:
            return decode_batch(keep, victims)
        free -= int(self.watermark * inst.total_blocks)
        # FCFS: the longest prefix of arrivals whose KV fits, within the sequence limit
        fits = int(np.searchsorted(np.cumsum(inst.blocks_needed(arrived, 1)), free, side="right"))
        admit = arrived[:max(min(fits, self.max_num_seqs - keep.size), 0)]
        reqs = np.concatenate((keep, admit))
        if not reqs.size:
            return None
        return decode_batch(reqs, steady=not admit.size)


def make_distserve(engine: Any = None, router: Router | None = None, pd: tuple[int, int] | None = None,
                   **params: Any) -> Policy:
    """The ``distserve`` policy: ``params`` go to the vLLM FCFS scheduler (``max_num_seqs``,
    ``max_num_batched_tokens``, ``watermark``; defaults from the engine); ``pd`` splits a colocated cluster."""
    defaults = {} if engine is None else {"max_num_seqs": int(engine.max_num_seqs),
                                          "max_num_batched_tokens": int(engine.max_num_batched_tokens)}
    sched = DistServeScheduler(**(defaults | params))
    rt = router or DistServeRouter(pd)
    full = {"scheduler": type(sched).__name__, "router": type(rt).__name__, "pd": pd} | {
        k: v for k, v in vars(sched).items() if not k.startswith("_")}
    return Policy(name="distserve", scheduler=sched, router=rt, params=full)


POLICIES: dict[str, Callable[..., Policy]] = {"distserve": make_distserve}


# ---------------------------------------------------------------------------------------------- ratio sweep
def ratio_sweep(w: Workload, engine: Any, n_instances: int, transfer: KVTransfer | None = None, seed: int = 0,
                attainment: str = "dslo", **params: Any) -> list[dict[str, Any]]:
    """Replay ``w`` under DistServe with every split ``P:D`` of ``n_instances`` (P = 1..n-1): one row per split
    with attainment, goodput, TTFT/TPOT p90 and cost (SLOs-Serve Fig. 4's experiment)."""
    rows = []
    for p in range(1, n_instances):
        pd = (p, n_instances - p)
        sim = Simulator(w, engine, make_distserve(engine, **params), pd=pd, transfer=transfer, seed=seed,
                        attainment=attainment).run()
        s = sim.result().summary
        rows.append({"pd": pd, "attainment": s["attainment"], "goodput": s["goodput"],
                     "ttft_p90": s["ttft_p90"], "tpot_p90": s["tpot_p90"],
                     "cost_instance_seconds": s["cost_instance_seconds"], "kv_transfers": s["kv_transfers"]})
    return rows

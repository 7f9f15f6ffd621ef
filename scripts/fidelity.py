"""Simulator-vs-engine fidelity: replay one trace window on a live vLLM engine and in the simulator.

Steps (one engine process for all of them):

1. warm the engine over every batch token count (``warm_shapes``: vLLM's CPU GEMMs set up a kernel per new
   shape, ~2x the step the first time; a long-running server has seen them all), then profile it
   (``slogym.engines.profiler``, HyperFlexis App. A grid within the engine's limits) in ``--repeats``
   shuffled passes, each visit the median of ``--measure`` back-to-back iterations; measure the back-to-back
   noise floor (``repeat_ratios``);
2. take ``--requests`` requests of the Azure conversation trace (``../shared/traces``; a generated chat
   workload when absent), scaled to the tiny model (token counts divided by ``--token-scale``, capped), with
   arrivals rescaled to ``--rate``, and run each policy on the live engine (as fast as possible; planning
   policies see a model fitted to the passes so far); with ``--calibrate N``, first replay the NEXT N requests
   of the trace with each policy, whose live iterations join the fit (reported beside the profile-only fit);
3. profile ``--repeats-after`` more passes, so the profile brackets the replays in time, and fit the
   perf-model families that separate prefill from decode work (``fitting.AUTO_FAMILIES``) to the
   per-composition medians of all passes; keep the simplest within 0.05 point of the lowest held-out MAPE
   (``fitting.fit_best``: ``phase-quadratic-pwl`` in every ``medium`` run so far; or ``--family``);
4. run each policy in the simulator with that model (same KV pool, block size and limits) and compare; run it
   again with the live replays' own same-batch measurement noise injected (``NoisySim``) to see how much of
   the per-request error noise alone explains.

Iteration times default to ``--timing norm``: CPU time scaled by a reference kernel timed around each step
(``EngineConfig``), which removes most of the drift of CPU time with the shared machine's load; per batch kind,
the factor's exponent and a price for being descheduled inside the step are fitted on the profile passes
before the replays (``profiler.norm_exponents``, ``--elasticity``) and used for every later step. The engine
thread runs under ``SCHED_FIFO`` (``--rt-priority``, default 1): no other process preempts it inside a step.

Printed: per-iteration time error (MAPE and bias of the fitted model on every batch the live engine executed,
also per batch kind; the noise floor on the live replays' repeated batches, back to back and across profile
passes; ``oracle_mape``, the lowest MAPE any model on batch features could score on the replay's repeated
batches), per-request TTFT / mean TPOT /
TTLT relative error (median, p90), attainment live vs simulated, and where the live and simulated schedules
first differ. ``--json`` prints one object: the pooled metrics at top level and ``per_policy``.

    python scripts/fidelity.py --json                  # medium model in .cache/medium-llama, 300 requests at 1.9/s
    python scripts/fidelity.py --arch small --json     # the previous default (.cache/small-llama) at 3/s
    python scripts/fidelity.py --arch tiny --json      # the CI tests' tiny model (.cache/tiny-llama) at 8/s
    python scripts/fidelity.py --quick --requests 60 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from slogym.baselines import make_policy
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.engines.base import EngineSpec
from slogym.engines.fitting import AUTO_FAMILIES, features_of, fit_best, fit_perf_model
from slogym.core.batch import BatchFeatures
from slogym.core.instance import Instance
from slogym.engines.live import EngineConfig, LiveSimulator, VLLMEngine, live_spec, make_tiny_model
from slogym.engines.live.client import TIMINGS
from slogym.engines.profiler import (ProfileGrid, aggregate, noise_pct, norm_exponents, profile, repeat_ratios,
                                     retime, warm_shapes)

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT.parent / "shared" / "traces" / "azure_conv_2023.csv.gz"
FAMILIES = ("phase-quadratic-pwl", "phase-quadratic", "quadratic", "linear-interaction", "roofline", "table")
ARCHS: dict[str, dict[str, float]] = {
    "tiny": {"hidden": 128, "layers": 2, "heads": 4, "rate": 8.0, "ttft": 0.1, "tpot": 0.006},
    "small": {"hidden": 256, "layers": 4, "heads": 8, "rate": 3.0, "ttft": 0.25, "tpot": 0.015},
    "medium": {"hidden": 512, "layers": 4, "heads": 16, "rate": 1.9, "ttft": 0.5, "tpot": 0.025},
}
"""Random-weight Llama configs (``make_tiny_model``; head_dim 32) with the arrival rate and SLOs that load each
about alike: the engine is busy ~2/3 of the replay (sum of live iteration times / makespan: 0.67 for ``tiny`` at 8
req/s; ``small``'s replay takes 2.6x ``tiny``'s engine time, so 3 req/s and SLOs x2.5). ``small`` (the default until
2026-11-22) does ~8x ``tiny``'s arithmetic per step, so per-step overheads that batch features cannot see
(vLLM's persistent-batch bookkeeping when requests leave and rejoin, the CPU's cache state after the previous
step) and the machine's noise weigh less (docs/live_engine.md, "Model size"); the CI tests use ``tiny`` (faster).
``medium`` (hidden 512, ~4x ``small``'s arithmetic per token, 43 MB of weights; the default) at 1.9 req/s is as
busy as ``small`` at 3 (0.64 against 0.65-0.67); its same-batch noise was about half of ``small``'s on the same
day (4.0-4.9 % against 8.6-9.9 %; docs/live_engine.md, "Model size"), at ~1.4x the run time (14-23 min with the
third session's grid, depending on the load)."""


def trace_workload(n: int, rate: float, token_scale: float, max_prompt: int, max_out: int, ttft: float,
                   tpot: float, seed: int, skip: int = 0) -> tuple[Workload, str]:
    """Requests ``skip .. skip + n`` of the Azure conversation trace (or a seeded synthetic chat mix), scaled to
    the tiny model, arrivals from 0."""
    if AZURE.exists():
        from slogym.workloads.readers import read_azure

        tr = read_azure(AZURE, limit=skip + n)
        arrival, inp, out = tr.arrival[skip:], tr.input_tokens[skip:], tr.output_tokens[skip:]
        src = f"azure_conv_2023 requests {skip}-{skip + n - 1}"
    else:
        rng = np.random.default_rng(seed)
        m = skip + n
        arrival = (np.cumsum(rng.exponential(1.0, m)) - 1.0)[skip:]
        inp = (rng.lognormal(6.5, 1.0, m).astype(int) + 1)[skip:]
        out = (rng.lognormal(5.0, 0.8, m).astype(int) + 1)[skip:]
        src = f"synthetic chat (seed {seed}, requests {skip}-{m - 1}; {AZURE} not found)"
    span = float(arrival[-1] - arrival[0]) or 1.0
    t = (arrival - arrival[0]) * ((n - 1) / rate / span)  # same shape of gaps, mean rate `rate`
    p = np.clip(np.round(inp / token_scale), 4, max_prompt).astype(int)
    o = np.clip(np.round(out / token_scale), 1, max_out).astype(int)
    reqs = [Request(float(t[i]), [prefill(int(p[i]), ttft), decode(int(o[i]), tpot)]) for i in range(n)]
    return Workload.from_requests(reqs), src


def noise_floor(df: pd.DataFrame) -> float:
    """Mean |t / median - 1| (%) over repeats of the same batch (different passes, i.e. different moments): the
    per-iteration error no perf model can beat on this machine."""
    key = ["kind", *BatchFeatures._fields]
    med = df.groupby(key)["time_s"].transform("median")
    return float(np.mean(np.abs(df["time_s"] / med - 1.0)) * 100.0)


def same_batch_ratios(iterations: list[pd.DataFrame], min_repeats: int = 5) -> np.ndarray:
    """t / median of live iterations whose batch (all features) occurred at least ``min_repeats`` times in the
    replays: their measurement noise, free of any model error."""
    it = pd.concat(iterations, ignore_index=True)
    g = it.groupby(list(BatchFeatures._fields))["time_s"]
    keep = (g.transform("size") >= min_repeats).to_numpy()
    return it["time_s"].to_numpy()[keep] / g.transform("median").to_numpy()[keep]


def repeated_split(it: pd.DataFrame, pred: np.ndarray, min_repeats: int = 5) -> dict[str, float]:
    """Per-iteration error on the batches (all features equal) that ran at least ``min_repeats`` times, split in
    two (%): ``repeated_noise``, their times around their own median (measurement noise), and
    ``repeated_model_error``, the model against those medians; ``oracle_mape`` is the MAPE of a model that
    predicted each such batch's own median exactly: the lowest iteration MAPE any model on these features could
    score on this replay (a diagnostic; nothing is fitted on it). ``repeated_mape`` is the model's MAPE on the
    same iterations, ``repeated_share`` their share of all."""
    g = it.groupby(list(BatchFeatures._fields))["time_s"]
    keep = (g.transform("size") >= min_repeats).to_numpy()
    if not keep.any():
        return {}
    t, med, p = it["time_s"].to_numpy()[keep], g.transform("median").to_numpy()[keep], pred[keep]

    def pct(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.mean(np.abs(a / b - 1.0)) * 100.0)

    return {"repeated_share": float(keep.mean()), "repeated_mape": pct(p, t), "repeated_noise": pct(t, med),
            "repeated_model_error": pct(p, med), "oracle_mape": pct(med, t)}


class NoisySim(Simulator):
    """The simulator with every iteration time multiplied by a factor drawn from ``ratios`` (scaled to mean 1):
    what per-iteration measurement noise of the live engine's size does to per-request metrics by itself."""

    def __init__(self, *args: Any, ratios: np.ndarray, seed: int, **kw: Any) -> None:
        self._ratios, self._noise = ratios / ratios.mean(), np.random.default_rng(seed)
        super().__init__(*args, **kw)

    def iteration_time(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray | None,
                       features: BatchFeatures) -> float:
        factor = float(self._ratios[self._noise.integers(self._ratios.size)])
        return super().iteration_time(inst, idx, tok, spec, features) * factor


def noise_only_error(w: Workload, spec: EngineSpec, policy: str, plan_spec: EngineSpec, ratios: np.ndarray,
                     seed: int) -> dict[str, float]:
    """Median per-request error (%) of the simulator with live-sized iteration noise against the noiseless
    simulator: the part of the live-vs-simulated error that noise alone explains."""
    if ratios.size == 0:
        return {}
    base = Simulator(w, spec, make_policy(policy, engine=plan_spec)).run().result().records
    noisy = NoisySim(w, spec, make_policy(policy, engine=plan_spec), ratios=ratios, seed=seed).run().result().records
    return {f"noise_only_{m}_median_rel_err": float(np.median(rel_err(noisy[c], base[c])) * 100.0)
            for m, c in (("ttft", "ttft"), ("tpot", "mean_tpot"), ("ttlt", "ttlt"))}


class _Batches:
    """Records every launched batch (members and tokens) so live and simulated schedules can be compared."""

    def iteration_time(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray | None,
                       features: BatchFeatures) -> float:
        self.batches.append(tuple(zip(idx.tolist(), tok.tolist())))
        return super().iteration_time(inst, idx, tok, spec, features)  # type: ignore[misc]


class RecordingLive(_Batches, LiveSimulator):
    """The live backend, recording its batches."""

    def _reset_state(self) -> None:
        super()._reset_state()
        self.batches: list[tuple[tuple[int, int], ...]] = []


class RecordingSim(_Batches, Simulator):
    """The simulator timing each batch with its perf model, as usual (overriding the hook only turns off
    fast-forward, whose results are identical)."""

    def _reset_state(self) -> None:
        super()._reset_state()
        self.batches = []


def schedule_agreement(live: list[tuple[tuple[int, int], ...]], sim: list[tuple[tuple[int, int], ...]],
                       head: int = 200) -> dict[str, float]:
    """Index of the first batch (members and tokens) that differs, and the share of identical batches among the
    first ``head`` iterations."""
    n = min(len(live), len(sim))
    first = next((k for k in range(n) if live[k] != sim[k]), n)
    h = min(head, n)
    same = sum(live[k] == sim[k] for k in range(h)) / max(h, 1)
    return {"first_divergent_batch": first, f"identical_batches_first_{head}": same}


def fit_profile_medians(records: pd.DataFrame, family: str | None, seed: int,
                        served: pd.DataFrame | None = None) -> tuple[Any, dict[str, Any]]:
    """Fit ``family`` -- or the best of :data:`AUTO_FAMILIES` by held-out MAPE -- to the per-composition medians
    of ``records`` (robust to load bursts on a shared machine) plus the ``served`` rows (calibration replays,
    :func:`served_records`); the report has ``candidates`` when chosen."""
    med = aggregate(records) if served is None else pd.concat([aggregate(records), served], ignore_index=True)
    return fit_perf_model(med, family, seed=seed) if family else fit_best(med, AUTO_FAMILIES, seed=seed)


def profile_drift(pre: pd.DataFrame, post: pd.DataFrame) -> float | None:
    """Median over compositions of (median after the replays / median before - 1), in %: how much the engine's
    speed moved between the profile passes before and after the live runs."""
    if post.empty:
        return None
    a, b = aggregate(pre), aggregate(post)
    key = ["kind", *BatchFeatures._fields]
    m = a.merge(b, on=key, suffixes=("_pre", "_post"))
    return float(np.median(m["time_s_post"] / m["time_s_pre"] - 1.0) * 100.0)


def rel_err(sim: pd.Series, live: pd.Series) -> np.ndarray:
    ok = np.isfinite(sim) & np.isfinite(live) & (live > 0)
    return np.abs(sim[ok].to_numpy() / live[ok].to_numpy() - 1.0)


def batch_kind(df: pd.DataFrame) -> np.ndarray:
    """prefill (prefill-only), decode (decode-only) or mixed, per row of BatchFeatures columns."""
    return np.where(df["prefill_tokens"] == 0, "decode", np.where(df["decode_seqs"] == 0, "prefill", "mixed"))


def served_records(iterations: list[pd.DataFrame]) -> pd.DataFrame:
    """Live iterations of calibration replays as fit records: one row per distinct batch (kind + features) with
    its median time, like the profile's per-composition medians."""
    it = pd.concat(iterations, ignore_index=True)
    return aggregate(it[[*BatchFeatures._fields, "time_s"]].assign(kind=batch_kind(it)))


def by_kind(it: pd.DataFrame, pred: np.ndarray) -> dict[str, dict[str, float]]:
    """Per batch kind (prefill-only, decode-only, mixed): share of live time, MAPE and bias (sum live / sum
    predicted - 1, %); bias is what accumulates into per-request latency, MAPE also holds the noise."""
    t = it["time_s"].to_numpy()
    kind = batch_kind(it)
    out = {}
    for k in ("prefill", "decode", "mixed"):
        m = kind == k
        if m.any():
            out[k] = {"n": int(m.sum()), "time_share": float(t[m].sum() / t.sum()),
                      "mape": float(np.mean(np.abs(pred[m] / t[m] - 1.0)) * 100.0),
                      "bias": float((t[m].sum() / pred[m].sum() - 1.0) * 100.0)}
    return out


def compare(live: RecordingLive, sim: RecordingSim, spec: EngineSpec) -> dict[str, Any]:
    it = live.iteration_records()
    pred = spec.perf.batch_time(features_of(it))
    ape = np.abs(pred / it["time_s"].to_numpy() - 1.0)
    lr, sr = live.result(), sim.result()
    a, b = lr.records, sr.records
    errs = {m: rel_err(b[col], a[col]) for m, col in (("ttft", "ttft"), ("tpot", "mean_tpot"), ("ttlt", "ttlt"))}
    out: dict[str, Any] = {"iterations_live": len(it), "iterations_sim": int(sum(i.iterations for i in sim.instances)),
                           "iteration_mape": float(ape.mean() * 100.0),
                           "iteration_bias": float((it["time_s"].sum() / pred.sum() - 1.0) * 100.0),
                           "by_kind": by_kind(it, pred), **repeated_split(it, pred),
                           **schedule_agreement(live.batches, sim.batches),
                           "_ape": ape, "_errs": errs}
    for m, e in errs.items():
        out[f"{m}_median_rel_err"] = float(np.median(e) * 100.0)
        out[f"{m}_p90_rel_err"] = float(np.percentile(e, 90) * 100.0)
    out |= {"attainment_live": float(lr.summary["attainment"]), "attainment_sim": float(sr.summary["attainment"]),
            "makespan_live_s": float(live.end_time), "makespan_sim_s": float(sim.end_time),
            "wall_live_s": float(live.wall_seconds)}
    return out


def timing_variants(prof: pd.DataFrame, iterations: dict[str, pd.DataFrame], family: str | None, seed: int,
                    elasticity: dict[str, float]) -> dict[str, dict[str, dict[str, float]]]:
    """The per-iteration error under the other ``norm`` exponents: ``plain_norm`` (``cpu_s * speed``: e = 1,
    b = 0) and ``speed_only`` (the run's fitted e, b = 0); the same profile rows and live iterations re-timed,
    the model re-fitted the same way. Per variant and policy ``iteration_mape``, ``iteration_bias`` and
    ``oracle_mape`` (%); the live schedule is the one measured, so only per-iteration figures compare."""
    if "cpu_s" not in prof or prof["speed"].nunique() < 2:
        return {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for variant, e in (("plain_norm", {}), ("speed_only", elasticity)):
        perf = fit_profile_medians(retime(prof, e), family, seed)[0]
        out[variant] = {}
        for name, it in iterations.items():
            it = retime(it, e)
            t, pred = it["time_s"].to_numpy(), perf.batch_time(features_of(it))
            out[variant][name] = {"iteration_mape": float(np.mean(np.abs(pred / t - 1.0)) * 100.0),
                                  "iteration_bias": float((t.sum() / pred.sum() - 1.0) * 100.0),
                                  "oracle_mape": repeated_split(it, pred).get("oracle_mape", float("nan"))}
    return out


def pooled(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ape = np.concatenate([p["_ape"] for p in per.values()])
    out: dict[str, Any] = {"iteration_mape": float(ape.mean() * 100.0)}
    for m in ("ttft", "tpot", "ttlt"):
        e = np.concatenate([p["_errs"][m] for p in per.values()])
        out[f"{m}_median_rel_err"] = float(np.median(e) * 100.0)
        out[f"{m}_p90_rel_err"] = float(np.percentile(e, 90) * 100.0)
    for k in [k for k in next(iter(per.values())) if k.startswith("noise_only_")]:
        out[k] = float(np.mean([p[k] for p in per.values()]))  # mean over policies
    first = next(iter(per.values()))
    out["attainment_live"], out["attainment_sim"] = first["attainment_live"], first["attainment_sim"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=tuple(ARCHS), default="medium",
                    help="random-weight model config (hidden, layers, heads) and its default rate and SLOs: "
                         + "; ".join(f"{k} {int(v['hidden'])}/{int(v['layers'])}/{int(v['heads'])}, "
                                     f"{v['rate']:g} req/s, "
                                     f"TTFT {v['ttft']:g} s, TPOT {v['tpot']:g} s" for k, v in ARCHS.items()))
    ap.add_argument("--model", help="model dir (default .cache/<arch>-llama, built if absent)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, help="mean arrival rate (requests/s; default per --arch)")
    ap.add_argument("--token-scale", type=float, default=4.0, help="divide trace token counts by this")
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--max-out", type=int, default=128)
    ap.add_argument("--ttft", type=float, help="TTFT SLO (s; default per --arch)")
    ap.add_argument("--tpot", type=float, help="TPOT SLO (s; default per --arch)")
    ap.add_argument("--policies", default="vllm,sarathi")
    ap.add_argument("--family", choices=FAMILIES,
                    help=f"perf-model family (default: the best held-out MAPE among {', '.join(AUTO_FAMILIES)})")
    ap.add_argument("--quick", action="store_true", help="smaller profile grid")
    ap.add_argument("--warm-shapes", action=argparse.BooleanOptionalAction, default=True,
                    help="run every batch token count once before profiling (a warm engine, as a long-running "
                         "server is; --no-warm-shapes compares against cold per-shape GEMM set-up)")
    ap.add_argument("--repeats", type=int, default=2, help="profile passes before the live replays")
    ap.add_argument("--repeats-after", type=int, default=2,
                    help="profile passes run after the live replays (the fit uses all passes, so the profile "
                         "brackets the replays in time; 0: none)")
    ap.add_argument("--measure", type=int, default=3,
                    help="back-to-back measured iterations per profile visit (their median is the visit's row)")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--step-timeout", type=float, default=300.0,
                    help="seconds one engine step may take before the engine is declared hung (EngineConfig's "
                         "default is 60; on the shared machine, memory pressure from other jobs stalled two runs "
                         "for over 60 s)")
    ap.add_argument("--nice", type=int, default=0, help="engine process priority (negative needs root)")
    ap.add_argument("--rt-priority", type=int, default=1,
                    help="run the engine thread under SCHED_FIFO at this priority (EngineConfig.rt_priority; needs "
                         "root or CAP_SYS_NICE; 0: normal scheduling): no other process preempts a step, which "
                         "halved the run-level spread of identical steps under load (docs/live_engine.md)")
    ap.add_argument("--timing", choices=TIMINGS, default="norm",
                    help="iteration time = wall time, CPU time, or CPU time at the machine's quiet speed (norm, "
                         "the default: shared machines; see EngineConfig)")
    ap.add_argument("--ref-reps", type=int, default=EngineConfig.ref_reps,
                    help="norm timing: reference-kernel passes per speed sample (EngineConfig.ref_reps)")
    ap.add_argument("--ref-window", type=int, default=EngineConfig.ref_window,
                    help="norm timing: speed samples averaged per step, >= 2: this step's two and earlier steps' "
                         "(EngineConfig.ref_window)")
    ap.add_argument("--elasticity", choices=("auto", "speed", "one"), default="auto",
                    help="norm timing: per batch kind, the exponents of the speed factor and of wall / CPU time "
                         "(time = cpu_s * factor ** e * max(wall_s / cpu_s, 1) ** -b); auto (default): both "
                         "fitted on the profile passes before the replays (profiler.norm_exponents) and used for "
                         "everything after; speed: e only (b = 0); one: e = 1, b = 0 (the plain norm timing). The "
                         "result also reports the iteration MAPE of the same iterations under the other two "
                         "(timing_variants)")
    ap.add_argument("--noise-repeats", type=int, default=100,
                    help="back-to-back repeats of one batch per kind for the noise floor (0: skip)")
    ap.add_argument("--calibrate", type=int, default=0, metavar="N",
                    help="also fit on the live iterations of each policy replaying the NEXT N requests of the trace "
                         "(disjoint from the evaluated window); the profile-only fit is then reported beside it as "
                         "profile_only (default 0: profile only; see docs/live_engine.md for why)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", metavar="DIR",
                    help="write profile.csv, preset.json, the runs' records and result.json (the --json object) here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))

    arch = ARCHS[args.arch]
    for k in ("rate", "ttft", "tpot"):
        if getattr(args, k) is None:
            setattr(args, k, arch[k])
    model = make_tiny_model(args.model or ROOT / ".cache" / f"{args.arch}-llama",
                            **{k: int(arch[k]) for k in ("hidden", "layers", "heads")})
    cfg = EngineConfig(model=str(model), num_blocks=args.blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_prompt + args.max_out,
                       seed=args.seed, nice=args.nice, rt_priority=args.rt_priority, timing=args.timing,
                       step_timeout=args.step_timeout,
                       ref_reps=args.ref_reps, ref_window=args.ref_window)
    w, src = trace_workload(args.requests, args.rate, args.token_scale, args.max_prompt, args.max_out, args.ttft,
                            args.tpot, args.seed)
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    loads: dict[str, float] = {"start": round(os.getloadavg()[0], 2)}

    def lap(name: str) -> None:
        phases[name] = round(time.perf_counter() - t0 - sum(phases.values()), 1)
        loads[name] = round(os.getloadavg()[0], 2)  # the machine's 1-min load average at the end of the phase

    with VLLMEngine(cfg) as engine:
        lap("engine_start")
        log(f"engine up in {phases['engine_start']:.1f} s (vLLM {engine.info['vllm']}); profiling ...")
        grid = ProfileGrid.app_a(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_blocks * cfg.block_size,
                                 cfg.max_model_len, quick=args.quick)
        if args.warm_shapes:
            warm_shapes(engine)
            lap("warm_shapes")
        pre = profile(engine, grid, repeats=args.repeats, seed=args.seed, measure=args.measure)
        lap("profile_before")
        elast, preempt = (norm_exponents(pre) if args.timing == "norm" and args.elasticity != "one" else ({}, {}))
        if args.elasticity == "speed":
            preempt = {}
        if elast or preempt:  # everything from here on is timed with them; the passes so far are re-timed alike
            engine.config.norm_elasticity, engine.config.norm_preempt = elast, preempt
            pre = retime(pre, elast, preempt)
        b2b = repeat_ratios(engine, args.noise_repeats) if args.noise_repeats > 0 else {}
        noise = noise_pct(b2b)
        plan_spec = live_spec(cfg, fit_profile_medians(pre, args.family, args.seed)[0])  # what planning policies see
        calib = []
        if args.calibrate > 0:
            cw, csrc = trace_workload(args.calibrate, args.rate, args.token_scale, args.max_prompt, args.max_out,
                                      args.ttft, args.tpot, args.seed, skip=args.requests)
            for name in args.policies.split(","):
                run = LiveSimulator(cw, engine, make_policy(name, engine=plan_spec), perf=plan_spec).run()
                calib.append(run.iteration_records())
                log(f"{name}: calibration replay ({csrc}) {len(calib[-1])} iterations")
        lives = {}
        for name in args.policies.split(","):
            lives[name] = RecordingLive(w, engine, make_policy(name, engine=plan_spec), perf=plan_spec).run()
            log(f"{name}: live {len(lives[name].batches)} iterations in {lives[name].wall_seconds:.1f} s")
            lap(f"live_{name}")
        post = (profile(engine, grid, repeats=args.repeats_after, seed=args.seed + 1, measure=args.measure)
                if args.repeats_after > 0 else pre.iloc[:0].copy())
        lap("profile_after")
    post["pass"] += args.repeats
    prof = pd.concat([pre, post], ignore_index=True)
    served = served_records(calib) if calib else None
    perf, report = fit_profile_medians(prof, args.family, args.seed, served)
    family = report["family"]
    spec = live_spec(cfg, perf)
    perf0, report0 = fit_profile_medians(prof, args.family, args.seed) if calib else (perf, report)
    spec0 = live_spec(cfg, perf0)
    cands = report.get("candidates", {family: report["holdout_mape_pct"]})
    log(f"profiled {len(prof)} iterations; held-out MAPE by family: "
        + ", ".join(f"{f} {v:.1f}%" for f, v in cands.items()) + f"; using {family}")
    per: dict[str, dict[str, Any]] = {}
    per0: dict[str, dict[str, Any]] = {}
    same = same_batch_ratios([lv.iteration_records() for lv in lives.values()])
    # the injected noise: the replays' own repeated batches, or (near saturation few batches repeat) the
    # back-to-back repeats measured in the same run
    inject, inject_src = ((same, "live_same_batch") if same.size >= 200 or not b2b else
                          (np.concatenate(list(b2b.values())), "back_to_back"))
    for name, live in lives.items():
        sim = RecordingSim(w, spec, make_policy(name, engine=plan_spec)).run()
        per[name] = compare(live, sim, spec) | noise_only_error(w, spec, name, plan_spec, inject, args.seed)
        if calib:
            per0[name] = compare(live, RecordingSim(w, spec0, make_policy(name, engine=plan_spec)).run(), spec0)
        if args.save:
            out = Path(args.save)
            out.mkdir(parents=True, exist_ok=True)
            live.result().records.to_csv(out / f"live_{name}.csv", index=False)
            sim.result().records.to_csv(out / f"sim_{name}.csv", index=False)
            live.iteration_records().to_csv(out / f"iterations_{name}.csv", index=False)
            (out / f"batches_{name}.json").write_text(json.dumps({"live": live.batches, "sim": sim.batches}))
    variants = timing_variants(prof, {k: lv.iteration_records() for k, lv in lives.items()}, args.family,
                               args.seed, elast)
    lap("fit_and_simulate")
    if args.save:
        prof.to_csv(Path(args.save) / "profile.csv", index=False)
        (Path(args.save) / "preset.json").write_text(json.dumps(spec.to_dict(), indent=1, default=float) + "\n")
        if served is not None:
            served.to_csv(Path(args.save) / "served.csv", index=False)
    res = pooled(per) | {"family": family, "profile_rows": len(prof),
                         "profile_holdout_mape": report["holdout_mape_pct"], "holdout_by_family": cands,
                         "noise_floor_mape": noise_floor(prof),
                         "noise_back_to_back": noise, "profile_drift_pct": profile_drift(pre, post),
                         "noise_live_same_batch": float(np.mean(np.abs(same - 1.0)) * 100.0) if same.size else None,
                         "noise_live_same_batch_n": int(same.size), "noise_only_source": inject_src,
                         "timing": args.timing, "ref_reps": args.ref_reps, "ref_window": args.ref_window,
                         "norm_elasticity": elast, "norm_preempt": preempt, "timing_variants": variants,
                         "phase_wall_s": phases, "phase_load_avg": loads, "rt_priority": args.rt_priority,
                         "arch": args.arch, "model": str(model),
                         "rate": args.rate, "slo_ttft_s": args.ttft, "slo_tpot_s": args.tpot,
                         "warm_shapes": args.warm_shapes, "workload": src,
                         "requests": len(w), "calibration_requests": args.calibrate if calib else 0,
                         "served_rows": 0 if served is None else len(served),
                         "per_policy": {k: {m: v for m, v in p.items() if not m.startswith("_")}
                                        for k, p in per.items()}}
    if per0:
        res["profile_only"] = pooled(per0) | {
            "family": report0["family"], "profile_holdout_mape": report0["holdout_mape_pct"],
            "per_policy": {k: {m: p[m] for m in ("iteration_mape", "iteration_bias", "by_kind", "ttft_median_rel_err",
                                                 "tpot_median_rel_err", "ttlt_median_rel_err", "attainment_sim")}
                           for k, p in per0.items()}}
    if args.save:
        (Path(args.save) / "result.json").write_text(json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"workload: {src}, {len(w)} requests at {args.rate}/s; timing: {args.timing}; perf model: {family} "
          f"(profile held-out MAPE {report['holdout_mape_pct']:.1f}%, measurement noise floor "
          f"{res['noise_floor_mape']:.1f}% across passes, back to back "
          + ", ".join(f"{k} {v:.1f}%" for k, v in noise.items()) + ")")
    cols = ["iteration_mape", "iteration_bias", "ttft_median_rel_err", "ttft_p90_rel_err", "tpot_median_rel_err",
            "tpot_p90_rel_err", "ttlt_median_rel_err", "ttlt_p90_rel_err", "attainment_live", "attainment_sim",
            "oracle_mape", "repeated_noise", "repeated_model_error",
            "iterations_live",
            "iterations_sim", "first_divergent_batch", "makespan_live_s", "makespan_sim_s"]
    table = pd.DataFrame({k: res["per_policy"][k] for k in per}).reindex(cols)
    print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    print("(errors in %; pooled over policies: " + ", ".join(f"{k} {res[k]:.1f}" for k in
                                                          ("iteration_mape", "ttft_median_rel_err",
                                                           "tpot_median_rel_err", "ttlt_median_rel_err")) + ")")
    same_pct = res["noise_live_same_batch"]
    print("noise floor on the live replays (same batch, >= 5 times): "
          + (f"{same_pct:.1f}%" if same_pct is not None else "n/a")
          + f" over {res['noise_live_same_batch_n']} iterations; "
          "noise alone (simulator with that noise vs without), median: " + ", ".join(
              f"{m} {res[f'noise_only_{m}_median_rel_err']:.1f}%" for m in ("ttft", "tpot", "ttlt")
              if f"noise_only_{m}_median_rel_err" in res))
    if per0:
        p0 = res["profile_only"]
        print(f"fitted on the profile only ({p0['family']}): " + ", ".join(
            f"{k} {p0[k]:.1f}" for k in ("iteration_mape", "ttft_median_rel_err", "tpot_median_rel_err",
                                         "ttlt_median_rel_err")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

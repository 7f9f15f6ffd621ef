"""Regenerate ``slogym/engines/presets/*.json`` from the Vidur GPU profiles in ``../shared/profiles/vidur``.

Steps (see docs/engines.md):
1. attention: calibrate the analytic model's attention terms (``attn_eff``, ``attn_bw_eff``, ``attn_fixed_s``)
   on ``a100/Llama-2-70b-hf/attention.csv`` (per-layer kernel times, TP2); every preset reuses them as
   fractions of its GPU's datasheet peak (the only attention profile available).
2. all-reduce: fit ``time = ar_lat_s + bytes / ar_bw`` to ``network/<gpu>_dgx/all_reduce.csv`` at the preset's TP.
3. records: per-iteration times = emb + n_layers x (sum of per-layer operator times at that num_tokens, ``add``
   counted twice for the two residual adds) + n_layers x attention + 2 x n_layers all-reduces, for single-chunk
   prefills and decode batches over a context grid. Attention comes from attention.csv where it exists (Llama-2-70B
   A100 TP2), else from the calibrated analytic attention.
4. fit the analytic family's GEMM/elementwise/fixed terms with 20% of rows held out (LM head disabled: the profiles
   have none), then ship the model with the real vocabulary and a per-iteration CPU overhead assumption.

``python scripts/fit_presets.py`` fits and prints every preset and writes nothing; ``--out DIR`` writes the preset
JSONs to ``DIR``; ``--write`` overwrites the shipped presets in ``slogym/engines/presets`` (what a release does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from slogym.core.batch import BatchFeatures
from slogym.engines.base import EngineSpec
from slogym.engines.fitting import features_of, fit_perf_model, mape
from slogym.engines.perf_models import (GPU_SPECS, MODEL_CONFIGS, AnalyticPerf, LinearInteractionPerf,
                                        kv_bytes_per_token, weight_bytes)

ROOT = Path(__file__).resolve().parents[1]
VIDUR = ROOT.parent / "shared" / "profiles" / "vidur"
OUT = ROOT / "slogym" / "engines" / "presets"
HF = {"llama2-7b": "meta-llama/Llama-2-7b-hf", "llama2-70b": "meta-llama/Llama-2-70b-hf",
      "llama3-8b": "meta-llama/Meta-Llama-3-8B", "llama3-70b": "meta-llama/Meta-Llama-3-70B"}
ATTN_CSV = "compute/a100/meta-llama/Llama-2-70b-hf/attention.csv"
OVERHEAD_S = 2e-3  # assumed CPU-side time per iteration (scheduling, sampling); kernel profiles do not see it
MEM_FRACTION = 0.9  # vLLM gpu_memory_utilization default
CONTEXTS = (128, 512, 1024, 2048, 4096)
VIDUR_CITE = "Vidur profiles (microsoft/vidur data/profiling, MIT), ../shared/profiles/vidur/"

ATTN_FIT = ("attn_eff", "attn_bw_eff", "attn_fixed_s")
START = dict(mm_eff=0.6, bw_eff=0.7, attn_eff=0.4, attn_bw_eff=0.5, layer_fixed_s=2e-5,
             attn_fixed_s=1e-5, ar_lat_s=1e-5, ar_bw=1e11, overhead_s=0.0)


def elementwise_s(model: str, gpu: str, tp: int) -> float:
    """Per-token, per-layer time of the memory-bound elementwise kernels (2 norms, RoPE, activation, 2 adds):
    about 10 hidden-sized and 3 intermediate-sized 16-bit reads/writes at datasheet HBM bandwidth. Fixed rather
    than fitted: above the GEMM ridge point it is collinear with ``mm_eff``."""
    c = MODEL_CONFIGS[model]
    return 2 * (10 * c["hidden"] + 3 * c["intermediate"]) / tp / GPU_SPECS[gpu]["hbm_bw"]


def arch(model: str, gpu: str, tp: int, **fit: float) -> dict[str, float]:
    g = GPU_SPECS[gpu]
    return {**MODEL_CONFIGS[model], "dtype_bytes": 2, "tp": tp, "peak_flops": g["peak_flops"],
            "hbm_bw": g["hbm_bw"], **START, "elem_s": elementwise_s(model, gpu, tp), **fit}


def mlp_side(gpu: str, model: str, tp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """num_tokens grid, per-layer operator time (s) and embedding time (s), duplicates averaged."""
    d = pd.read_csv(VIDUR / "compute" / gpu / HF[model] / "mlp.csv")
    d = d[d.num_tensor_parallel_workers == tp]
    means = [c for c in d.columns if c.endswith(".mean")]
    layer_ops = [c for c in means if c != "time_stats.emb.mean"]
    per_layer = d[layer_ops].sum(axis=1) + d["time_stats.add.mean"]  # two residual adds per layer
    g = pd.DataFrame({"n": d.num_tokens, "layer": per_layer, "emb": d["time_stats.emb.mean"]})
    g = g.groupby("n").mean().sort_index()
    return g.index.to_numpy(np.int64), g["layer"].to_numpy() * 1e-3, g["emb"].to_numpy() * 1e-3


def all_reduce_fit(gpu: str, tp: int) -> dict[str, float]:
    d = pd.read_csv(VIDUR / "network" / f"{gpu}_dgx" / "all_reduce.csv")
    # intra-node rows only (devices_per_node == num_workers); ``size`` is in bytes (64 MiB on 8 H100s takes
    # 0.32 ms, i.e. ~360 GB/s bus bandwidth -- consistent with NVLink4 only if size counts bytes)
    d = d[(d.num_workers == tp) & (d.devices_per_node == tp) & (d["size"] <= 2**27)]
    slope, lat = np.polyfit(d["size"].to_numpy(float), d["time_stats.all_reduce.median"].to_numpy() * 1e-3, 1)
    return {"ar_lat_s": float(max(lat, 1e-6)), "ar_bw": float(1.0 / slope)}


def attention_rows() -> tuple[BatchFeatures, np.ndarray]:
    """attention.csv as features of one-request prefills (chunk, past) and decode batches (b x kv) + times (s)."""
    a = pd.read_csv(VIDUR / ATTN_CSV)
    a = a[a.kv_cache_size + a.prefill_chunk_size <= a.max_model_len]
    reshape = a["time_stats.attn_input_reshape.mean"] + a["time_stats.attn_output_reshape.mean"]
    pre, dec = a.is_prefill.to_numpy(), ~a.is_prefill.to_numpy()
    c, kv, b = (a[k].to_numpy(np.int64) for k in ("prefill_chunk_size", "kv_cache_size", "batch_size"))
    f = BatchFeatures.build(prefill_tokens=np.where(pre, c, 0), prefill_seqs=pre.astype(np.int64),
                            prefill_attn=np.where(pre, c * (kv + c), 0), prefill_sq=np.where(pre, c * c, 0),
                            decode_seqs=np.where(dec, b, 0), decode_tokens=np.where(dec, b, 0),
                            decode_ctx=np.where(dec, b * kv, 0), kv_tokens=np.where(pre, kv + c, b * (kv + 1)))
    t = np.where(pre, a["time_stats.attn_prefill.mean"], a["time_stats.attn_decode.mean"]) + reshape
    return f, t.to_numpy() * 1e-3


def calibrate_attention() -> tuple[dict[str, float], float]:
    """Fit the attention terms on Llama-2-70B A100 TP2 attention.csv; returns them and the fit's MAPE (%)."""
    f, t = attention_rows()
    base = arch("llama2-70b", "a100", 2)

    def model(x: np.ndarray) -> AnalyticPerf:
        return AnalyticPerf(**{**base, **dict(zip(ATTN_FIT, np.exp(x).tolist()))})

    res = least_squares(lambda x: model(x).attention_layer_time(f) / t - 1.0,
                        np.log([START[k] for k in ATTN_FIT]), bounds=(np.log([1e-3, 1e-3, 1e-9]), np.log([1, 1, 1e-2])))
    m = model(res.x)
    err = float(np.mean(np.abs(m.attention_layer_time(f) / t - 1.0)) * 100)
    return {k: m.p[k] for k in ATTN_FIT}, err


def profile_records(model: str, gpu: str, tp: int, attn: dict[str, float], ar: dict[str, float]) -> pd.DataFrame:
    """Per-iteration records (BatchFeatures columns + time_s) built from the Vidur profiles."""
    n, layer, emb = mlp_side(gpu, model, tp)
    L = MODEL_CONFIGS[model]["n_layers"]
    keep = n <= 8192
    n, layer, emb = n[keep], layer[keep], emb[keep]
    b = n[n <= 256]
    ctx = np.repeat(np.array(CONTEXTS), b.size)
    bb = np.tile(b, len(CONTEXTS))
    f = BatchFeatures.concat([
        BatchFeatures.build(prefill_tokens=n, prefill_seqs=1, prefill_attn=n * n, prefill_sq=n * n, kv_tokens=n),
        BatchFeatures.build(decode_seqs=bb, decode_tokens=bb, decode_ctx=bb * ctx, kv_tokens=bb * (ctx + 1)),
    ])
    if model == "llama2-70b" and gpu == "a100" and tp == 2:  # measured attention available: use its rows
        f, t_attn = attention_rows()
    else:
        t_attn = AnalyticPerf(**arch(model, gpu, tp, **attn)).attention_layer_time(f)
    tokens = f.prefill_tokens + f.decode_tokens
    msg = tokens * MODEL_CONFIGS[model]["hidden"] * 2
    t_ar = 2 * L * (ar["ar_lat_s"] + msg / ar["ar_bw"]) if tp > 1 else 0.0
    t = np.interp(tokens, n, emb) + L * (np.interp(tokens, n, layer) + t_attn) + t_ar
    df = pd.DataFrame({k: v for k, v in f._asdict().items()})
    df["time_s"] = t
    return df


def fit_source(model: str, gpu: str, tp: int, attn: dict[str, float]) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit GEMM/elementwise/fixed terms on one profile; returns fitted params and the fit report."""
    ar = all_reduce_fit(gpu, tp) if tp > 1 else {}
    df = profile_records(model, gpu, tp, attn, ar)
    init = arch(model, gpu, tp, **attn, **ar, vocab=0)  # the profiles contain no LM head
    fixed = ATTN_FIT + ("elem_s", "ar_lat_s", "ar_bw", "overhead_s")
    perf, report = fit_perf_model(df, "analytic", holdout=0.2, seed=0, init=init, fixed=fixed)
    report = {k: round(v, 1) if isinstance(v, float) else v for k, v in report.items()}  # MAPE to 0.1 %
    return perf.params(), report


def kv_capacity(model: str, gpu: str, tp: int) -> tuple[int, str]:
    mem, wb, kvb = GPU_SPECS[gpu]["mem_bytes"], weight_bytes(model), kv_bytes_per_token(model)
    cap = int((MEM_FRACTION * mem * tp - wb) // kvb)
    return cap, (f"({MEM_FRACTION} x {mem / 1e9:g} GB x {tp} GPU - {wb / 1e9:.1f} GB weights) / "
                 f"{kvb} B per token = {cap} tokens (activation memory not subtracted beyond the 10% margin)")


def sanity(perf: Any) -> dict[str, float]:
    dec = BatchFeatures.build(decode_seqs=32, decode_tokens=32, decode_ctx=32 * 1024, kv_tokens=32 * 1025)
    pre = BatchFeatures.build(prefill_tokens=2048, prefill_seqs=1, prefill_attn=2048**2, prefill_sq=2048**2,
                              kv_tokens=2048)
    return {"decode_b32_ctx1k_ms": round(float(perf.batch_time(dec)[0]) * 1e3, 2),
            "prefill_2048_ms": round(float(perf.batch_time(pre)[0]) * 1e3, 1)}


def write(spec: EngineSpec, out: Path | None) -> None:
    """Print the preset's key figures and fit; write its JSON into ``out`` (nothing when ``None``)."""
    spec.provenance["key_figures"] = sanity(spec.perf)
    if out is not None:
        (out / f"{spec.name}.json").write_text(json.dumps(spec.to_dict(), indent=1) + "\n")
    print(spec.name, spec.provenance["key_figures"], "kv", spec.kv_capacity_tokens,
          "fit", spec.provenance["fit"])


def analytic_preset(name: str, model: str, gpu: str, tp: int, src: tuple[str, str, int], attn: dict[str, float],
                    attn_err: float, fits: dict[tuple[str, str, int], tuple[dict[str, float], dict[str, Any]]],
                    note: str) -> EngineSpec:
    if src not in fits:
        fits[src] = fit_source(*src, attn)
    fitted, report = fits[src]
    keep = {k: fitted[k] for k in ("mm_eff", "bw_eff", "layer_fixed_s")}
    ar = all_reduce_fit(gpu if gpu != "h200" else "h100", tp) if tp > 1 else {}
    perf = AnalyticPerf(**arch(model, gpu, tp, **attn, **ar, **keep, overhead_s=OVERHEAD_S))
    cap, cap_note = kv_capacity(model, gpu, tp)
    src_file = f"compute/{src[1]}/{HF[src[0]]}/mlp.csv (TP{src[2]})"
    prov = {
        "family_choice": "analytic roofline (GEMM, attention, all-reduce, LM head, overhead terms)",
        "profiles": [VIDUR_CITE + src_file, VIDUR_CITE + ATTN_CSV]
        + ([VIDUR_CITE + f"network/{src[1]}_dgx/all_reduce.csv"] if src[2] > 1 else []),
        "gpu_datasheet": {k: GPU_SPECS[gpu][k] for k in ("peak_flops", "hbm_bw", "mem_bytes")},
        "attention": f"attn terms calibrated on {ATTN_CSV} (MAPE {attn_err:.1f}% per-layer), reused as fractions "
                     "of this GPU's datasheet peak",
        "overhead_s": f"{OVERHEAD_S} s per iteration assumed (CPU scheduling/sampling; not in kernel profiles)",
        "kv_capacity": cap_note,
        "fit": {**report, "fitted_on": src_file},
        "note": note,
    }
    if tp > 1:
        prov["all_reduce"] = f"network/{gpu if gpu != 'h200' else 'h100'}_dgx/all_reduce.csv, {tp} workers: {ar}"
    return EngineSpec(name=name, model=model, gpu=gpu, tp=tp, perf=perf, kv_capacity_tokens=cap,
                      kv_bytes_per_token=kv_bytes_per_token(model), provenance=prov)


def qwen_v100() -> EngineSpec:
    """SA paper Table 2 (Qwen2.5-7B, 2 x V100, ms) as a linear-interaction model in seconds."""
    ms = dict(p_bl=0.1, p_b=5.7, p_l=0.01, p_0=43.67, d_bl=0.0002, d_b=0.275, d_l=0.00088, d_0=15.85)
    cap, cap_note = kv_capacity("qwen2.5-7b", "v100", 2)
    return EngineSpec(
        name="qwen2.5-7b-v100-tp2", model="qwen2.5-7b", gpu="v100", tp=2,
        perf=LinearInteractionPerf(**{k: v * 1e-3 for k, v in ms.items()}), kv_capacity_tokens=cap,
        kv_bytes_per_token=kv_bytes_per_token("qwen2.5-7b"),
        provenance={"source": "Huang et al. 2025, SLO-Aware Scheduling for LLM Inferences, Table 2 (Eq. 14-15); "
                              "columns read as (B*L, B, L, const) in ms, converted to s",
                    "gpu_datasheet": GPU_SPECS["v100"], "kv_capacity": cap_note,
                    "fit": "no profile here; the paper reports no fit error",
                    "note": "the paper fits up to 2k tokens and batch 32; mixed batches cost prefill + decode"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="write the preset JSONs into this folder")
    where.add_argument("--write", action="store_true", help=f"overwrite the shipped presets in {OUT}")
    args = ap.parse_args()
    out = OUT if args.write else args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    attn, attn_err = calibrate_attention()
    print("attention", attn, f"MAPE {attn_err:.1f}%")
    fits: dict[tuple[str, str, int], tuple[dict[str, float], dict[str, Any]]] = {}
    direct = "fitted on its own profile"
    specs = [
        analytic_preset("llama3-8b-a100", "llama3-8b", "a100", 1, ("llama3-8b", "a100", 1), attn, attn_err, fits,
                        direct),
        analytic_preset("llama2-7b-a100", "llama2-7b", "a100", 1, ("llama2-7b", "a100", 1), attn, attn_err, fits,
                        direct),
        analytic_preset("llama3-8b-h100", "llama3-8b", "h100", 1, ("llama2-7b", "h100", 1), attn, attn_err, fits,
                        "no Llama-3-8B H100 profile: efficiencies fitted on Llama-2-7B H100 (same hidden size), "
                        "applied to the Llama-3-8B architecture (GQA, larger MLP and vocabulary)"),
        analytic_preset("llama3-8b-h200", "llama3-8b", "h200", 1, ("llama2-7b", "h100", 1), attn, attn_err, fits,
                        "no H200 profile: H100 efficiencies with H200 datasheet figures (same 989 TFLOP/s, "
                        "4.8 vs 3.35 TB/s HBM, 141 vs 80 GB)"),
        analytic_preset("llama2-70b-a100-tp2", "llama2-70b", "a100", 2, ("llama2-70b", "a100", 2), attn, attn_err,
                        fits, direct + " with measured attention (attention.csv) rows"),
        analytic_preset("llama3-70b-h100-tp4", "llama3-70b", "h100", 4, ("llama2-70b", "h100", 4), attn, attn_err,
                        fits, "no Llama-3-70B H100 profile: Llama-2-70B H100 TP4 profile (identical layer shapes; "
                        "only the vocabulary differs, handled analytically)"),
        analytic_preset("opt-13b-a100", "opt-13b", "a100", 1, ("llama2-7b", "a100", 1), attn, attn_err, fits,
                        "no OPT-13B profile: A100 efficiencies fitted on Llama-2-7B, applied to OPT-13B's "
                        "architecture (plain 2-matrix FFN, 40 layers, hidden 5120)"),
        qwen_v100(),
    ]
    for s in specs:
        write(s, out)
    if out is None:
        print("(fitted only; --out DIR or --write to save the presets)")


if __name__ == "__main__":
    main()

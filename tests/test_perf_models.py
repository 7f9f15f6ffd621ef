"""Perf-model families, fitting, shipped presets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from slogym.core.batch import BatchFeatures
from slogym.engines.base import perf_model_from_dict
from slogym.engines.fitting import AUTO_FAMILIES, fit_best, fit_perf_model, fit_profile, load_records
from slogym.engines.perf_models import (GPU_SPECS, MODEL_CONFIGS, AnalyticPerf, LinearInteractionPerf,
                                        PhaseQuadraticPerf, PhaseQuadraticPwlPerf, QuadraticPerf, RooflinePerf,
                                        TablePerf)
from slogym.engines.registry import get_engine, list_engines

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VIDUR = SHARED / "profiles" / "vidur"
SHIPPED = ["llama3-8b-a100", "llama3-8b-h100", "llama3-8b-h200", "llama2-7b-a100", "llama2-70b-a100-tp2",
           "llama3-70b-h100-tp4", "opt-13b-a100", "qwen2.5-7b-v100-tp2"]


def random_batches(n: int, seed: int = 0) -> BatchFeatures:
    """Random mixed batches: some prefill chunks with a KV prefix, some decode requests."""
    rng = np.random.default_rng(seed)
    ps = rng.integers(0, 3, n)
    chunk = rng.integers(1, 1024, n) * (ps > 0)
    past = rng.integers(0, 2048, n) * (ps > 0)
    ds = rng.integers(0, 128, n)
    ds[ps + ds == 0] = 1
    ctx = ds * rng.integers(16, 4096, n)
    return BatchFeatures.build(prefill_tokens=ps * chunk, prefill_seqs=ps, prefill_attn=ps * chunk * (past + chunk),
                               prefill_sq=ps * chunk * chunk, decode_seqs=ds, decode_tokens=ds, decode_ctx=ctx,
                               kv_tokens=ps * (past + chunk) + ctx + ds, spec_steps=rng.integers(0, 4, n))


def phase_batches(n: int, seed: int = 0) -> BatchFeatures:
    """A third of the batches prefill-only, a third decode-only, a third mixed (every phase intercept is
    identifiable); 1-4 prefill sequences of a shared chunk length after a shared KV prefix (0-511 tokens, so
    ``prefill_attn`` is not a combination of ``prefill_sq`` and ``prefill_tokens``)."""
    rng = np.random.default_rng(seed)
    kind = np.arange(n) % 3  # 0 prefill-only, 1 decode-only, 2 mixed
    ps = np.where(kind == 1, 0, rng.integers(1, 5, n))
    chunk = rng.integers(1, 700, n)
    ds = np.where(kind == 0, 0, rng.integers(1, 64, n))
    ctx = ds * rng.integers(16, 2048, n)
    past = rng.integers(0, 512, n)
    return BatchFeatures.build(prefill_tokens=ps * chunk, prefill_seqs=ps, prefill_attn=ps * chunk * (chunk + past),
                               prefill_sq=ps * chunk * chunk, decode_seqs=ds, decode_tokens=ds, decode_ctx=ctx,
                               kv_tokens=ps * (chunk + past) + ctx + ds)


PHASE_COEFS = dict(c0=0.004, c_prefill_0=0.0012, c_decode_0=0.0005, c_prefill_seq=3e-4, c_prefill_tok=6e-6,
                   c_prefill_sq=1e-10, c_prefill_attn=2e-10, c_decode_tok=4e-5, c_decode_ctx=3e-8)


def records_of(model, f: BatchFeatures) -> pd.DataFrame:
    df = pd.DataFrame(f._asdict())
    df["time_s"] = model.batch_time(f)
    return df


def analytic(model: str = "llama3-8b", gpu: str = "h100", tp: int = 1, **kw: float) -> AnalyticPerf:
    g = GPU_SPECS[gpu]
    p = dict(MODEL_CONFIGS[model], dtype_bytes=2, tp=tp, peak_flops=g["peak_flops"], hbm_bw=g["hbm_bw"],
             mm_eff=0.65, bw_eff=0.8, attn_eff=0.35, attn_bw_eff=0.75, elem_s=5e-8, layer_fixed_s=8e-5,
             attn_fixed_s=1.5e-5, ar_lat_s=3e-5, ar_bw=2e11, overhead_s=2e-3)
    p.update(kw)
    return AnalyticPerf(**p)


# ---- fitting recovers known coefficients -------------------------------------------------------------------


@pytest.mark.parametrize("cls, coefs", [
    (QuadraticPerf, dict(c0=0.012, c_prefill_tok=6e-5, c_prefill_sq=1e-9, c_prefill_attn=3e-9, c_decode_tok=2e-4,
                         c_decode_ctx=5e-8)),
    (LinearInteractionPerf, dict(p_bl=1e-4, p_b=5.7e-3, p_l=1e-5, p_0=0.04367, d_bl=2e-7, d_b=2.75e-4,
                                 d_l=8.8e-7, d_0=0.01585)),
])
def test_linear_families_recover_coefficients(cls, coefs):
    truth = cls(**coefs)
    model, report = fit_perf_model(records_of(truth, random_batches(400)), cls.family)
    for k, v in coefs.items():
        assert model.params()[k] == pytest.approx(v, rel=1e-4, abs=1e-12), k
    assert report["holdout_mape_pct"] < 1e-3 and report["n_rows"] == 400


def test_phase_quadratic_recovers_coefficients_and_each_phase_intercept():
    truth = PhaseQuadraticPerf(**PHASE_COEFS)
    model, report = fit_perf_model(records_of(truth, phase_batches(600)), "phase-quadratic")
    for k, v in PHASE_COEFS.items():
        assert model.params()[k] == pytest.approx(v, rel=1e-4, abs=1e-12), k
    assert report["holdout_mape_pct"] < 1e-3
    # intercepts by batch kind: prefill-only c0 + c_prefill_0, decode-only c0 + c_decode_0, mixed all three
    one = dict(prefill_tokens=[1, 0, 1], prefill_seqs=[1, 0, 1], decode_seqs=[0, 1, 1], decode_tokens=[0, 1, 1])
    t = truth.batch_time(BatchFeatures.build(**one))
    c = PHASE_COEFS
    base = np.array([c["c0"] + c["c_prefill_0"] + c["c_prefill_seq"] + c["c_prefill_tok"],
                     c["c0"] + c["c_decode_0"] + c["c_decode_tok"],
                     c["c0"] + c["c_prefill_0"] + c["c_decode_0"] + c["c_prefill_seq"] + c["c_prefill_tok"]
                     + c["c_decode_tok"]])
    np.testing.assert_allclose(t, base, rtol=1e-12)
    assert truth.batch_time(BatchFeatures.build(prefill_tokens=0))[0] == 0.0


def test_phase_quadratic_scalar_and_vector_paths_agree_bitwise():
    """The simulator times one batch through Python ints (``batch_time_one``), fast-forward through arrays."""
    truth = PhaseQuadraticPerf(**PHASE_COEFS)
    for f in (phase_batches(300, seed=5), random_batches(300, seed=6)):
        t = truth.batch_time(f)
        one = [truth.batch_time_one(BatchFeatures(*(int(a[i]) for a in f))) for i in range(len(t))]
        assert t.dtype == np.float64 and all(isinstance(v, float) for v in one)
        assert np.array_equal(np.array(one), t)
        alone = np.concatenate([truth.batch_time(BatchFeatures(*(a[i:i + 1] for a in f))) for i in range(0, 300, 7)])
        assert np.array_equal(alone, t[::7])
    again = perf_model_from_dict(json.loads(json.dumps(truth.to_dict())))
    assert np.array_equal(again.batch_time(f), t)


def test_fit_best_picks_the_generating_family_by_holdout():
    """Records from a phase-quadratic engine: the single-intercept quadratic cannot fit them exactly, so the
    held-out MAPE picks phase-quadratic; records from a quadratic engine are fitted exactly by both (quadratic is
    phase-quadratic with zero phase terms), and the pick is one of them with ~0 error."""
    f = phase_batches(600, seed=1)
    model, report = fit_best(records_of(PhaseQuadraticPerf(**PHASE_COEFS), f))
    assert report["family"] == "phase-quadratic" and set(report["candidates"]) == set(AUTO_FAMILIES)
    assert report["candidates"]["quadratic"] > 1.0 > report["holdout_mape_pct"]
    quad = QuadraticPerf(c0=0.01, c_prefill_tok=5e-5, c_prefill_sq=0.0, c_prefill_attn=2e-9, c_decode_tok=1e-4,
                         c_decode_ctx=4e-8)
    model, report = fit_best(records_of(quad, f))
    assert report["family"] in ("quadratic", "phase-quadratic") and report["holdout_mape_pct"] < 1e-3
    with pytest.raises(ValueError, match="holdout"):
        fit_best(records_of(quad, f), holdout=0.0)


# a decode step of 2 dearer than one of 3 (the live CPU engine's shape), flat-ish above
PWL_TRUTH = dict(knots=[1, 2, 3, 8, 64, 1024], knot_time=[1e-3, 3e-3, 0.4e-3, 0.5e-3, 0.8e-3, 2e-3])


def pwl_batches(n: int, seed: int = 0) -> BatchFeatures:
    """:func:`phase_batches` plus decode-only steps of 1-8 requests (the knots below 8 are pinned by them)."""
    f = phase_batches(n, seed)
    rng = np.random.default_rng(seed + 100)
    ds = rng.integers(1, 9, n // 3)
    ctx = ds * rng.integers(16, 2048, ds.size)
    small = BatchFeatures.build(decode_seqs=ds, decode_tokens=ds, decode_ctx=ctx, kv_tokens=ctx + ds)
    return BatchFeatures(*(np.concatenate([a, b]) for a, b in zip(f, small)))


def test_phase_quadratic_pwl_fit_reproduces_a_non_linear_token_cost():
    """Records from an engine whose cost over the token count bends (a decode step of 2 dearer than one of 3):
    the fit reproduces every batch's time, phase-quadratic cannot, and fit_best picks the piecewise family."""
    truth = PhaseQuadraticPwlPerf(**PWL_TRUTH, **PHASE_COEFS)
    df = records_of(truth, pwl_batches(900, seed=2))
    model, report = fit_perf_model(df, "phase-quadratic-pwl")
    assert report["holdout_mape_pct"] < 1e-3
    assert set(PWL_TRUTH["knots"][:-1]) <= set(model.params()["knots"])  # knots at profiled token counts
    fresh = pwl_batches(300, seed=7)
    np.testing.assert_allclose(model.batch_time(fresh), truth.batch_time(fresh), rtol=1e-6)
    two_three = BatchFeatures.build(decode_seqs=[2, 3], decode_tokens=[2, 3], decode_ctx=[600, 900])
    t = model.batch_time(two_three)
    assert t[0] > t[1]  # not monotone in the batch size, as measured
    best, report = fit_best(df)
    assert report["family"] == "phase-quadratic-pwl"
    assert report["candidates"]["phase-quadratic"] > 1.0 > report["holdout_mape_pct"]


def test_phase_quadratic_pwl_scalar_vector_roundtrip_and_bad_knots():
    truth = PhaseQuadraticPwlPerf(**PWL_TRUTH, **PHASE_COEFS)
    f = pwl_batches(300, seed=5)
    t = truth.batch_time(f)
    one = [truth.batch_time_one(BatchFeatures(*(int(a[i]) for a in f))) for i in range(len(t))]
    assert all(isinstance(v, float) for v in one) and np.array_equal(np.array(one), t)
    alone = np.concatenate([truth.batch_time(BatchFeatures(*(a[i:i + 1] for a in f))) for i in range(0, len(t), 7)])
    assert np.array_equal(alone, t[::7])
    again = perf_model_from_dict(json.loads(json.dumps(truth.to_dict())))
    assert np.array_equal(again.batch_time(f), t)
    assert truth.batch_time(BatchFeatures.build(prefill_tokens=0))[0] == 0.0
    g = np.array([1e-3, 3e-3, 0.4e-3])  # the token cost alone at 1, 2, 3 tokens (decode of 1-3, no context)
    base = PhaseQuadraticPerf(**PHASE_COEFS).batch_time(BatchFeatures.build(decode_seqs=[1, 2, 3],
                                                                             decode_tokens=[1, 2, 3]))
    got = truth.batch_time(BatchFeatures.build(decode_seqs=[1, 2, 3], decode_tokens=[1, 2, 3]))
    np.testing.assert_allclose(got - base, g, rtol=1e-9)
    for bad in (dict(knots=[4, 2], knot_time=[0.0, 0.0]), dict(knots=[1], knot_time=[0.0]),
                dict(knots=[1, 2], knot_time=[0.0, -1.0]), dict(knots=[0, 2], knot_time=[0.0, 0.0])):
        with pytest.raises(ValueError, match="knot"):
            PhaseQuadraticPwlPerf(**bad, **PHASE_COEFS)
    with pytest.raises(ValueError, match="distinct token counts"):
        fit_perf_model(pd.DataFrame({"decode_seqs": [1, 1], "decode_tokens": [1, 1], "time_s": [0.01, 0.02]}),
                       "phase-quadratic-pwl", holdout=0.0)


def test_fit_profile_auto_records_the_choice(tmp_path):
    csv = tmp_path / "records.csv"
    records_of(PhaseQuadraticPerf(**PHASE_COEFS), phase_batches(300)).to_csv(csv, index=False)
    d = fit_profile(csv, "auto", kv_capacity_tokens=1000)
    assert d["perf"]["family"] == "phase-quadratic" and "candidates" in d["provenance"]["fit"]
    with pytest.raises(ValueError, match="auto"):
        fit_profile(csv, "auto", kv_capacity_tokens=1000, pieces=3)


def test_roofline_recovers_two_pieces():
    truth = RooflinePerf(k1=[2e-6, 6e-5], k2=[0.0, 2e-3], b=[0.02, 0.001])
    tokens = np.arange(1, 4000, 7)
    f = BatchFeatures.build(prefill_tokens=tokens, prefill_seqs=1, spec_steps=tokens % 3)
    model, report = fit_perf_model(records_of(truth, f), "roofline")
    assert report["holdout_mape_pct"] < 1.0
    assert sorted(model.params()["b"])[-1] == pytest.approx(0.02, rel=0.05)
    assert max(model.params()["k1"]) == pytest.approx(6e-5, rel=0.05)


def test_table_reproduces_grid_and_interpolates():
    tg, kg = np.array([1, 64, 256, 1024]), np.array([0, 4096, 65536])
    times = 0.01 + 1e-5 * tg[:, None] + 1e-7 * kg[None, :]  # bilinear surface: interpolation is exact
    truth = TablePerf(tg, kg, times)
    tt, kk = np.meshgrid(tg, kg, indexing="ij")
    f = BatchFeatures.build(decode_seqs=tt.ravel(), decode_tokens=tt.ravel(), kv_tokens=kk.ravel())
    model, _ = fit_perf_model(records_of(truth, f), "table", holdout=0.0)
    probe = BatchFeatures.build(decode_seqs=[100, 2000], decode_tokens=[100, 2000], kv_tokens=[10000, 100000])
    want = 0.01 + 1e-5 * np.array([100, 2000]) + 1e-7 * np.array([10000, 100000])  # 2nd: linear extrapolation
    np.testing.assert_allclose(model.batch_time(probe), want, rtol=1e-12)


def test_analytic_recovers_efficiencies():
    truth = analytic(tp=2, vocab=0)
    model, report = fit_perf_model(records_of(truth, random_batches(300)), "analytic", init=analytic(
        tp=2, vocab=0, mm_eff=0.3, attn_eff=0.2, layer_fixed_s=1e-5).params(),
        fixed=("bw_eff", "elem_s", "attn_bw_eff", "ar_lat_s", "ar_bw", "overhead_s"))
    for k in ("mm_eff", "attn_eff", "layer_fixed_s"):
        assert model.params()[k] == pytest.approx(truth.params()[k], rel=1e-3), k
    assert report["holdout_mape_pct"] < 0.1


# ---- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, -0.01, 0.0])
def test_records_reject_bad_times(bad):
    df = pd.DataFrame({"prefill_tokens": [10, 20, 30], "prefill_seqs": 1, "time_s": [0.01, bad, 0.03]})
    with pytest.raises(ValueError, match="time_s"):
        fit_perf_model(df, "quadratic")


def test_records_reject_negative_features_and_unknown_family():
    with pytest.raises(ValueError, match="decode_ctx"):
        load_records(pd.DataFrame({"decode_ctx": [-1], "time_s": [0.01]}))
    df = pd.DataFrame({"prefill_tokens": [10, 20], "time_s": [0.01, 0.02]})
    with pytest.raises(ValueError, match="unknown perf-model family"):
        fit_perf_model(df, "cubic")
    with pytest.raises(ValueError, match="unknown perf-model family"):
        perf_model_from_dict({"family": "cubic", "params": {}})


def test_fit_profile_roundtrip(tmp_path):
    truth = QuadraticPerf(c0=0.01, c_prefill_tok=5e-5, c_prefill_sq=0.0, c_prefill_attn=2e-9, c_decode_tok=1e-4,
                          c_decode_ctx=4e-8)
    csv = tmp_path / "records.csv"
    records_of(truth, random_batches(200)).to_csv(csv, index=False)
    d = fit_profile(csv, "quadratic", engine_name="mine", kv_capacity_tokens=1000)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(d))
    spec = get_engine(str(path))
    f = random_batches(50, seed=3)
    np.testing.assert_allclose(spec.batch_time(f), truth.batch_time(f), rtol=1e-6)
    assert d["provenance"]["fit"]["holdout_mape_pct"] < 1e-3


# ---- shipped presets ---------------------------------------------------------------------------------------


def test_registry_lists_presets_and_rejects_unknown():
    assert set(SHIPPED) <= set(list_engines())
    with pytest.raises(ValueError, match="llama3-8b-h100"):
        get_engine("gpt-5-tpu")


@pytest.mark.parametrize("name", SHIPPED)
def test_preset_is_monotone_and_batch_invariant(name):
    spec = get_engine(name)
    assert spec.name == name and spec.kv_capacity_tokens > 0 and spec.kv_bytes_per_token > 0
    assert spec.provenance and "kv_capacity" in spec.provenance
    f = random_batches(2000, seed=1)
    t = spec.batch_time(f)
    assert t.dtype == np.float64 and t.shape == (2000,) and (t > 0).all()
    single = np.concatenate([spec.batch_time(BatchFeatures(*(a[i:i + 1] for a in f))) for i in range(0, 2000, 97)])
    assert np.array_equal(single, t[::97])  # bit-identical alone vs among thousands
    n = np.arange(1, 8193, 37)
    pre = spec.batch_time(BatchFeatures.build(prefill_tokens=n, prefill_seqs=1, prefill_attn=n * n,
                                              prefill_sq=n * n, kv_tokens=n))
    assert (np.diff(pre) >= 0).all()
    ctx = np.arange(16, 32768, 512)
    dec = spec.batch_time(BatchFeatures.build(decode_seqs=32, decode_tokens=32, decode_ctx=32 * ctx,
                                              kv_tokens=32 * (ctx + 1)))
    assert (np.diff(dec) > 0).all()
    b = np.arange(1, 257)
    dec_b = spec.batch_time(BatchFeatures.build(decode_seqs=b, decode_tokens=b, decode_ctx=b * 1024,
                                                kv_tokens=b * 1025))
    assert (np.diff(dec_b) > 0).all()
    assert spec.batch_time(BatchFeatures.build(prefill_tokens=0))[0] == 0.0


@pytest.mark.parametrize("name", SHIPPED)
def test_one_batch_alone_equals_the_vectorized_time(name):
    """The simulator times a stepped iteration with ``batch_time_one`` (Python ints) and a fast-forwarded
    stretch with ``batch_time`` (arrays): fast-forward equals stepping only if both give the same bits."""
    spec = get_engine(name)
    f = random_batches(300, seed=4)
    t = spec.batch_time(f)
    one = [spec.batch_time_one(BatchFeatures(*(int(a[i]) for a in f))) for i in range(300)]
    assert all(isinstance(v, float) for v in one) and np.array_equal(np.array(one), t)
    if spec.perf.family == "analytic":  # compiled for NumPy; the uncompiled formula (CuPy's path) must agree
        from slogym.engines.perf_models import analytic_time

        args = (f.prefill_tokens, f.prefill_seqs, f.prefill_attn, f.decode_seqs, f.decode_tokens, f.decode_ctx)
        assert np.array_equal(analytic_time.py_func(*args, spec.perf._coef), t)


def test_llama3_8b_h100_sanity():
    """Decode of 32 x 1k context ~10-20 ms; a 2048-token prefill tens of ms (~35 TFLOP at ~600 TFLOP/s)."""
    spec = get_engine("llama3-8b-h100")
    dec = spec.batch_time(BatchFeatures.build(decode_seqs=32, decode_tokens=32, decode_ctx=32 * 1024))[0]
    pre = spec.batch_time(BatchFeatures.build(prefill_tokens=2048, prefill_seqs=1, prefill_attn=2048**2))[0]
    assert 0.008 < dec < 0.02
    assert 0.04 < pre < 0.2


def test_presets_roundtrip_through_dict():
    for name in SHIPPED:
        spec = get_engine(name)
        again = perf_model_from_dict(json.loads(json.dumps(spec.perf.to_dict())))
        f = random_batches(64, seed=2)
        assert np.array_equal(again.batch_time(f), spec.batch_time(f))


# ---- analytic model vs real profiles -----------------------------------------------------------------------


@pytest.mark.skipif(not VIDUR.is_dir(), reason="../shared/profiles/vidur not present (real GPU profiles)")
@pytest.mark.parametrize("gpu, hf, model", [("a100", "meta-llama/Meta-Llama-3-8B", "llama3-8b"),
                                            ("h100", "meta-llama/Llama-2-7b-hf", "llama2-7b")])
def test_analytic_linear_layers_match_vidur(gpu, hf, model):
    """Shipped A100/H100 efficiencies reproduce the measured per-layer GEMM+elementwise time of a decode-sized
    and a prefill-sized batch within 25% (attention, LM head, overhead and all-reduce switched off)."""
    d = pd.read_csv(VIDUR / "compute" / gpu / hf / "mlp.csv")
    d = d[d.num_tensor_parallel_workers == 1].groupby("num_tokens").mean(numeric_only=True)
    ops = [c for c in d.columns if c.endswith(".mean") and c != "time_stats.emb.mean"]
    per_layer_ms = d[ops].sum(axis=1) + d["time_stats.add.mean"]
    eff = get_engine(f"llama3-8b-{gpu}").perf.params()
    m = analytic(model, gpu, vocab=0, overhead_s=0.0, attn_fixed_s=0.0, n_layers=1, mm_eff=eff["mm_eff"],
                 bw_eff=eff["bw_eff"], elem_s=eff["elem_s"], layer_fixed_s=eff["layer_fixed_s"])
    for n in (32, 2048):
        got = m.batch_time(BatchFeatures.build(decode_seqs=n, decode_tokens=n))[0] * 1e3
        assert got == pytest.approx(per_layer_ms.loc[n], rel=0.25), n


def test_a_subclass_that_inherits_its_family_does_not_replace_the_registered_model():
    from slogym.engines.base import PERF_FAMILIES
    from slogym.engines.perf_models import RooflinePerf

    class Wrapped(RooflinePerf):  # e.g. a test double or a wrapper
        pass

    class Named(RooflinePerf):
        family = "roofline-named-for-test"

    try:
        assert PERF_FAMILIES["roofline"] is RooflinePerf
        assert PERF_FAMILIES["roofline-named-for-test"] is Named
    finally:
        PERF_FAMILIES.pop("roofline-named-for-test", None)

"""Fit perf-model families to profiled batches.

Records are a :class:`pandas.DataFrame` (or a CSV path) with one row per measured iteration: columns named after
:class:`~slogym.core.batch.BatchFeatures` fields (missing ones are 0) and ``time_s``. All fits minimise
*relative* error (HyperFlexis App. A), hold out a random ``holdout`` fraction of rows and report its MAPE.

Fitting needs SciPy (the ``dev`` extra); simulating with fitted models does not.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from slogym.core.batch import BatchFeatures
from slogym.engines.base import PERF_FAMILIES, EngineSpec, PerfModel
from slogym.engines.perf_models import (AnalyticPerf, LinearTermsPerf, PhaseQuadraticPwlPerf, RooflinePerf,
                                        TablePerf)

AUTO_FAMILIES = ("quadratic", "linear-interaction", "phase-quadratic", "phase-quadratic-pwl")
"""Families :func:`fit_best` chooses among by default, simplest first: those that need no architecture
(``analytic`` does) and whose features separate prefill from decode work in one batch. ``table`` (total x KV
tokens) and ``roofline`` (total tokens) give a prefill chunk and as many decode steps the same cost; on a live
vLLM engine they won on the profile grid's held-out rows yet predicted mixed batches 13-31 % low
(``docs/live_engine.md``)."""

TIE_MAPE_PCT = 0.05
""":func:`fit_best` keeps the simplest family (first in its list) whose held-out MAPE is within this many
percentage points of the lowest: a richer family that contains a simpler one (``phase-quadratic-pwl`` contains
``phase-quadratic``, which contains ``quadratic``) fits the simpler one's records as well, up to rounding."""

PWL_KNOTS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
             3072, 4096, 6144, 8192, 12288, 16384)
"""Token counts ``phase-quadratic-pwl`` may place a knot at (every count up to 8, where the GEMMs' time is
least linear, then x1.5 / x4/3 steps); a fit keeps those its training rows contain exactly, plus their
largest token count, so every knot's value is pinned by measured batches."""


def _read_records_csv(path: str | Path) -> tuple[pd.DataFrame, str]:
    """A records CSV, indexed by file line (header = line 1; blank lines count), and the word for its rows."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)
            # index_col=False: a first row with one field too many would otherwise become the index and shift
            # every column left (time_s read from the next column); pandas then drops the surplus and warns
            df = pd.read_csv(path, index_col=False, skip_blank_lines=False)
    except pd.errors.ParserWarning:
        raise ValueError("line 2 has more fields than the header") from None
    df.index = pd.RangeIndex(2, len(df) + 2)
    return df[df.notna().any(axis=1)], "line"


def _cell(df: pd.DataFrame, column: str, k: int) -> object:
    value = df[column].iloc[k]
    return value.item() if isinstance(value, np.generic) else value


def load_records(records: pd.DataFrame | str | Path) -> pd.DataFrame:
    """Validated records: feature columns as int64 (missing = 0), ``time_s`` finite and positive.

    A bad value is reported with its row: the file line for a CSV path, else the 0-based row position."""
    if isinstance(records, (str, Path)):
        df, where = _read_records_csv(records)
    else:
        df, where = records.reset_index(drop=True), "row"
    if "time_s" not in df.columns:
        raise ValueError("records need a 'time_s' column (seconds per iteration)")
    if len(df) == 0:
        raise ValueError("records: no rows")
    t = pd.to_numeric(df["time_s"], errors="coerce").to_numpy(np.float64)
    bad = ~np.isfinite(t) | (t <= 0)
    if bad.any():
        k = int(np.argmax(bad))
        raise ValueError(f"records: 'time_s' must be present, finite and > 0 on every row; {where} {df.index[k]} "
                         f"has {_cell(df, 'time_s', k)!r}")
    for name in BatchFeatures._fields:
        col = pd.to_numeric(df[name], errors="coerce") if name in df.columns else pd.Series(0, index=df.index)
        bad = (col.isna() | (col < 0)).to_numpy()
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"records: feature column {name!r} must be non-negative numbers; {where} "
                             f"{df.index[k]} has {_cell(df, name, k)!r}")
        df[name] = col.astype(np.int64)
    df["time_s"] = t
    return df.reset_index(drop=True)


def features_of(df: pd.DataFrame) -> BatchFeatures:
    return BatchFeatures(*(df[name].to_numpy(np.int64) for name in BatchFeatures._fields))


def mape(model: PerfModel, df: pd.DataFrame) -> float:
    """Mean absolute percentage error (in %) of ``model`` on records ``df``."""
    t = df["time_s"].to_numpy()
    return float(np.mean(np.abs(model.batch_time(features_of(df)) / t - 1.0)) * 100.0)


def _scipy_optimize() -> Any:
    try:
        import scipy.optimize
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fitting perf models needs scipy (pip install 'slogym[dev]')") from e
    return scipy.optimize


def _nnls_relative(cols: list[Any], t: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative residuals: ``min sum ((sum_i c_i x_i) / t - 1)^2, c >= 0``."""
    a = np.stack([np.broadcast_to(np.asarray(x, np.float64), t.shape) for x in cols], axis=1) / t[:, None]
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # column scaling keeps NNLS well conditioned
    coef, _ = _scipy_optimize().nnls(a / scale, np.ones_like(t))
    return coef / scale


def _fit_linear(cls: type[LinearTermsPerf], df: pd.DataFrame) -> LinearTermsPerf:
    """The coefficients of ``cls``'s terms by :func:`_nnls_relative`."""
    probe = cls(**{k: 0.0 for k in cls.term_names})
    coef = _nnls_relative(probe.terms(features_of(df)), df["time_s"].to_numpy())
    return cls(**dict(zip(cls.term_names, coef.tolist())))


def _fit_pwl(df: pd.DataFrame) -> PhaseQuadraticPwlPerf:
    """``phase-quadratic-pwl``: knots at the :data:`PWL_KNOTS` token counts that ``df`` holds plus its largest
    one; the phase-quadratic coefficients and every knot's time together by :func:`_nnls_relative`."""
    tokens = (df["prefill_tokens"] + df["decode_tokens"]).to_numpy(np.int64)
    seen = set(tokens[tokens > 0].tolist())
    knots = sorted({k for k in PWL_KNOTS if k in seen} | ({max(seen)} if seen else set()))
    if len(knots) < 2:
        raise ValueError(f"phase-quadratic-pwl: records need >= 2 distinct token counts, got {sorted(seen)}")
    names = PhaseQuadraticPwlPerf.term_names
    probe = PhaseQuadraticPwlPerf(knots, [0.0] * len(knots), **{k: 0.0 for k in names})
    f = features_of(df)
    coef = _nnls_relative(probe.terms(f) + probe.knot_weights(f), df["time_s"].to_numpy()).tolist()
    return PhaseQuadraticPwlPerf(knots, coef[len(names):], **dict(zip(names, coef[:len(names)])))


def _fit_roofline(df: pd.DataFrame, pieces: int = 2) -> RooflinePerf:
    """Piecewise fit: split rows at ``pieces - 1`` token breakpoints (searched over token quantiles), fit one
    non-negative line ``k1 * tokens + k2 * spec_steps + b`` per segment (relative error), keep the split whose
    max-of-lines model has the lowest training MAPE, then refine by re-assigning each row to the piece that is
    its maximum and refitting (until the assignment stops changing). ``pieces=2`` is the paper's setting."""
    nnls = _scipy_optimize().nnls
    t = df["time_s"].to_numpy()
    tokens = (df["prefill_tokens"] + df["decode_tokens"]).to_numpy(np.float64)
    x = np.stack([tokens, df["spec_steps"].to_numpy(np.float64), np.ones_like(t)], axis=1)

    def line(mask: np.ndarray) -> np.ndarray:
        a = x[mask] / t[mask, None]
        scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
        return nnls(a / scale, np.ones(mask.sum()))[0] / scale

    candidates = np.unique(np.quantile(tokens, np.linspace(0.025, 0.975, 39)))
    best: tuple[float, RooflinePerf] | None = None
    for cuts in _combinations(candidates, pieces - 1):
        edges = np.concatenate([[-np.inf], cuts, [np.inf]])
        masks = [(tokens > lo) & (tokens <= hi) for lo, hi in zip(edges[:-1], edges[1:])]
        if any(m.sum() < 3 for m in masks):
            continue
        k = np.array([line(m) for m in masks])
        err = mape(RooflinePerf(k[:, 0], k[:, 1], k[:, 2]), df)
        if best is None or err < best[0]:
            best = (err, k)
    if best is None:
        k = line(np.ones(len(t), bool))
        return RooflinePerf([k[0]], [k[1]], [k[2]])
    k = best[1]
    owner = None
    for _ in range(20):
        new_owner = np.argmax(x @ k.T, axis=1)
        if owner is not None and np.array_equal(new_owner, owner):
            break
        owner = new_owner
        k = np.array([line(owner == i) if (owner == i).sum() >= 3 else k[i] for i in range(len(k))])
    return RooflinePerf(k[:, 0], k[:, 1], k[:, 2])


def _combinations(values: np.ndarray, r: int) -> list[np.ndarray]:
    from itertools import combinations
    return [np.array(c) for c in combinations(values.tolist(), r)]


def _fit_table(df: pd.DataFrame) -> TablePerf:
    """Grid = the distinct ``total_tokens`` and ``kv_tokens`` values of the records; each cell the mean time of
    its rows; empty cells filled by linear interpolation along the KV axis, then along the token axis (edge
    cells take the nearest value)."""
    d = df.assign(total_tokens=df["prefill_tokens"] + df["decode_tokens"])
    grid = d.pivot_table(index="total_tokens", columns="kv_tokens", values="time_s", aggfunc="mean")
    if grid.shape[0] < 2 or grid.shape[1] < 2:
        raise ValueError("table: records need >= 2 distinct total_tokens and >= 2 distinct kv_tokens values")
    grid = grid.interpolate(axis=1, limit_direction="both").interpolate(axis=0, limit_direction="both")
    return TablePerf(grid.index.to_numpy(float), grid.columns.to_numpy(float), grid.to_numpy())


def _fit_analytic(df: pd.DataFrame, init: dict[str, float], fixed: tuple[str, ...] = ()) -> AnalyticPerf:
    """Fit the free efficiency/overhead parameters (``AnalyticPerf.fit_names`` minus ``fixed``) by bounded
    least squares on relative residuals, in log space (so they stay positive); architecture and GPU numbers
    come from ``init`` and are never fitted."""
    opt = _scipy_optimize()
    free = [k for k in AnalyticPerf.fit_names if k not in fixed]
    f, t = features_of(df), df["time_s"].to_numpy()
    x0 = np.log(np.array([max(init[k], 1e-12) for k in free]))
    lo = np.log(np.array([1e-3 if k.endswith("eff") else 1e-12 for k in free]))
    hi = np.log(np.array([1.0 if k.endswith("eff") else (1e15 if k == "ar_bw" else 1.0) for k in free]))
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)

    def build(x: np.ndarray) -> AnalyticPerf:
        return AnalyticPerf(**{**init, **dict(zip(free, np.exp(x).tolist()))})

    res = opt.least_squares(lambda x: build(x).batch_time(f) / t - 1.0, x0, bounds=(lo, hi), x_scale=1.0)
    return build(res.x)


def fit_perf_model(records: pd.DataFrame | str | Path, family: str, holdout: float = 0.2, seed: int = 0,
                   **options: Any) -> tuple[PerfModel, dict[str, Any]]:
    """Fit ``family`` to ``records``; returns the model and ``{"family", "n_rows", "n_train", "n_holdout",
    "train_mape_pct", "holdout_mape_pct"}``.

    ``options``: ``pieces`` (roofline, default 2); ``init`` (analytic: a full parameter dict -- architecture,
    GPU and starting values) and ``fixed`` (analytic: names of fit parameters kept at their ``init`` value).
    With ``holdout=0`` every row trains and the held-out MAPE is ``None``.
    """
    if family not in PERF_FAMILIES:
        raise ValueError(f"unknown perf-model family {family!r}; known: {sorted(PERF_FAMILIES)}")
    if not 0.0 <= holdout < 1.0:
        raise ValueError("holdout must be in [0, 1)")
    df = load_records(records)
    test = np.random.default_rng(seed).random(len(df)) < holdout
    train, held = df[~test], df[test]
    if len(train) == 0:
        raise ValueError("no training rows left after the holdout split")
    cls = PERF_FAMILIES[family]
    if cls is PhaseQuadraticPwlPerf:
        model: PerfModel = _fit_pwl(train)
    elif issubclass(cls, LinearTermsPerf):
        model = _fit_linear(cls, train)
    elif cls is RooflinePerf:
        model = _fit_roofline(train, int(options.get("pieces", 2)))
    elif cls is TablePerf:
        model = _fit_table(train)
    elif cls is AnalyticPerf:
        if "init" not in options:
            raise ValueError("analytic fit needs init={architecture, GPU and starting parameters}")
        model = _fit_analytic(train, options["init"], tuple(options.get("fixed", ())))
    else:  # a family registered elsewhere without a fitting rule
        raise ValueError(f"no fitting rule for family {family!r}")
    report = {"family": family, "n_rows": len(df), "n_train": len(train), "n_holdout": len(held),
              "train_mape_pct": mape(model, train),
              "holdout_mape_pct": mape(model, held) if len(held) else None}
    return model, report


def fit_best(records: pd.DataFrame | str | Path, families: tuple[str, ...] = AUTO_FAMILIES,
             holdout: float = 0.2, seed: int = 0) -> tuple[PerfModel, dict[str, Any]]:
    """Fit every family of ``families`` on the same holdout split and keep the first (simplest) whose held-out
    MAPE is within :data:`TIE_MAPE_PCT` of the lowest; its report gains ``candidates`` (family -> held-out
    MAPE, in %)."""
    if not families or holdout <= 0.0:
        raise ValueError("fit_best needs at least one family and holdout > 0 (the held-out MAPE picks the family)")
    df = load_records(records)
    fits = {f: fit_perf_model(df, f, holdout=holdout, seed=seed) for f in families}
    low = min(r["holdout_mape_pct"] for _, r in fits.values())
    best = next(f for f in families if fits[f][1]["holdout_mape_pct"] <= low + TIE_MAPE_PCT)
    model, report = fits[best]
    return model, report | {"candidates": {f: r["holdout_mape_pct"] for f, (_, r) in fits.items()}}


def fit_profile(csv_path: str | Path, family: str, engine_name: str = "custom", model: str = "unknown",
                gpu: str = "unknown", tp: int = 1, kv_capacity_tokens: int = 0, kv_bytes_per_token: int = 0,
                holdout: float = 0.2, seed: int = 0, **options: Any) -> dict[str, Any]:
    """Fit ``family`` to the records in ``csv_path`` and return a preset dict (``EngineSpec.to_dict()`` format)
    whose provenance names the file and the held-out MAPE. ``family="auto"``: the best of
    :data:`AUTO_FAMILIES` by held-out MAPE (:func:`fit_best`). Backs ``slogym profile fit``."""
    if family == "auto":
        if options:
            raise ValueError(f"family 'auto' takes no family options, got {sorted(options)}")
        perf, report = fit_best(csv_path, holdout=holdout, seed=seed)
    else:
        perf, report = fit_perf_model(csv_path, family, holdout=holdout, seed=seed, **options)
    spec = EngineSpec(name=engine_name, model=model, gpu=gpu, tp=tp, perf=perf,
                      kv_capacity_tokens=int(kv_capacity_tokens), kv_bytes_per_token=int(kv_bytes_per_token),
                      provenance={"profile": str(csv_path), "fit": report})
    return spec.to_dict()

"""Perf-model families: batch features -> iteration time (seconds).

Every ``batch_time`` uses only ``+ - * /``, ``maximum``/``minimum``, comparisons and table lookups
(``searchsorted`` + linear interpolation), applied element-wise with no reductions across batches, so a batch
evaluated alone or among thousands gets bit-identical float64 results. Sums of several terms are always added in
the same fixed order (never through ``dot``/BLAS, whose blocking depends on the array length).

Array code goes through the module attribute :data:`xp` (``numpy`` by default) so a later CuPy switch only has
to rebind it (models keep their coefficients as Python floats or ``xp`` arrays built in ``__init__``).

Families (see ``docs/engines.md``):

``roofline``            SLOs-Serve §3.1.1: ``max_l(k1_l * tokens + k2_l * spec_steps + b_l)``
``linear-interaction``  SA-scheduler paper (Huang et al. 2025) Eq. 14-15 with Table 2's coefficient layout
``quadratic``           DistServe / HyperFlexis Eq. 1-2: quadratic prefill + linear decode
``phase-quadratic``     ``quadratic`` + a constant per phase present + a per-prefill-sequence cost (SA Eq. 14-15)
``phase-quadratic-pwl`` ``phase-quadratic`` + a piecewise-linear cost of the token count (PolyServe §4.5's token axis)
``table``               PolyServe §4.5: profiled grid (token batch size x KV size), bilinear interpolation
``analytic``            roofline from model architecture and GPU datasheet, with fitted efficiency factors
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy
from numba import njit

from slogym.core.batch import BatchFeatures
from slogym.engines.base import SCALAR, PerfModel

xp = numpy
"""Array module used by every ``batch_time`` (swap for ``cupy`` to evaluate on a GPU)."""


def _ops(x: Any) -> Any:
    return xp if x is None else x


class LinearTermsPerf(PerfModel):
    """Base of families that are a fixed-order sum ``sum_i coef_i * term_i(f)`` (linear in the coefficients).

    Subclasses list ``term_names`` (also the constructor's keyword names) and implement :meth:`terms`;
    :mod:`slogym.engines.fitting` fits them by non-negative least squares on the same terms.
    """

    term_names: ClassVar[tuple[str, ...]]

    def __init__(self, **coefs: float) -> None:
        missing = set(self.term_names) - set(coefs)
        unknown = set(coefs) - set(self.term_names)
        if missing or unknown:
            raise ValueError(f"{self.family}: missing {sorted(missing)}, unknown {sorted(unknown)} coefficients")
        self.coefs = {k: float(coefs[k]) for k in self.term_names}
        self._c = tuple(self.coefs[k] for k in self.term_names)

    def terms(self, f: BatchFeatures, x: Any = None) -> list[Any]:
        """Term arrays (float64 or int64, shape ``(m,)``) in ``term_names`` order."""
        raise NotImplementedError

    def batch_time(self, f: BatchFeatures, x: Any = None) -> Any:
        terms = self.terms(f, x)
        t = terms[0] * self._c[0]
        for c, term in zip(self._c[1:], terms[1:]):
            t = t + term * c
        return t

    def params(self) -> dict[str, Any]:
        return dict(self.coefs)


class QuadraticPerf(LinearTermsPerf):
    """DistServe-style latency model as used by HyperFlexis (Eq. 1-2, App. A).

    HyperFlexis Eq. 1 (prefill batch) is ``c0 + c1 * sum(l_i) + c2 * sum(l_i^2)`` over prompt lengths ``l_i``;
    Eq. 2 (decode step) is ``d0 + d1 * B + d2 * sum(l_i)`` with ``l_i`` the current length of request ``i`` (the
    symbols are lost in the text extraction; reconstructed from the prose). Mapping onto BatchFeatures::

        time = c0 * [batch non-empty]
             + c_prefill_tok * prefill_tokens + c_prefill_sq * prefill_sq + c_prefill_attn * prefill_attn
             + c_decode_tok * decode_tokens + c_decode_ctx * decode_ctx

    Mixed (chunked-prefill) batches share one intercept (one pass over the weights) and add the per-token and
    attention terms of both phases. ``prefill_sq`` is the paper's ``sum(l^2)``; ``prefill_attn`` =
    ``chunk * (past + chunk)`` extends it to chunks with a KV prefix (equal to ``prefill_sq`` when the past is 0).
    ``decode_tokens`` replaces ``B`` so speculative verification tokens are counted.
    """

    family = "quadratic"
    term_names = ("c0", "c_prefill_tok", "c_prefill_sq", "c_prefill_attn", "c_decode_tok", "c_decode_ctx")

    def terms(self, f: BatchFeatures, x: Any = None) -> list[Any]:
        nonempty = (f.prefill_tokens + f.decode_tokens) > 0
        return [nonempty, f.prefill_tokens, f.prefill_sq, f.prefill_attn, f.decode_tokens, f.decode_ctx]


class PhaseQuadraticPerf(LinearTermsPerf):
    """:class:`QuadraticPerf` with a constant per phase and a per-prefill-sequence cost.

    Combines the HyperFlexis/DistServe quadratic (Eq. 1-2, App. A) with the SA scheduler's per-phase constants
    and per-sequence ``B`` term (Huang et al. 2025, Eq. 14-15: each phase's constant is charged only when the
    phase is present)::

        time = c0 * [batch non-empty] + c_prefill_0 * [prefill present] + c_decode_0 * [decode present]
             + c_prefill_seq * prefill_seqs
             + c_prefill_tok * prefill_tokens + c_prefill_sq * prefill_sq + c_prefill_attn * prefill_attn
             + c_decode_tok * decode_tokens + c_decode_ctx * decode_ctx

    Why (measured on a live vLLM CPU engine, ``docs/live_engine.md``): with one shared intercept the quadratic
    fit traded decode-only against prefill-only batches and came out 5-17 % low on prefill-only and 2-11 % high
    on decode-only live iterations. A prefill pays per-phase set-up (attention metadata of a prefill, the
    first-chunk path) and a per-sequence cost independent of its length (sampling and the logits row of its
    last token, request bookkeeping); a decode step pays its own set-up. Unlike ``linear-interaction``, a mixed
    batch shares ``c0`` (one pass over the weights) and token costs stay additive, so chunked-prefill batches
    are not charged two full iterations. Deviation: neither paper has this exact form; it is the union of
    their terms, fitted by the same non-negative least squares.
    """

    family = "phase-quadratic"
    term_names = ("c0", "c_prefill_0", "c_decode_0", "c_prefill_seq", "c_prefill_tok", "c_prefill_sq",
                  "c_prefill_attn", "c_decode_tok", "c_decode_ctx")

    def terms(self, f: BatchFeatures, x: Any = None) -> list[Any]:
        nonempty = (f.prefill_tokens + f.decode_tokens) > 0
        return [nonempty, f.prefill_tokens > 0, f.decode_tokens > 0, f.prefill_seqs, f.prefill_tokens,
                f.prefill_sq, f.prefill_attn, f.decode_tokens, f.decode_ctx]


class PhaseQuadraticPwlPerf(PhaseQuadraticPerf):
    """:class:`PhaseQuadraticPerf` plus a profiled piecewise-linear cost of the batch's token count.

    ::

        time = phase-quadratic(f) + g(prefill_tokens + decode_tokens)      (0 for an empty batch)

    ``g`` interpolates linearly between its values ``knot_time`` at the token counts ``knots`` (held flat below
    the first knot, the last cell's slope extended above the last): the token axis of PolyServe §4.5's profile
    table, added to the phase-quadratic terms instead of replacing them (the table family alone gives a
    prefill chunk and as many decode tokens the same cost). Why (measured on a live vLLM CPU engine,
    ``docs/live_engine.md``): the linear layers' time over the token count ``M`` is not linear at small ``M``
    -- decode steps of 2 requests cost 8-10 % more than the phase-quadratic line through the other batch sizes
    and more than a step of 4, those of 1 and 3 a few % more -- and decode steps of 1-3 requests are most of a
    served replay's iterations. ``fitting`` fits ``knot_time`` with the other coefficients by the same
    non-negative least squares (the knots are profiled token counts). Deviation: neither paper has this exact
    form; it is the union of the phase-quadratic terms and a one-axis PolyServe table.
    """

    family = "phase-quadratic-pwl"

    def __init__(self, knots: Sequence[float], knot_time: Sequence[float], **coefs: float) -> None:
        super().__init__(**coefs)
        k, v = (numpy.asarray(a, dtype=numpy.float64) for a in (knots, knot_time))
        if k.ndim != 1 or k.size < 2 or v.shape != k.shape or (numpy.diff(k) <= 0).any() or k[0] < 1:
            raise ValueError(f"{self.family}: knots must be >= 2 strictly increasing token counts >= 1 with one "
                             f"knot_time each, got knots={k.tolist()}, knot_time={v.tolist()}")
        if not numpy.isfinite(v).all() or (v < 0).any():
            raise ValueError(f"{self.family}: knot_time must be finite and >= 0, got {v.tolist()}")
        self._k, self._v = xp.asarray(k), xp.asarray(v)

    def _grids(self, X: Any) -> tuple[Any, Any]:
        if X is SCALAR or X is numpy:
            return self._k, self._v
        return X.asarray(self._k), X.asarray(self._v)

    def knot_weights(self, f: BatchFeatures, x: Any = None) -> list[Any]:
        """Per knot, the weight of its ``knot_time`` in ``g`` (arrays, shape ``(m,)``): the columns the fit
        solves for; ``g = sum_j knot_time[j] * weight_j`` up to rounding."""
        X = _ops(x)
        k, _ = self._grids(X)
        i, w = _interp_index(k, f.prefill_tokens + f.decode_tokens, X)
        return [(i == j) * (1.0 - w) + (i + 1 == j) * w for j in range(int(k.shape[0]))]

    def batch_time(self, f: BatchFeatures, x: Any = None) -> Any:
        X = _ops(x)
        k, v = self._grids(X)
        tokens = f.prefill_tokens + f.decode_tokens
        i, w = _interp_index(k, tokens, X)
        g = v[i] + (v[i + 1] - v[i]) * w
        return super().batch_time(f, x) + X.where(tokens > 0, g, 0.0)

    def params(self) -> dict[str, Any]:
        return {**self.coefs, "knots": numpy.asarray(self._k).tolist(), "knot_time": numpy.asarray(self._v).tolist()}


class LinearInteractionPerf(LinearTermsPerf):
    """Linear-with-interaction predictor of Huang et al. 2025 (SA scheduler), Eq. 14-15 and Table 2.

    The equations' symbols are lost in the extraction. From the prose ("prefill time increases linearly to both
    the input length and the batch size", "multiple linear regression models that include interaction terms")
    and Table 2's four coefficients per phase we assume, for batch size ``B`` and length ``L``::

        T_prefill = a_p * B*L + b_p * B + g_p * L + d_p        (Eq. 14, L = input length)
        T_decode  = a_d * B*L + b_d * B + g_d * L + d_d        (Eq. 15, per token, L = accumulated length)

    with Table 2's columns in the order (B*L, B, L, const), in milliseconds (the only order giving a
    physically plausible ~0.1 ms per prefill token for Qwen2.5-7B on 2 V100s). Mapping onto BatchFeatures:
    ``B*L`` -> ``prefill_tokens`` / ``decode_ctx`` (the sum of lengths, exact when lengths are equal),
    ``B`` -> ``prefill_seqs`` / ``decode_seqs``, ``L`` -> the mean length ``sum / B``, and the constant is
    charged only when the phase is present. A mixed batch costs the sum of both phases, as in the paper's
    setting (vLLM without chunked prefill runs them as separate iterations). ``spec_steps`` is ignored.
    """

    family = "linear-interaction"
    term_names = ("p_bl", "p_b", "p_l", "p_0", "d_bl", "d_b", "d_l", "d_0")

    def terms(self, f: BatchFeatures, x: Any = None) -> list[Any]:
        X = _ops(x)
        p_mean = f.prefill_tokens / X.maximum(f.prefill_seqs, 1)
        d_mean = f.decode_ctx / X.maximum(f.decode_seqs, 1)
        return [f.prefill_tokens, f.prefill_seqs, p_mean, f.prefill_seqs > 0,
                f.decode_ctx, f.decode_seqs, d_mean, f.decode_seqs > 0]


class RooflinePerf(PerfModel):
    """SLOs-Serve §3.1.1 generalized roofline: ``time = max_l (k1[l] * tokens + k2[l] * spec_steps + b[l])``.

    ``tokens`` is ``total_tokens`` (prefill + decode-verified tokens) and ``spec_steps`` the draft-model passes.
    The paper uses two pieces (a compute line through ~0 and a flat weight-read line); any number is allowed.
    An empty batch costs 0. Context length is not a feature of this family (as in the paper).
    """

    family = "roofline"

    def __init__(self, k1: Sequence[float], k2: Sequence[float], b: Sequence[float]) -> None:
        if not (len(k1) == len(k2) == len(b) >= 1):
            raise ValueError("roofline: k1, k2, b must be non-empty and of equal length")
        self.k1, self.k2, self.b = [float(v) for v in k1], [float(v) for v in k2], [float(v) for v in b]
        self._pieces = tuple(zip(self.k1, self.k2, self.b))

    def batch_time(self, f: BatchFeatures, x: Any = None) -> Any:
        X = _ops(x)
        tokens = f.prefill_tokens + f.decode_tokens
        t = None
        for k1, k2, b in self._pieces:
            piece = tokens * k1 + f.spec_steps * k2 + b
            t = piece if t is None else X.maximum(t, piece)
        return X.where(tokens > 0, t, 0.0)

    def params(self) -> dict[str, Any]:
        return {"k1": self.k1, "k2": self.k2, "b": self.b}


def _interp_index(grid: Any, v: Any, X: Any) -> tuple[Any, Any]:
    """Cell index and weight for linear interpolation on an ascending grid.

    Below the first point the weight is clamped to 0 (flat); above the last point the last cell's slope is
    extended (linear extrapolation), so a table that grows at its edge keeps growing.
    """
    i = X.clip(X.searchsorted(grid, v, side="right") - 1, 0, grid.shape[0] - 2)
    lo = grid[i]
    w = X.maximum((v - lo) / (grid[i + 1] - lo), 0.0)
    return i, w


class TablePerf(PerfModel):
    """PolyServe §4.5 profile table with bilinear interpolation.

    PolyServe maps (batch size, KV-cache size) to iteration time and neglects prefill attention under chunked
    prefill. Here the first axis is the *token* batch size ``total_tokens`` (equal to the batch size for a pure
    decode batch without speculation, and covering prefill chunks' GEMM cost for mixed batches); the second is
    ``kv_tokens``. ``times[i][j]`` is the time at ``(tokens_grid[i], kv_grid[j])``. Below the grid the value is
    held flat; above it the edge cell's slope is extrapolated linearly. An empty batch costs 0.
    """

    family = "table"

    def __init__(self, tokens_grid: Sequence[float], kv_grid: Sequence[float], times: Sequence[Sequence[float]]):
        tg, kg, tt = (numpy.asarray(a, dtype=numpy.float64) for a in (tokens_grid, kv_grid, times))
        if tg.ndim != 1 or kg.ndim != 1 or tt.shape != (tg.size, kg.size) or tg.size < 2 or kg.size < 2:
            raise ValueError("table: need >=2 points per axis and times of shape (len(tokens_grid), len(kv_grid))")
        if (numpy.diff(tg) <= 0).any() or (numpy.diff(kg) <= 0).any() or not numpy.isfinite(tt).all():
            raise ValueError("table: grids must be strictly increasing and times finite")
        self._tg, self._kg, self._tt = xp.asarray(tg), xp.asarray(kg), xp.asarray(tt)

    def _grids(self, X: Any) -> tuple[Any, Any, Any]:
        if X is SCALAR or X is numpy:
            return self._tg, self._kg, self._tt
        return X.asarray(self._tg), X.asarray(self._kg), X.asarray(self._tt)

    def batch_time(self, f: BatchFeatures, x: Any = None) -> Any:
        X = _ops(x)
        tg, kg, tt = self._grids(X)
        tokens = f.prefill_tokens + f.decode_tokens
        i, wi = _interp_index(tg, tokens, X)
        j, wj = _interp_index(kg, f.kv_tokens, X)
        lo = tt[i, j] + (tt[i, j + 1] - tt[i, j]) * wj
        hi = tt[i + 1, j] + (tt[i + 1, j + 1] - tt[i + 1, j]) * wj
        return X.where(tokens > 0, lo + (hi - lo) * wi, 0.0)

    def params(self) -> dict[str, Any]:
        return {"tokens_grid": numpy.asarray(self._tg).tolist(), "kv_grid": numpy.asarray(self._kg).tolist(),
                "times": numpy.asarray(self._tt).tolist()}


@njit(cache=True, nogil=True)
def analytic_time(prefill_tokens: Any, prefill_seqs: Any, prefill_attn: Any, decode_seqs: Any, decode_tokens: Any,
                   decode_ctx: Any, c: numpy.ndarray) -> Any:
    """:class:`AnalyticPerf`'s formula, element-wise on ints or arrays; ``c`` = (lin_c, lin_a, lin_w, tok, pf_c,
    pf_b, dec, attn_fix, lm_c, lm_w, fixed), the per-iteration coefficients its ``__init__`` folds."""
    tokens = prefill_tokens + decode_tokens
    t = numpy.maximum(tokens * c[0], tokens * c[1] + c[2])
    t = t + tokens * c[3]
    t = t + numpy.maximum(prefill_attn * c[4], prefill_tokens * c[5])
    t = t + decode_ctx * c[6]
    t = t + ((prefill_tokens > 0) * c[7] + (decode_seqs > 0) * c[7])
    t = t + numpy.maximum((prefill_seqs + decode_tokens) * c[8], c[9])
    return (tokens > 0) * (t + c[10])  # an empty batch takes no time


class AnalyticPerf(PerfModel):
    """Roofline built from model architecture and GPU datasheet numbers, with fitted efficiency factors.

    Per GPU of a ``tp``-way tensor-parallel replica, with ``T = total_tokens``::

        linear   = L * (max(T * F_lin / (peak*mm_eff), (W_lin + T * A_lin) / (bw*bw_eff)) + elem_s * T + layer_fixed_s)
        prefill  = L * max(prefill_attn * F_att / (peak*attn_eff), prefill_tokens * Q_att / (bw*attn_bw_eff))
        decode   = L * decode_ctx * max(F_att / (peak*attn_eff), KV_layer / (bw*attn_bw_eff))
        attn_fix = L * attn_fixed_s * ([prefill present] + [decode present])
        allreduce= 2 * L * (ar_lat_s + T * hidden * dtype / ar_bw)            (only when tp > 1)
        lm_head  = max(R * 2*hidden*V/tp / (peak*mm_eff), hidden*V/tp*dtype / (bw*bw_eff)),
                   R = prefill_seqs + decode_tokens
        time     = overhead_s + linear + prefill + decode + attn_fix + allreduce + lm_head   (0 for an empty batch)

    ``F_lin = 2 * P_layer / tp`` FLOPs per token (``P_layer`` = QKV + O + ``mlp_mats`` x hidden x intermediate
    weights), ``W_lin = P_layer / tp * dtype`` weight bytes, ``A_lin`` activation bytes per token (inputs and
    outputs of each GEMM), ``F_att = 4 * head_dim * n_heads / tp`` FLOPs per (query, key) pair, ``KV_layer`` =
    K+V bytes per token per layer on one GPU, ``Q_att`` = Q/K/V/O bytes per prefill token. Assumptions:
    ``prefill_attn`` counts full (non-causal-halved) pairs -- ``attn_eff`` absorbs the causal saving; the past-KV
    read of chunked prefill is not a feature and is neglected; logits are computed for one token per prefilling
    request and per verified decode token; ``elem_s`` covers norms, RoPE, activation and residual adds
    (memory-bound, per token); ``overhead_s`` is the per-iteration CPU/scheduling time not seen by kernel profiles.
    """

    family = "analytic"
    arch_names: ClassVar[tuple[str, ...]] = (
        "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab", "mlp_mats",
        "dtype_bytes", "tp", "peak_flops", "hbm_bw")
    fit_names: ClassVar[tuple[str, ...]] = (
        "mm_eff", "bw_eff", "attn_eff", "attn_bw_eff", "elem_s", "layer_fixed_s", "attn_fixed_s",
        "ar_lat_s", "ar_bw", "overhead_s")

    def __init__(self, **p: float) -> None:
        missing = set(self.arch_names + self.fit_names) - set(p)
        unknown = set(p) - set(self.arch_names + self.fit_names)
        if missing or unknown:
            raise ValueError(f"analytic: missing {sorted(missing)}, unknown {sorted(unknown)} params")
        if min(p[k] for k in ("mm_eff", "bw_eff", "attn_eff", "attn_bw_eff", "ar_bw", "peak_flops", "hbm_bw")) <= 0:
            raise ValueError("analytic: efficiencies, bandwidths and peak FLOP/s must be positive")
        self.p = {k: float(p[k]) for k in self.arch_names + self.fit_names}
        q = self.p
        L, h, tp, db = q["n_layers"], q["hidden"], q["tp"], q["dtype_bytes"]
        heads_gpu = q["n_heads"] / tp
        kv_gpu = max(q["n_kv_heads"] / tp, 1.0)  # KV heads are replicated when tp > n_kv_heads
        hd = q["head_dim"]
        qkv = (q["n_heads"] + 2 * q["n_kv_heads"]) * hd
        p_layer = h * qkv + q["n_heads"] * hd * h + q["mlp_mats"] * h * q["intermediate"]
        flops_mm, bw_lin = q["peak_flops"] * q["mm_eff"], q["hbm_bw"] * q["bw_eff"]
        flops_att, bw_att = q["peak_flops"] * q["attn_eff"], q["hbm_bw"] * q["attn_bw_eff"]
        act = db * (4 * h + (qkv + q["n_heads"] * hd + q["mlp_mats"] * q["intermediate"]) / tp)
        f_att = 4.0 * hd * heads_gpu
        # per-iteration coefficients (all layers folded in)
        self._lin_c = L * 2.0 * p_layer / tp / flops_mm
        self._lin_w = L * p_layer / tp * db / bw_lin
        self._lin_a = L * act / bw_lin
        self._tok = L * q["elem_s"] + (2 * L * h * db / q["ar_bw"] if tp > 1 else 0.0)
        self._fixed = q["overhead_s"] + L * q["layer_fixed_s"] + (2 * L * q["ar_lat_s"] if tp > 1 else 0.0)
        self._pf_c = L * f_att / flops_att
        self._pf_b = L * db * (2 * kv_gpu + 2 * heads_gpu) * hd / bw_att
        self._dec = L * max(f_att / flops_att, 2 * kv_gpu * hd * db / bw_att)
        self._attn_fix = L * q["attn_fixed_s"]
        self._lm_c = 2.0 * h * q["vocab"] / tp / flops_mm
        self._lm_w = h * q["vocab"] / tp * db / bw_lin
        self._coef = numpy.array([self._lin_c, self._lin_a, self._lin_w, self._tok, self._pf_c, self._pf_b,
                                  self._dec, self._attn_fix, self._lm_c, self._lm_w, self._fixed])

    def batch_time(self, f: BatchFeatures, x: Any = None) -> Any:
        args = (f.prefill_tokens, f.prefill_seqs, f.prefill_attn, f.decode_seqs, f.decode_tokens, f.decode_ctx,
                self._coef)
        # compiled for Python ints and NumPy arrays (the simulator's paths); other array modules (CuPy) run the
        # same formula uncompiled, their arrays dispatching NumPy's ufuncs
        return analytic_time(*args) if x is None or x is SCALAR or x is numpy else analytic_time.py_func(*args)

    def compiled_time(self) -> numpy.ndarray:
        """Coefficients of :func:`analytic_time`, the compiled formula the simulator's pilot calls
        (``slogym.core.pilot``); None for a subclass that changes ``batch_time`` (it is stepped in Python)."""
        return self._coef if type(self).batch_time is AnalyticPerf.batch_time else None

    def attention_layer_time(self, f: BatchFeatures) -> Any:
        """Attention kernel time of one layer on one GPU (the terms ``attention.csv`` measures)."""
        pf = xp.maximum(f.prefill_attn * self._pf_c, f.prefill_tokens * self._pf_b) + f.decode_ctx * self._dec
        fix = (f.prefill_tokens > 0) * self._attn_fix + (f.decode_seqs > 0) * self._attn_fix
        return (pf + fix) / self.p["n_layers"]

    def params(self) -> dict[str, Any]:
        return dict(self.p)


MODEL_CONFIGS: dict[str, dict[str, float]] = {
    # From each model's Hugging Face config.json (num_hidden_layers, hidden_size, num_attention_heads,
    # num_key_value_heads, intermediate_size, vocab_size); mlp_mats 3 = gated (SwiGLU), 2 = plain FFN.
    "llama2-7b": dict(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, head_dim=128, intermediate=11008,
                      vocab=32000, mlp_mats=3),
    "llama2-70b": dict(n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, head_dim=128, intermediate=28672,
                       vocab=32000, mlp_mats=3),
    "llama3-8b": dict(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=14336,
                      vocab=128256, mlp_mats=3),
    "llama3-70b": dict(n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, head_dim=128, intermediate=28672,
                       vocab=128256, mlp_mats=3),
    "opt-13b": dict(n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40, head_dim=128, intermediate=20480,
                    vocab=50272, mlp_mats=2),
    "qwen2.5-7b": dict(n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, head_dim=128, intermediate=18944,
                       vocab=152064, mlp_mats=3),
}
"""Architectures (16-bit weights assumed: ``dtype_bytes`` = 2)."""

TIED_EMBEDDINGS = {"opt-13b"}
"""Models whose LM head shares the input embedding matrix (counted once in the weight bytes)."""

GPU_SPECS: dict[str, dict[str, float]] = {
    # Dense FP16/BF16 tensor-core peak (no sparsity), HBM bandwidth and memory, from NVIDIA datasheets:
    # A100 SXM4 80GB (A100 datasheet), H100 SXM5 (H100 datasheet), H200 SXM (H200 datasheet),
    # A40 (A40 datasheet), V100 PCIe 32GB (V100 datasheet; the SA paper's testbed uses PCIe V100s).
    "a100": dict(peak_flops=312e12, hbm_bw=2.039e12, mem_bytes=80e9),
    "h100": dict(peak_flops=989e12, hbm_bw=3.35e12, mem_bytes=80e9),
    "h200": dict(peak_flops=989e12, hbm_bw=4.8e12, mem_bytes=141e9),
    "a40": dict(peak_flops=149.7e12, hbm_bw=696e9, mem_bytes=48e9),
    "v100": dict(peak_flops=112e12, hbm_bw=900e9, mem_bytes=32e9),
}


def weight_bytes(model: str, dtype_bytes: int = 2) -> int:
    """Total weight bytes of ``model`` (linear layers + embeddings + LM head; norms and biases neglected)."""
    c = MODEL_CONFIGS[model]
    qkv = (c["n_heads"] + 2 * c["n_kv_heads"]) * c["head_dim"]
    layer = (c["hidden"] * qkv + c["n_heads"] * c["head_dim"] * c["hidden"]
             + c["mlp_mats"] * c["hidden"] * c["intermediate"])
    emb = c["vocab"] * c["hidden"] * (1 if model in TIED_EMBEDDINGS else 2)
    return int((c["n_layers"] * layer + emb) * dtype_bytes)


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    """K and V bytes per token over all layers and heads of ``model``."""
    c = MODEL_CONFIGS[model]
    return int(2 * c["n_layers"] * c["n_kv_heads"] * c["head_dim"] * dtype_bytes)

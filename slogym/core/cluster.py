"""Cluster-scale models: the KV-cache transfer time of prefill/decode disaggregation and instance cold starts
(HyperFlexis Table 2).

The mechanisms themselves (roles, lifecycle, transfers, cost) live in the simulator; this module holds the
numbers and formulas they use. See docs/cluster.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------------------------- KV transfer


@dataclass
class KVTransfer:
    """Time to move a request's KV cache from a prefill instance to a decode instance.

    ``seconds = latency_s + tokens * bytes_per_token / (bandwidth_gbps * 1e9 / 8)``: one message of the
    request's computed tokens over a link of ``bandwidth_gbps`` gigabits per second (100 = one 100 Gb/s
    RDMA NIC per GPU; NVLink is ~3600). With tensor parallelism every rank sends its own KV heads over its own
    link in parallel, so ``bytes_per_token`` is the per-rank share.

    bytes_per_token  None = from the engine preset: ``kv_bytes_per_token / tp`` (= 2 * layers * kv_heads *
                     head_dim * dtype_bytes / tp, from the model config), or the architecture table of
                     ``slogym.engines.perf_models.MODEL_CONFIGS`` for the preset's ``model``
    """

    bytes_per_token: float | None = None
    bandwidth_gbps: float = 100.0
    latency_s: float = 1e-4
    _per_engine: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.bytes_per_token is not None and not self.bytes_per_token >= 0:
            raise ValueError(f"KVTransfer bytes_per_token={self.bytes_per_token!r}; must be >= 0")
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"KVTransfer bandwidth_gbps={self.bandwidth_gbps!r}; must be > 0")
        if not self.latency_s >= 0:
            raise ValueError(f"KVTransfer latency_s={self.latency_s!r}; must be >= 0")

    def bytes_for(self, engine: Any) -> float:
        """KV bytes per token each link carries for ``engine`` (see the class doc)."""
        if self.bytes_per_token is not None:
            return float(self.bytes_per_token)
        key = id(engine)
        if key not in self._per_engine:
            self._per_engine[key] = engine_kv_bytes_per_token(engine)
        return self._per_engine[key]

    def seconds(self, tokens: int, engine: Any) -> float:
        return self.latency_s + tokens * self.bytes_for(engine) / (self.bandwidth_gbps * 1e9 / 8.0)


def engine_kv_bytes_per_token(engine: Any) -> float:
    """Per-rank KV bytes per token of an engine preset: ``kv_bytes_per_token / tp``, else from the model
    config of ``engine.model``; raises naming the engine when neither is known."""
    tp = int(getattr(engine, "tp", 1) or 1)
    total = float(getattr(engine, "kv_bytes_per_token", 0) or 0)
    if total <= 0:
        from slogym.engines.perf_models import MODEL_CONFIGS, kv_bytes_per_token

        model = getattr(engine, "model", None)
        if model not in MODEL_CONFIGS:
            raise ValueError(f"engine {getattr(engine, 'name', engine)!r} has no kv_bytes_per_token and no known "
                             f"model config; pass KVTransfer(bytes_per_token=...)")
        total = float(kv_bytes_per_token(model))
    return total / tp


# ---------------------------------------------------------------------------------------------- cold starts
COLD_START_TABLE: dict[str, dict[float, float]] = {
    # HyperFlexis Table 2 (§8.3), mean seconds to bring up a new instance, by model size (billions of params):
    # Qwen 7B, Qwen 32B, Llama 70B.
    "d2d": {7.0: 0.89, 32.0: 2.05, 70.0: 1.16},          # "Fast Scaling": weights device-to-device from a peer
    "cpu_offload": {7.0: 2.73, 32.0: 19.41, 70.0: 11.50},  # weights kept in CPU memory, reloaded on scale-out
    "disk": {7.0: 4.14, 32.0: 28.84, 70.0: 22.58},        # weights loaded from storage
}
"""Cold-start seconds per method and model size, HyperFlexis Table 2 (std. devs. 0.01-3.14 s not modelled)."""

COLD_START_METHODS = tuple(COLD_START_TABLE)


def cold_start_seconds(model_params_b: float, method: str) -> float:
    """Seconds a new instance of a ``model_params_b``-billion-parameter model needs before serving.

    HyperFlexis Table 2 measured three weight-provisioning methods on Qwen 7B, Qwen 32B and Llama 70B:

    =============  ========  =========  ==========
    method         7B        32B        70B
    =============  ========  =========  ==========
    d2d            0.89 s    2.05 s     1.16 s
    cpu_offload    2.73 s    19.41 s    11.50 s
    disk           4.14 s    28.84 s    22.58 s
    =============  ========  =========  ==========

    Scaling rule for other sizes (the paper gives none; reconstructed): piecewise-linear interpolation in
    model size between the measured sizes; below 7B and above 70B proportional to size from the nearest
    measured point (``t(7B) * size / 7``, ``t(70B) * size / 70``). The table is not monotone in size (the 70B
    model was served with more devices loading in parallel), and the interpolation keeps the measured values
    exact at 7, 32 and 70B.
    """
    if method not in COLD_START_TABLE:
        raise ValueError(f"cold-start method {method!r}; known: {', '.join(COLD_START_METHODS)}")
    if not model_params_b > 0:
        raise ValueError(f"model_params_b={model_params_b!r}; must be > 0 (billions of parameters)")
    pts = sorted(COLD_START_TABLE[method].items())
    (s0, t0), (s1, t1) = pts[0], pts[-1]
    if model_params_b <= s0:
        return t0 * model_params_b / s0
    if model_params_b >= s1:
        return t1 * model_params_b / s1
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if a <= model_params_b <= b:
            return ta + (tb - ta) * (model_params_b - a) / (b - a)
    raise AssertionError("unreachable: the size lies between the table's ends")


def model_params_b(engine: Any) -> float:
    """Billions of parameters of an engine's model, read from its name (``llama3-8b`` -> 8.0)."""
    model = str(getattr(engine, "model", getattr(engine, "name", "")))
    m = re.search(r"(\d+(?:\.\d+)?)b\b", model.lower())
    if m is None:
        raise ValueError(f"cannot read a model size from engine model {model!r}; give cold_start in seconds")
    return float(m.group(1))


def cold_start_of(engine: Any, cold_start: float | str) -> float:
    """``cold_start`` seconds as given, or a :func:`cold_start_seconds` method name for ``engine``'s model."""
    if isinstance(cold_start, str):
        return cold_start_seconds(model_params_b(engine), cold_start)
    s = float(cold_start)
    if not s >= 0:
        raise ValueError(f"cold_start={cold_start!r}; must be >= 0 seconds or one of {COLD_START_METHODS}")
    return s

"""Perf-model interface and engine presets.

A :class:`PerfModel` maps :class:`~slogym.core.batch.BatchFeatures` of many batches to iteration times
(seconds) in one vectorized call. It uses only ``+ - * /``, ``maximum``/``minimum`` and table lookups
(no transcendental functions), so a batch evaluated alone or among thousands gives the same float bits --
the simulator's fast-forward path relies on that.

An :class:`EngineSpec` is one serving replica's hardware+model preset: its perf model, KV capacity, block size
and where every number comes from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from slogym.core.batch import BatchFeatures

PERF_FAMILIES: dict[str, type["PerfModel"]] = {}


class ScalarOps:
    """Python-float stand-ins for the array functions the families use.

    IEEE-754 ``+ - * /`` on Python floats and on NumPy float64 give the same bits, so evaluating one batch of
    Python-int features through these ops equals the vectorized result exactly, at a fraction of the cost
    (the simulator's per-iteration path; ``tests/test_perf_models.py`` checks the equality).
    """

    @staticmethod
    def maximum(a: Any, b: Any) -> Any:
        return a if a >= b else b

    @staticmethod
    def minimum(a: Any, b: Any) -> Any:
        return a if a <= b else b

    @staticmethod
    def where(c: Any, a: Any, b: Any) -> Any:
        return a if c else b

    @staticmethod
    def clip(v: Any, lo: Any, hi: Any) -> Any:
        return lo if v < lo else hi if v > hi else v

    @staticmethod
    def searchsorted(grid: Any, v: Any, side: str = "left") -> int:
        return int(np.searchsorted(grid, v, side=side))


SCALAR = ScalarOps()


class PerfModel(ABC):
    """Batch features -> iteration time in seconds. Subclasses register under ``family``."""

    family: ClassVar[str]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # only a class that names its own family registers: a subclass that inherits ``family`` (a test double,
        # a wrapper) must not replace the family's model in the registry
        if cls.__dict__.get("family"):
            PERF_FAMILIES[cls.family] = cls

    @abstractmethod
    def batch_time(self, f: BatchFeatures, x: Any = None) -> np.ndarray:
        """Iteration time (s, float64, shape ``(len(f),)``) of each batch in ``f``.

        ``x`` is the array-ops module (``None`` = the configured NumPy/CuPy one); the simulator passes
        :data:`SCALAR` with Python-int features to time a single batch cheaply.
        """

    def batch_time_one(self, f: BatchFeatures) -> float:
        """Time of one batch whose features are Python ints; bit-identical to :meth:`batch_time`."""
        return float(self.batch_time(f, SCALAR))

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON-serializable coefficients; ``from_params(family, params)`` rebuilds the model."""

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "PerfModel":
        return cls(**params)  # type: ignore[call-arg]

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "params": self.params()}


def perf_model_from_dict(d: dict[str, Any]) -> PerfModel:
    fam = d.get("family")
    if fam not in PERF_FAMILIES:
        raise ValueError(f"unknown perf-model family {fam!r}; known: {sorted(PERF_FAMILIES)}")
    return PERF_FAMILIES[fam].from_params(d["params"])


@dataclass
class EngineSpec:
    """One replica's preset (``<model>-<gpu>[-tp<N>]``).

    kv_capacity_tokens  KV-cache tokens that fit on the replica after weights and activations
    block_size          tokens per paged-KV block
    kv_bytes_per_token  bytes of KV per token (all layers, K and V) -- P/D transfer time and capacity math
    max_num_seqs / max_num_batched_tokens   the engine defaults schedulers start from (vLLM's knobs)
    provenance          where each number comes from (profile files, published figures, arithmetic)
    """

    name: str
    model: str
    gpu: str
    tp: int
    perf: PerfModel
    kv_capacity_tokens: int
    block_size: int = 16
    kv_bytes_per_token: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def batch_time(self, f: BatchFeatures) -> np.ndarray:
        return self.perf.batch_time(f)

    def batch_time_one(self, f: BatchFeatures) -> float:
        return self.perf.batch_time_one(f)

    def compiled_time(self) -> np.ndarray | None:
        """The perf model's coefficients for the compiled pilot (``slogym.core.pilot``), or None."""
        fn = getattr(self.perf, "compiled_time", None)
        cls = type(self)
        same = (cls.batch_time_one is EngineSpec.batch_time_one and cls.batch_time is EngineSpec.batch_time
                and type(self.perf).batch_time_one is PerfModel.batch_time_one)
        return fn() if fn is not None and same else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "model": self.model, "gpu": self.gpu, "tp": self.tp,
            "perf": self.perf.to_dict(), "kv_capacity_tokens": self.kv_capacity_tokens,
            "block_size": self.block_size, "kv_bytes_per_token": self.kv_bytes_per_token,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineSpec":
        d = dict(d)
        d["perf"] = perf_model_from_dict(d["perf"])
        return cls(**d)

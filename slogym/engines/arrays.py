"""Array backend of the vectorized batch-time evaluator: NumPy, or CuPy on a GPU.

``SLOGYM_ARRAY=numpy|cupy`` forces a backend; by default CuPy is used when it imports and sees a CUDA device,
NumPy otherwise (a clean fallback: no error when CuPy or the GPU is missing, unless CuPy is forced).
Perf models take the module as ``batch_time(features, x)``; their ops are element-wise ``+ - * /``, max/min and
lookups, each one kernel on the GPU, so results match NumPy (checked within 1e-12 relative by
``tests/test_arrays.py`` where a GPU exists).
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np

from slogym.core.batch import BatchFeatures


@lru_cache(maxsize=None)
def array_module(choice: str | None = None) -> ModuleType:
    """The backend module for ``choice`` (default: ``$SLOGYM_ARRAY``, else auto-detect)."""
    choice = (choice or os.environ.get("SLOGYM_ARRAY", "auto")).lower()
    if choice not in ("auto", "numpy", "cupy"):
        raise ValueError(f"SLOGYM_ARRAY={choice!r}; expected numpy, cupy or auto")
    if choice == "numpy":
        return np
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
        reason = "no CUDA device"
    except Exception as e:  # ImportError, or a CUDA driver/runtime error
        reason = f"{type(e).__name__}: {e}"
    if choice == "cupy":
        raise RuntimeError(f"SLOGYM_ARRAY=cupy but CuPy is unusable ({reason})")
    return np


class BatchTimeEvaluator:
    """Times many batches of one engine in a single vectorized call on the selected backend."""

    def __init__(self, engine: Any, backend: str | None = None) -> None:
        self.engine = engine
        self.xp = array_module(backend)

    @property
    def backend(self) -> str:
        return self.xp.__name__

    def __call__(self, f: BatchFeatures) -> np.ndarray:
        if self.xp is np:
            return np.asarray(self.engine.batch_time(f), dtype=np.float64)
        g = BatchFeatures(*(self.xp.asarray(np.asarray(a, dtype=np.int64)) for a in f))
        return self.xp.asnumpy(self.engine.perf.batch_time(g, self.xp))

"""Array backends of the batch-time evaluator: selection, NumPy path, NumPy == CuPy where a GPU exists."""

from __future__ import annotations

import numpy as np
import pytest

from slogym.core.batch import BatchFeatures
from slogym.engines import get_engine, list_engines
from slogym.engines.arrays import BatchTimeEvaluator, array_module


def test_numpy_backend_forced_and_bad_choice():
    assert array_module("numpy") is np
    with pytest.raises(ValueError, match="SLOGYM_ARRAY"):
        array_module("tpu")


def test_numpy_evaluator_equals_engine_batch_time():
    f = BatchFeatures.random(500)
    for name in list_engines():
        eng = get_engine(name)
        ev = BatchTimeEvaluator(eng, "numpy")
        assert ev.backend == "numpy"
        assert np.array_equal(ev(f), eng.batch_time(f))


def _cupy_or_skip():
    try:
        return array_module("cupy")
    except RuntimeError as e:
        pytest.skip(f"no usable GPU/CuPy here ({e}); the NumPy == CuPy check runs where one exists")


def test_cupy_matches_numpy_within_tolerance():
    _cupy_or_skip()
    f = BatchFeatures.random(10000, seed=3)
    for name in list_engines():
        eng = get_engine(name)
        np.testing.assert_allclose(BatchTimeEvaluator(eng, "cupy")(f), BatchTimeEvaluator(eng, "numpy")(f),
                                   rtol=1e-12, atol=0)

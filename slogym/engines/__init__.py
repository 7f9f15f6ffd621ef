"""Batch-time backends: perf-model families (+ fitting), engine presets, and later the live vLLM engine."""

from slogym.engines import perf_models as _families  # noqa: F401  (registers every PerfModel family)
from slogym.engines.base import PERF_FAMILIES, EngineSpec, PerfModel
from slogym.engines.registry import get_engine, list_engines

__all__ = ["PERF_FAMILIES", "EngineSpec", "PerfModel", "get_engine", "list_engines"]

"""Engine presets shipped as ``slogym/engines/presets/*.json`` (``EngineSpec.to_dict()`` + provenance)."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import slogym.engines.perf_models  # noqa: F401  (registers the perf-model families)
from slogym.engines.base import EngineSpec


@lru_cache(maxsize=None)
def _preset_dicts() -> dict[str, str]:
    root = resources.files("slogym.engines") / "presets"
    return {p.name[:-5]: p.read_text() for p in root.iterdir() if p.name.endswith(".json")}


def list_engines() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(_preset_dicts())


def get_engine(name: str) -> EngineSpec:
    """A shipped preset by name, or a preset JSON file by path (a fresh EngineSpec on every call)."""
    presets = _preset_dicts()
    if name in presets:
        d: dict[str, Any] = json.loads(presets[name])
    elif name.endswith(".json") and Path(name).is_file():
        d = json.loads(Path(name).read_text())
    else:
        raise ValueError(f"unknown engine {name!r}; known: {list_engines()} (or a path to a preset .json)")
    return EngineSpec.from_dict(d)

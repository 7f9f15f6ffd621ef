"""Shared fixtures: a small exact perf model so core tests do not depend on shipped presets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from slogym.core.batch import BatchFeatures

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

try:
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


@pytest.fixture(autouse=True, scope="session")
def _sb3_logdir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """SB3's default logger makes an empty ``SB3-<date>`` folder in the system temp dir per ``learn()``: keep them
    in pytest's own temp tree instead of littering /tmp."""
    os.environ.setdefault("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3")))


@dataclass
class ToyEngine:
    """time = a + b * tokens + c * context tokens (seconds); a tiny KV so memory pressure is reachable."""

    a: float = 0.005
    b: float = 0.0001
    c: float = 0.000001
    kv_capacity_tokens: int = 20000
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    name: str = "toy"

    @property
    def kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def batch_time(self, f: BatchFeatures) -> np.ndarray:
        return self.a + self.b * (f.prefill_tokens + f.decode_tokens) + self.c * (f.decode_ctx + f.prefill_attn)


@pytest.fixture
def toy_engine() -> ToyEngine:
    return ToyEngine()

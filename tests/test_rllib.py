"""RLlib trains PPO on Routing-v0 (runs only where ray[rllib] is installed; it pins its own Gymnasium)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.rllib", reason="RLlib is not importable (install the rllib extra: pip install -e '.[rllib]')")

ROOT = Path(__file__).resolve().parents[1]


def test_rllib_ppo_routing_trains_briefly_in_local_mode():
    spec = importlib.util.spec_from_file_location("rllib_ppo", ROOT / "agents" / "rllib_ppo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rllib_ppo"] = mod
    spec.loader.exec_module(mod)
    returns = mod.main(["--iterations", "1", "--env-runners", "0", "--train-batch", "256", "--minibatch", "64",
                        "--episode", "64", "--n-instances", "2"])
    assert len(returns) == 1

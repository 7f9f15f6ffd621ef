"""Learned agents: short PPO / MaskablePPO learning on every env, shipped checkpoints as Policies."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("sb3_contrib")
import torch  # noqa: E402
from gymnasium.wrappers import FlattenObservation  # noqa: E402
from sb3_contrib import MaskablePPO  # noqa: E402
from sb3_contrib.common.wrappers import ActionMasker  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402

import slogym  # noqa: E402,F401
from slogym import agents  # noqa: E402
from slogym.agents.evaluation import run_window, windows  # noqa: E402

torch.set_num_threads(1)
SMALL = {"scenario": "coder", "episode": 32, "pool_requests": 400, "seed": 0}


@pytest.mark.parametrize("env_id, kw", [
    ("slogym/Admission-v0", {"rate_scale": 2.0}),
    ("slogym/Routing-v0", {"rate_scale": 4.0, "n_instances": 4}),
    ("slogym/Batching-v0", {"rate_scale": 0.6, "K": 16}),
])
def test_short_learn(env_id: str, kw: dict) -> None:
    env = FlattenObservation(gym.make(env_id, split="train", **SMALL, **kw))
    if env_id == "slogym/Batching-v0":
        model = PPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=1, seed=0, device="cpu",
                    policy_kwargs={"net_arch": [16]})
    else:
        env = ActionMasker(env, lambda e: e.unwrapped.action_masks())
        model = MaskablePPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=1, seed=0, device="cpu",
                            policy_kwargs={"net_arch": [16]})
    model.learn(total_timesteps=256)
    assert model.num_timesteps >= 256


def test_available_and_unknown() -> None:
    names = agents.available()
    assert {"admission-coder", "routing-coder-4x", "batching-coder"} <= set(names)
    with pytest.raises(ValueError, match="available: .*admission-coder"):
        agents.load("no-such-agent")


@pytest.mark.parametrize("name", ["admission-coder", "routing-coder-4x", "batching-coder"])
def test_shipped_agent_runs_on_a_test_window(name: str) -> None:
    meta = agents.read_metadata(name)
    env, wins = windows(meta["env_id"], meta["env_kwargs"] | {"split": "test", "episode": 48}, [0])
    res = run_window(agents.load(name), wins[0], env)
    assert 0.0 <= res["attainment"] <= 1.0 and np.isfinite(res["reward"])


def test_policy_matches_env_episode() -> None:
    """The agent as a Policy in the Simulator earns exactly the return of stepping its env with the model."""
    meta = agents.read_metadata("admission-coder")
    kw = meta["env_kwargs"] | {"split": "test", "episode": 64}
    env, wins = windows(meta["env_id"], kw, [3])
    policy = agents.load("admission-coder")
    model = MaskablePPO.load(agents.checkpoint_dir() / "admission-coder.zip", device="cpu")
    act = agents.model_actor(model, env)
    obs, _ = env.reset(seed=3)
    total, done = 0.0, False
    while not done:
        obs, r, done, _, _ = env.step(act(obs))
        total += r
    assert run_window(policy, wins[0], env)["reward"] == pytest.approx(total)

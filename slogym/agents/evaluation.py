"""Evaluating policies on an environment's episode windows through the plain ``Simulator`` (the way users run
them): the same windows and simulator seeds as ``env.reset(seed=s)``, every contender on each.
"""

from __future__ import annotations

from typing import Any, Callable

import gymnasium as gym
import numpy as np

from slogym.core.metrics import service_gain, slo_verdicts
from slogym.core.policy import Policy
from slogym.core.request import Workload
from slogym.core.simulator import Simulator

Window = tuple[Workload, int]
"""An episode's workload and simulator seed."""


def windows(env_id: str, env_kwargs: dict[str, Any], seeds: list[int]) -> tuple[Any, list[Window]]:
    """The environment (unwrapped) and the window ``env.reset(seed=s)`` plays, for each seed."""
    env = gym.make(env_id, **env_kwargs).unwrapped
    out = []
    for s in seeds:
        env.reset(seed=int(s))
        out.append((env.sim.w, int(env.sim.seed)))
    return env, out


def episode_reward(sim: Simulator, reward: str) -> float:
    """The episode return the environment's ``reward`` would have credited for this finished run."""
    if reward == "service_gain":
        return float(service_gain(sim).sum()) / 1000.0
    met = float(slo_verdicts(sim)[sim.attainment].sum())
    return met / len(sim.w) if reward == "attainment" else met


def run_window(policy: Policy, window: Window, env: Any) -> dict[str, float]:
    """Run ``policy`` on one window with the environment's engine, cluster (size, P/D split, KV link) and
    attainment mode."""
    w, seed = window
    sim = Simulator(w, env.engine, policy, env.n_instances, seed=seed, attainment=env.attainment, pd=env.pd,
                    transfer=env.transfer).run()
    s = sim.result().summary
    return {"reward": episode_reward(sim, env.reward_name), "attainment": float(s["attainment"]),
            "goodput": float(s["goodput"])}


def evaluate(make: Callable[[int], Policy], env: Any, wins: list[Window]) -> dict[str, float]:
    """Mean and standard deviation over ``wins`` of a fresh ``make(i)`` policy per window ``i``."""
    rows = [run_window(make(i), win, env) for i, win in enumerate(wins)]
    out: dict[str, float] = {}
    for k in rows[0]:
        v = np.array([r[k] for r in rows])
        out[k], out[f"{k}_std"] = float(v.mean()), float(v.std())
    return out

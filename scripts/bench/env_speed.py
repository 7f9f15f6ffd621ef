"""Environment steps per wall second: each env with a random policy and with its baseline (expert) policy,
as a single env and as the native batched vector env (N = 16, 64). Run on one core:

    taskset -c 0 .venv/bin/python scripts/bench/env_speed.py [--steps 2000] [--scenario chatbot]
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

import slogym  # noqa: F401  (registers the envs)

ENVS = {"slogym/Admission-v0": {}, "slogym/Routing-v0": {"n_instances": 4, "policy": "round-robin"},
        "slogym/Batching-v0": {}}


def single(env_id: str, kw: dict, steps: int, expert: bool) -> float:
    env = gym.make(env_id, **kw).unwrapped
    env.reset(seed=0)
    t0 = time.perf_counter()
    for _ in range(steps):
        a = env.expert_action() if expert else env.action_space.sample()
        _, _, done, _, _ = env.step(a)
        if done:
            env.reset()
    return steps / (time.perf_counter() - t0)


def vector(env_id: str, kw: dict, steps: int, n: int) -> float:
    venv = gym.make_vec(env_id, num_envs=n, vectorization_mode="vector_entry_point", **kw)
    venv.reset(seed=0)
    rounds = max(steps // n, 1)
    t0 = time.perf_counter()
    for _ in range(rounds):
        venv.step(venv.action_space.sample())
    return rounds * n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--scenario", default="chatbot")
    a = ap.parse_args()
    print(f"{'env':22s} {'random':>9s} {'baseline':>9s} {'vec N=16':>9s} {'vec N=64':>9s}   (steps/s)")
    for env_id, extra in ENVS.items():
        kw = dict(scenario=a.scenario, episode=512, seed=0, **extra)
        row = [single(env_id, kw, a.steps, False), single(env_id, kw, a.steps, True),
               vector(env_id, kw, a.steps, 16), vector(env_id, kw, a.steps, 64)]
        print(f"{env_id:22s} " + " ".join(f"{v:9.0f}" for v in row))


if __name__ == "__main__":
    main()

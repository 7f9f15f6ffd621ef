"""Gymnasium environments (registered on ``import slogym``; also ``gym.make("slogym:slogym/Admission-v0")``)."""

from __future__ import annotations

import gymnasium as gym

ENV_IDS = {
    "slogym/Admission-v0": "slogym.envs.arrival:AdmissionEnv",
    "slogym/Routing-v0": "slogym.envs.arrival:RoutingEnv",
    "slogym/Batching-v0": "slogym.envs.batching:BatchingEnv",
}


def register_envs() -> None:
    for env_id, entry in ENV_IDS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry, disable_env_checker=True)

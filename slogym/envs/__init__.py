"""Gymnasium environments (registered on ``import slogym``; also ``gym.make("slogym:slogym/Admission-v0")``).

``gym.make_vec(id, num_envs=N, vectorization_mode="vector_entry_point", ...)`` gives the native batched
vector env (:class:`slogym.envs.vector.SlogymVectorEnv`); ``"sync"`` / ``"async"`` give Gymnasium's own.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import gymnasium as gym

ENV_IDS = {
    "slogym/Admission-v0": "slogym.envs.arrival:AdmissionEnv",
    "slogym/Routing-v0": "slogym.envs.arrival:RoutingEnv",
    "slogym/Batching-v0": "slogym.envs.batching:BatchingEnv",
    "slogym/Scaling-v0": "slogym.envs.scaling:ScalingEnv",
}


def _vector(env_id: str, num_envs: int = 1, **kwargs: Any) -> gym.vector.VectorEnv:
    from slogym.envs.vector import SlogymVectorEnv

    return SlogymVectorEnv(env_id, num_envs, **kwargs)


def make_flat_env(env_id: str, config: dict[str, Any] | None = None) -> gym.Env:
    """``env_id`` with a flattened ``Box`` observation: the factory for SB3 or RLlib env runners
    (``partial(make_flat_env, "slogym/Routing-v0")`` pickles by reference). An RLlib ``EnvContext``'s
    ``worker_index`` offsets the seed so runners draw different episodes."""
    cfg = dict(config or {})
    cfg["seed"] = int(cfg.get("seed") or 0) + 1000 * int(getattr(config, "worker_index", 0))
    return gym.wrappers.FlattenObservation(gym.make(env_id, **cfg))


def register_envs() -> None:
    for env_id, entry in ENV_IDS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry, vector_entry_point=partial(_vector, env_id),
                         disable_env_checker=True)

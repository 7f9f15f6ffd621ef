"""Native batched vector env: N simulators stepped in lockstep, their iteration times evaluated together.

``gym.make_vec("slogym/Batching-v0", num_envs=64, vectorization_mode="vector_entry_point", **kwargs)`` (or
``SlogymVectorEnv("slogym/Batching-v0", 64, **kwargs)``) runs N copies of one environment. Each copy's
simulator defers the timing of every iteration it starts; the vector env gathers the pending batches of all
copies and evaluates them in one call of the vectorized perf model (NumPy, or CuPy on a GPU: see
``slogym.engines.arrays``), then hands
each copy its time back. Results are identical to N independent environments: the vectorized and the
single-batch perf-model paths give the same bits. Sub-environment ``i`` is seeded ``seed + i``; autoreset
follows Gymnasium's next-step convention.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

from slogym.core.batch import BatchFeatures
from slogym.engines.arrays import BatchTimeEvaluator
from slogym.envs.base import ServingEnv


class SlogymVectorEnv(VectorEnv):
    def __init__(self, env_id: str, num_envs: int, **kwargs: Any) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs}; must be >= 1")
        self.envs: list[ServingEnv] = [gym.make(env_id, **kwargs).unwrapped for _ in range(num_envs)]
        self.num_envs = num_envs
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.metadata = dict(self.envs[0].metadata, autoreset_mode=AutoresetMode.NEXT_STEP)
        self.render_mode = None
        self._needs_reset = np.zeros(num_envs, dtype=bool)
        self._obs = create_empty_array(self.single_observation_space, num_envs)
        self._evaluators: dict[int, BatchTimeEvaluator] = {}

    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        seeds = seed if isinstance(seed, list) else [None if seed is None else seed + i for i in range(self.num_envs)]
        results = self._lockstep([env._reset_steps(s, defer_timing=True) for env, s in zip(self.envs, seeds)])
        self._needs_reset[:] = False
        infos: dict[str, Any] = {}
        for i, (_, info) in enumerate(results):
            infos = self._add_info(infos, info, i)
        obs = concatenate(self.single_observation_space, [o for o, _ in results], self._obs)
        return obs, infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        steppers = [
            env._reset_steps(None, defer_timing=True) if self._needs_reset[i] else env._step_steps(actions[i])
            for i, env in enumerate(self.envs)
        ]
        was_reset = self._needs_reset.copy()
        results = self._lockstep(steppers)
        obs_list, infos = [], {}
        rewards = np.zeros(self.num_envs)
        terms = np.zeros(self.num_envs, dtype=bool)
        truncs = np.zeros(self.num_envs, dtype=bool)
        for i, res in enumerate(results):
            if was_reset[i]:
                obs, info = res
            else:
                obs, rewards[i], terms[i], truncs[i], info = res
            obs_list.append(obs)
            infos = self._add_info(infos, info, i)
        self._needs_reset = terms | truncs
        obs = concatenate(self.single_observation_space, obs_list, self._obs)
        return obs, rewards, terms, truncs, infos

    def _lockstep(self, steppers: list[Generator[tuple, float, Any]]) -> list[Any]:
        """Run every stepper to its end; their deferred iteration timings are answered in batched calls."""
        results: list[Any] = [None] * len(steppers)
        pending: dict[int, tuple] = {}

        def resume(i: int, value: float | None) -> None:
            try:
                pending[i] = next(steppers[i]) if value is None else steppers[i].send(value)
            except StopIteration as stop:
                results[i] = stop.value
                pending.pop(i, None)

        for i in range(len(steppers)):
            resume(i, None)
        while pending:
            by_engine: dict[int, list[int]] = {}
            for i, (_, inst, _) in pending.items():
                by_engine.setdefault(id(inst.engine), []).append(i)
            answers: dict[int, float] = {}
            for ids in by_engine.values():
                engine = pending[ids[0]][1].engine
                ev = self._evaluators.get(id(engine)) or self._evaluators.setdefault(id(engine),
                                                                                      BatchTimeEvaluator(engine))
                cols = np.array([tuple(pending[i][2]) for i in ids], dtype=np.int64).T
                times = ev(BatchFeatures(*cols))
                answers.update(zip(ids, times.tolist()))
            for i, dt in answers.items():
                resume(i, dt)
        return results

    def close_extras(self, **kwargs: Any) -> None:
        for env in self.envs:
            env.close()

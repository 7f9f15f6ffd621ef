"""Native batched vector env: N simulators stepped in lockstep, their iteration times evaluated together.

``gym.make_vec("slogym/Batching-v0", num_envs=64, vectorization_mode="vector_entry_point", **kwargs)`` (or
``SlogymVectorEnv("slogym/Batching-v0", 64, **kwargs)``) runs N copies of one environment. Unless the engine's
perf model has a compiled form (then each copy times its own iterations, cheaper than any round trip), each
copy's simulator defers the timing of every iteration it starts; the vector env gathers the pending batches of
all copies and evaluates them in one call of the vectorized perf model (NumPy, or CuPy on a GPU: see
``slogym.engines.arrays``), then hands each copy its time back. Admission-v0 / Routing-v0 copies write their
observations straight into the batch buffers. Results are identical to N independent environments: the
vectorized, single-batch and compiled perf-model paths give the same bits. Sub-environment ``i`` is seeded
``seed + i``; autoreset follows Gymnasium's next-step convention.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

from slogym.core.batch import BatchFeatures
from slogym.engines.arrays import BatchTimeEvaluator
from slogym.envs.arrival import ArrivalEnv
from slogym.envs.base import ServingEnv


class SlogymVectorEnv(VectorEnv):
    """``batch_timing``: defer the iterations' timing to one batched call per round (``True``), or only for
    engines whose perf model has no compiled form (``None``, default): a compiled one times an iteration in
    far less than a round trip through :meth:`_lockstep` costs, with the same bits."""

    def __init__(self, env_id: str, num_envs: int, batch_timing: bool | None = None, **kwargs: Any) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs}; must be >= 1")
        self.envs: list[ServingEnv] = [gym.make(env_id, **kwargs).unwrapped for _ in range(num_envs)]
        self._defer = [bool(batch_timing) or batch_timing is None and not _compiled(env.engine) for env in self.envs]
        self.num_envs = num_envs
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.metadata = dict(self.envs[0].metadata, autoreset_mode=AutoresetMode.NEXT_STEP)
        self.render_mode = None
        self._needs_reset = np.zeros(num_envs, dtype=bool)
        self._obs = create_empty_array(self.single_observation_space, num_envs)
        self._rows: list[dict[str, np.ndarray] | None] = [None] * num_envs
        if isinstance(self.envs[0], ArrivalEnv):  # they write their observations into the batch buffers
            for i, env in enumerate(self.envs):
                env.obs_rows = self._rows[i] = {key: buf[i] for key, buf in self._obs.items()}
        self._evaluators: dict[str, BatchTimeEvaluator] = {}  # one per distinct engine (see _engine_key)
        self._engine_keys: dict[int, tuple[Any, str]] = {}

    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        seeds = seed if isinstance(seed, list) else [None if seed is None else seed + i for i in range(self.num_envs)]
        results = self._lockstep([env._reset_steps(s, defer_timing=d) for env, s, d in zip(self.envs, seeds,
                                                                                             self._defer)])
        self._needs_reset[:] = False
        return self._batch_obs([o for o, _ in results]), self._batch_infos([info for _, info in results])

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if len(actions) != self.num_envs:
            raise ValueError(f"step() got {len(actions)} actions for {self.num_envs} environments "
                             f"(expected a batch in {self.action_space})")
        steppers = [
            env._reset_steps(None, defer_timing=self._defer[i]) if self._needs_reset[i] else env._step_steps(actions[i])
            for i, env in enumerate(self.envs)
        ]
        was_reset = self._needs_reset.tolist()
        results = self._lockstep(steppers)
        obs_list, info_list = [], []
        rewards = np.zeros(self.num_envs)
        terms = np.zeros(self.num_envs, dtype=bool)
        truncs = np.zeros(self.num_envs, dtype=bool)
        for i, res in enumerate(results):
            if was_reset[i]:
                obs, info = res
            else:
                obs, rewards[i], terms[i], truncs[i], info = res
            obs_list.append(obs)
            info_list.append(info)
        self._needs_reset = terms | truncs
        return self._batch_obs(obs_list), rewards, terms, truncs, self._batch_infos(info_list)

    def _batch_obs(self, obs: list[Any]) -> Any:
        """The sub-environments' observations stacked into the batch buffers (reused from step to step, as
        Gymnasium's ``concatenate`` does; for ``Dict`` spaces one copy per key, none for an observation already
        written in place)."""
        if isinstance(self._obs, dict):
            copy = [i for i, o in enumerate(obs) if o is not self._rows[i]]
            for key, buf in self._obs.items():
                if len(copy) == len(obs):
                    buf[...] = [o[key] for o in obs]
                else:
                    for i in copy:
                        buf[i] = obs[i][key]
            return self._obs
        return concatenate(self.single_observation_space, obs, self._obs)

    def _batch_infos(self, infos: list[dict[str, Any]]) -> dict[str, Any]:
        """Gymnasium's vector info layout (``key`` -> array over envs, ``_key`` -> which envs have it), as
        ``VectorEnv._add_info`` env by env would build it: the scalar keys every env reports (the per-step info)
        in one array each, the rest (the terminal ``summary``) through ``_add_info``."""
        out: dict[str, Any] = {}
        shared = []
        for key, v in infos[0].items():
            kind = type(v)
            values = [info.get(key) for info in infos]
            if (kind in (int, float, bool) or isinstance(v, np.number)) and set(map(type, values)) == {kind}:
                out[key] = np.array(values, dtype=kind)
                out[f"_{key}"] = np.ones(self.num_envs, dtype=np.bool_)
                shared.append(key)
        for i, info in enumerate(infos):
            if len(info) > len(shared):
                out = self._add_info(out, {k: v for k, v in info.items() if k not in shared}, i)
        return out

    def _engine_key(self, engine: Any) -> str:
        """Engines that time batches identically share a key, so the iterations of all sub-environments
        (each builds its own engine object from the same preset) are timed in one call."""
        seen = self._engine_keys.get(id(engine))
        if seen is None:
            spec = getattr(engine, "to_dict", None)  # an engine object without one is only equal to itself
            # the perf model's class too: a subclass may time batches from state its params() leave out
            perf = type(getattr(engine, "perf", None))
            key = (json.dumps(spec(), sort_keys=True, default=repr) + f" {perf.__module__}.{perf.__qualname__}"
                   if spec else f"object {id(engine)}")
            self._evaluators.setdefault(key, BatchTimeEvaluator(engine))
            seen = self._engine_keys[id(engine)] = (engine, key)  # holding the engine keeps its id unique
        return seen[1]

    def _lockstep(self, steppers: list[Generator[tuple, float, Any]]) -> list[Any]:
        """Run every stepper to its end; their deferred iteration timings are answered in batched calls (one
        per engine)."""
        results: list[Any] = [None] * len(steppers)
        asks: dict[int, tuple] = {}  # stepper -> its pending ("time", instance, features)
        keys = self._engine_keys
        for i, st in enumerate(steppers):
            try:
                asks[i] = next(st)
            except StopIteration as stop:
                results[i] = stop.value
        while asks:
            by_engine: dict[str, list[int]] = {}
            for i, (_, inst, _) in asks.items():
                seen = keys.get(id(inst.engine))
                by_engine.setdefault(seen[1] if seen else self._engine_key(inst.engine), []).append(i)
            for key, ids in by_engine.items():
                ev = self._evaluators[key]
                # plain tuples: BatchFeatures.__len__ counts batches, not fields
                cols = np.array([tuple(asks[i][2]) for i in ids], dtype=np.int64).T
                for i, dt in zip(ids, ev(BatchFeatures(*cols)).tolist()):
                    try:
                        asks[i] = steppers[i].send(dt)
                    except StopIteration as stop:
                        results[i] = stop.value
                        del asks[i]
        return results

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` of every sub-environment (e.g. ``"action_masks"``, ``"expert_action"``) or read
        attribute ``name`` of each if it is not callable; as ``SyncVectorEnv.call``."""
        out = []
        for env in self.envs:
            attr = getattr(env, name)
            out.append(attr(*args, **kwargs) if callable(attr) else attr)
        return tuple(out)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every sub-environment."""
        return tuple(getattr(env, name) for env in self.envs)

    def close_extras(self, **kwargs: Any) -> None:
        for env in self.envs:
            env.close()


def _compiled(engine: Any) -> bool:
    """Does ``engine``'s perf model have a compiled form (``EngineSpec.compiled_time``, what the simulator's
    pilot and the env's observation kernel time iterations with)?"""
    compiled = getattr(engine, "compiled_time", None)
    return compiled is not None and compiled() is not None

"""Learned agents shipped with slogym, served as ordinary :class:`~slogym.core.policy.Policy` objects.

``available()`` lists the shipped agents; ``load(name)`` returns a Policy usable by ``Simulator(...)`` exactly
like a baseline. An agent makes the decision of the environment it was trained on (admission or routing:
its ``Router``; batching: its ``Scheduler``); every other decision is made by the baseline named in the
environment's ``policy=`` at training time. Actions are deterministic (argmax / Gaussian mean).

A checkpoint is ``agents/checkpoints/<name>.zip`` (Stable-Baselines3) with ``<name>.json`` beside it: the
environment id and keyword arguments, algorithm, training seed, steps, wall time and evaluation results
(written by ``agents/train.py``). Checkpoints are read from the repository (works from a source checkout or an
editable install); ``SLOGYM_AGENTS_DIR`` points elsewhere.

How a trained model runs outside its environment: the agent keeps a private instance of that environment,
``attach``-es it to the simulator on ``reset`` and builds each decision's observation with ``observe``, so
features are computed by the same code as in training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from slogym.baselines import make_policy
from slogym.core.policy import BEST_EFFORT, REJECT, Policy, Router, Scheduler
from slogym.envs.arrival import AdmissionEnv

if TYPE_CHECKING:
    from slogym.core.batch import Batch
    from slogym.core.instance import Instance
    from slogym.core.simulator import Simulator
    from slogym.envs.base import ServingEnv

__all__ = ["available", "load", "checkpoint_dir", "read_metadata", "env_policy", "model_actor", "uniform_actor",
           "Actor"]

Actor = Callable[[Any], Any]
"""Maps the attached environment's observation (its ``Dict``) to an action of its action space."""


def checkpoint_dir() -> Path:
    """Where shipped checkpoints live: ``$SLOGYM_AGENTS_DIR`` or the repository's ``agents/checkpoints``."""
    env = os.environ.get("SLOGYM_AGENTS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "agents" / "checkpoints"


def available() -> list[str]:
    """Names of the shipped agents (each a ``<name>.zip`` with its ``<name>.json``)."""
    d = checkpoint_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.json") if p.with_suffix(".zip").is_file())


def read_metadata(name: str) -> dict[str, Any]:
    """The metadata of agent ``name``; ValueError listing the shipped names if there is no such agent."""
    names = available()
    if name not in names:
        shipped = ", ".join(names) or f"none (no checkpoints in {checkpoint_dir()})"
        raise ValueError(f"unknown agent {name!r}; available: {shipped}")
    return json.loads((checkpoint_dir() / f"{name}.json").read_text())


class EnvRouter(Router):
    """A Router that takes each arrival decision from ``act`` on an Admission-v0 / Routing-v0 observation.

    ``base`` is the router of the environment's ``policy``: it places admitted requests (Admission-v0) and
    picks where best-effort requests run.
    """

    def __init__(self, env: "ServingEnv", act: Actor, base: Router) -> None:
        self.env, self.act, self.base = env, act, base
        self._admission = isinstance(env, AdmissionEnv)

    def reset(self, sim: "Simulator") -> None:
        _check_compatible(self.env, sim)
        self.base.reset(sim)
        self.env.attach(sim)

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        a = int(self.act(self.env.observe(("route", req, now))))
        if not self._admission:
            return int(self.env._to_sim_action(a))
        # Admission-v0's own mapping asks sim.policy.router -- this router -- for the placement, so map here
        if not self.env.action_masks()[a]:
            raise ValueError(f"agent chose masked admission action {a} for request {req}")
        if a == self.env.REJECT:
            return REJECT
        if a == self.env.BEST_EFFORT:
            return BEST_EFFORT
        placed = int(self.base.route(req, sim, now))
        return placed if placed >= 0 else int(self.base.best_effort_instance(req, sim, now))

    def best_effort_instance(self, req: int, sim: "Simulator", now: float) -> int:
        return self.base.best_effort_instance(req, sim, now)


class EnvScheduler(Scheduler):
    """A Scheduler that forms each batch from ``act`` on a Batching-v0 observation (the env's score rule).
    Every iteration asks ``act`` (the env's ``quantum`` reuse of scores applies only inside the env)."""

    def __init__(self, env: "ServingEnv", act: Actor) -> None:
        self.env, self.act = env, act

    def reset(self, sim: "Simulator") -> None:
        _check_compatible(self.env, sim)
        self.env.attach(sim)

    def next_batch(self, inst: "Instance", now: float) -> "Batch | None":
        return self.env._to_sim_action(self.act(self.env.observe(("schedule", inst, now))))


def _check_compatible(env: "ServingEnv", sim: "Simulator") -> None:
    got = (len(sim.instances), len(sim.w.app_names), len(sim.w.tier_names))
    want = (env.n_instances, env.n_apps, env.n_tiers)
    if got != want:
        raise ValueError(f"agent trained on {env.scenario!r} with (instances, apps, tiers) = {want}; this "
                         f"simulator has {got}: its observations would not match")


def env_policy(name: str, env: "ServingEnv", act: Actor) -> Policy:
    """A Policy whose ``env.decision`` comes from ``act`` and whose other decisions come from the env's
    ``policy`` baseline (a fresh instance of it)."""
    if hasattr(env, "agent_policy"):  # an env whose decision is neither route nor schedule (Scaling-v0)
        return env.agent_policy(name, act)
    base = make_policy(env.policy_name, env.engine)
    params = {"agent": name, "decision": env.decision, "base_policy": env.policy_name}
    if env.decision == "route":
        return Policy(name=name, scheduler=base.scheduler, router=EnvRouter(env, act, base.router), params=params)
    return Policy(name=name, scheduler=EnvScheduler(env, act), router=base.router, params=params)


def model_actor(model: Any, env: "ServingEnv") -> Actor:
    """Deterministic actions of an SB3 model trained on ``FlattenObservation(env)`` (masked if it is a
    MaskablePPO model)."""
    masked = type(model).__name__ == "MaskablePPO"

    def act(obs: Any) -> Any:
        flat = spaces.flatten(env.observation_space, obs)
        kw = {"action_masks": env.action_masks()} if masked else {}
        action, _ = model.predict(flat, deterministic=True, **kw)
        return action

    return act


def load(name: str) -> Policy:
    """The shipped agent ``name`` as a Policy (see the module docstring). Requires the ``rl`` extra."""
    meta = read_metadata(name)
    import torch

    torch.set_num_threads(1)
    from sb3_contrib import MaskablePPO
    from stable_baselines3 import PPO

    algo = {"PPO": PPO, "MaskablePPO": MaskablePPO}[meta["algo"]]
    model = algo.load(checkpoint_dir() / f"{name}.zip", device="cpu")
    env = gym.make(meta["env_id"], **meta["env_kwargs"]).unwrapped
    flat_shape = (spaces.flatdim(env.observation_space),)
    if model.observation_space.shape != flat_shape:
        raise ValueError(f"checkpoint {name!r} expects observations of shape {model.observation_space.shape}; "
                         f"{meta['env_id']} with its recorded kwargs gives {flat_shape}")
    return env_policy(name, env, model_actor(model, env))


def uniform_actor(env: "ServingEnv", seed: int) -> Actor:
    """Uniformly random valid actions (masked choice for discrete envs, uniform box for Batching-v0)."""
    rng = np.random.default_rng(seed)
    if isinstance(env.action_space, spaces.Discrete):
        return lambda obs: int(rng.choice(np.flatnonzero(env.action_masks())))
    lo, hi = env.action_space.low, env.action_space.high
    return lambda obs: rng.uniform(lo, hi).astype(np.float32)

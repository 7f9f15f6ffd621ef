"""Environment steps per second: each env with a random policy and with its baseline (expert) policy, as a
single env and as the native batched vector env (N = 16, 64) with random actions; plus the reference the env
cannot beat, measured in the same run: the simulator alone, built for each of the env's episodes, paused at every
decision of the env's kind and answered by the baseline policy directly (no observation, action decoding or
reward). Run on one core:

    taskset -c 0 .venv/bin/python scripts/bench/env_speed.py [--steps 2000] [--scenario chatbot] [--clock cpu]
        [--env ID]

Each figure is the fastest of ``--repeat`` runs (default 3). ``--clock cpu`` (default) times process CPU
seconds, which a shared machine disturbs far less than wall seconds; ``--clock wall`` times wall seconds.
``baseline/sim`` is baseline / simulator-alone, the fraction of the attainable speed the env keeps, and
``env us/step`` the env's own cost per step, 1/baseline - 1/(simulator alone), in microseconds (observation,
action checks, reward credit, info, and per episode the window's extraction and the terminal summary).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym

import slogym  # noqa: F401  (registers the envs)
from slogym.baselines import make_policy
from slogym.core.simulator import Simulator

ENVS = {"slogym/Admission-v0": {}, "slogym/Routing-v0": {"n_instances": 4, "policy": "round-robin"},
        "slogym/Batching-v0": {}}
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _fastest(env: Any, clock: Callable[[], float], repeat: int, run: Callable[[], int]) -> float:
    """Steps per clock second of ``run`` (it returns the steps it took) from ``reset(seed=0)``, fastest of
    ``repeat`` (the slower runs measure interference)."""
    rates = []
    for _ in range(repeat):
        env.reset(seed=0)
        env.action_space.seed(0)
        t0 = clock()
        n = run()
        rates.append(n / (clock() - t0))
    return max(rates)


def single(env_id: str, kw: dict, steps: int, expert: bool, clock: Callable[[], float], repeat: int) -> float:
    env = gym.make(env_id, **kw).unwrapped

    def run() -> int:
        for _ in range(steps):
            a = env.expert_action() if expert else env.action_space.sample()
            _, _, done, _, _ = env.step(a)
            if done:
                env.reset()
        return steps

    return _fastest(env, clock, repeat, run)


def vector(env_id: str, kw: dict, steps: int, n: int, clock: Callable[[], float], repeat: int) -> float:
    venv = gym.make_vec(env_id, num_envs=n, vectorization_mode="vector_entry_point", **kw)
    rounds = max(steps // n, 1)

    def run() -> int:
        for _ in range(rounds):
            venv.step(venv.action_space.sample())
        return rounds * n

    return _fastest(venv, clock, repeat, run)


def simulator_alone(env_id: str, kw: dict, steps: int, clock: Callable[[], float], repeat: int) -> float:
    """``steps`` decisions of the env's kind on the episodes (windows, simulator seeds) the env plays after
    ``reset(seed=0)``, each answered by the baseline policy straight from the paused simulator."""
    env = gym.make(env_id, **kw).unwrapped
    rates = []
    for _ in range(repeat):
        env.reset(seed=0)
        n, elapsed = 0, 0.0
        while n < steps:
            t0 = clock()  # building the episode's simulator is part of the reference: every env pays for it
            pol = make_policy(env.policy_name, env.engine)
            sim = Simulator(env.sim.w, env.engine, pol, env.n_instances, seed=env.sim.seed,
                            attainment=env.attainment, pd=env.pd)
            env._configure(sim)
            route = env.decision == "route"
            decisions = sim.decisions()
            try:
                msg = next(decisions)
                while n < steps:
                    n += 1
                    msg = decisions.send(pol.router.route(msg[1], sim, msg[2]) if route
                                         else pol.scheduler.next_batch(msg[1], msg[2]))
            except StopIteration:
                pass
            elapsed += clock() - t0
            env.reset()  # the env's next episode
        rates.append(steps / elapsed)
    return max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--scenario", default="chatbot")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    ap.add_argument("--env", action="append", choices=sorted(ENVS), help="only these envs (repeatable)")
    a = ap.parse_args()
    clock = CLOCKS[a.clock]
    print(f"steps per {a.clock} second, fastest of {a.repeat}")
    print(f"{'env':22s} {'random':>9s} {'baseline':>9s} {'vec N=16':>9s} {'vec N=64':>9s} {'sim alone':>9s} "
          f"{'baseline/sim':>12s} {'env us/step':>11s}")
    for env_id, extra in ENVS.items():
        if a.env and env_id not in a.env:
            continue
        kw = dict(scenario=a.scenario, episode=512, seed=0, **extra)
        row = [single(env_id, kw, a.steps, False, clock, a.repeat), single(env_id, kw, a.steps, True, clock, a.repeat),
               vector(env_id, kw, a.steps, 16, clock, a.repeat), vector(env_id, kw, a.steps, 64, clock, a.repeat),
               simulator_alone(env_id, kw, a.steps, clock, a.repeat)]
        print(f"{env_id:22s} " + " ".join(f"{v:9.0f}" for v in row)
              + f" {row[1] / row[4]:12.2f} {1e6 / row[1] - 1e6 / row[4]:11.1f}")


if __name__ == "__main__":
    main()

"""PPO on slogym/Routing-v0 with Ray RLlib, for users who outgrow one machine.

The environments need nothing RLlib-specific: each env runner builds its own copy from ``env_config`` with
``slogym.envs.make_flat_env`` (flattened observations; the seed is offset per runner). ``--env-runners 0``
samples in the driver process (local mode). On a laptop:

    python agents/rllib_ppo.py --iterations 5 --env-runners 2
    python agents/rllib_ppo.py --address auto ...     # on a running Ray cluster

Install with ``pip install -e ".[rllib]"`` (``make test`` does): ray plus the modules RLlib imports.
``ray[rllib]`` itself would pin an older Gymnasium than slogym's.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any


def build(env_config: dict[str, Any], env_runners: int, train_batch: int, minibatch: int) -> Any:
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.tune.registry import register_env

    from slogym.envs import make_flat_env

    register_env("slogym-routing", partial(make_flat_env, "slogym/Routing-v0"))
    config = (
        PPOConfig()
        .environment("slogym-routing", env_config=env_config)
        .framework("torch")
        .env_runners(num_env_runners=env_runners, rollout_fragment_length="auto")
        .training(train_batch_size=train_batch, minibatch_size=minibatch, num_epochs=4, lr=3e-4)
        .debugging(seed=0)
    )
    return config.build_algo()


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--env-runners", type=int, default=2)
    ap.add_argument("--train-batch", type=int, default=1024)
    ap.add_argument("--minibatch", type=int, default=128)
    ap.add_argument("--n-instances", type=int, default=4)
    ap.add_argument("--scenario", default="chatbot")
    ap.add_argument("--episode", type=int, default=256)
    ap.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    ap.add_argument("--num-cpus", type=int, default=2)
    a = ap.parse_args(argv)

    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(address=a.address, num_cpus=None if a.address else a.num_cpus, include_dashboard=False,
             ignore_reinit_error=True)
    env_config = {"scenario": a.scenario, "n_instances": a.n_instances, "policy": "round-robin",
                  "episode": a.episode, "split": "train", "seed": 0}
    algo = build(env_config, a.env_runners, a.train_batch, a.minibatch)
    returns = []
    for i in range(a.iterations):
        result = algo.train()
        ret = result.get("env_runners", {}).get("episode_return_mean", float("nan"))
        steps = result.get("num_env_steps_sampled_lifetime", 0)
        print(f"iteration {i + 1}: env steps {steps}, mean episode return {ret:.2f}")
        returns.append(float(ret))
    algo.stop()
    return returns


if __name__ == "__main__":
    main()

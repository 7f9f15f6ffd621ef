"""Each shipped agent vs random, the naive baseline and the best available baselines on held-out windows.

    python scripts/eval_agents.py                         # every shipped agent, test seeds 0-7
    python scripts/eval_agents.py --agents batching-coder --seeds 0 1 2

Every contender runs through the plain ``Simulator`` on the same ``split="test"`` windows (those
``env.reset(seed=s)`` plays, never seen in training) with the environment's engine and cluster; the decisions
the agent does not make are taken by the same baseline for every contender. Prints a Markdown table per agent:
mean (std) episode reward in the env's reward, SLO attainment and goodput (SLO-meeting requests/s), and each
contender's wins-losses-ties against the naive baseline, paired by window on the episode reward.
Routing agents are also compared with PolyServe's co-located policy (``polyserve-co``): a whole policy with its
own tiered scheduler, token budget and admission, not only a router (its router reads state that its own
scheduler maintains, so it cannot be paired with the env's scheduler).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

import slogym  # noqa: F401  (registers the environments)
from slogym.agents import available, env_policy, load, read_metadata, uniform_actor
from slogym.agents.evaluation import run_window, windows
from slogym.baselines import make_policy
from slogym.core.policy import Policy

Contender = tuple[str, Callable[[Any, int], Policy]]


def baselines(env: Any) -> list[Contender]:
    """(label, policy factory) of the baselines making the agent's decision; the naive one first."""
    if env.decision == "schedule":
        return [(f"{s}{' (naive)' if s == 'vllm' else ''}",
                 lambda e, i, s=s: make_policy(s, e.engine, router=make_policy(e.policy_name, e.engine).router))
                for s in ("vllm", "sarathi", "edf")]
    base = env.policy_name
    if type(env).__name__ == "AdmissionEnv":
        return [("admit-all (naive; every baseline router)", lambda e, i: make_policy(base, e.engine))]
    routers: list[Contender] = [(f"{r}{' (naive)' if r == 'round-robin' else ''}",
                                 lambda e, i, r=r: make_policy(base, e.engine, router=r))
                                for r in ("round-robin", "least-load")]
    return routers + [("polyserve-co (paper policy: its own scheduler and admission)",
                       lambda e, i: make_policy("polyserve-co", e.engine))]


def paired(rows: list[dict[str, float]], naive: list[dict[str, float]]) -> str:
    """Wins-losses-ties of ``rows`` against the naive baseline's, window by window, on the episode reward."""
    d = np.array([r["reward"] for r in rows]) - np.array([r["reward"] for r in naive])
    return f"{int((d > 0).sum())}-{int((d < 0).sum())}-{int((d == 0).sum())}"


def table(name: str, seeds: list[int]) -> str:
    meta = read_metadata(name)
    kw = meta["env_kwargs"] | {"split": "test"}
    env, wins = windows(meta["env_id"], kw, seeds)
    header = f"### {name}: {meta['env_id']} {', '.join(f'{k}={v}' for k, v in meta['env_kwargs'].items())}"
    if hasattr(env, "comparison_table"):  # Scaling-v0: goodput and instance-seconds vs static-N, threshold
        return f"{header}\n\n{env.comparison_table(name, wins)}"
    rand_env = gym.make(meta["env_id"], **kw).unwrapped
    contenders: list[Contender] = [
        (f"**{name}** (agent)", lambda e, i: load(name)),
        ("random (uniform valid actions)", lambda e, i: env_policy("random", rand_env, uniform_actor(rand_env, i))),
        *baselines(env),
    ]
    runs = {label: [run_window(make(env, i), win, env) for i, win in enumerate(wins)] for label, make in contenders}
    naive = next(rows for label, rows in runs.items() if "(naive" in label)
    lines = [header, "", f"| policy | episode reward ({env.reward_name}) | attainment | goodput (req/s) | "
             "vs naive (W-L-T) |", "|---|---|---|---|---|"]
    for label, rows in runs.items():
        cells = [f"{np.mean(v):.3f} ({np.std(v):.3f})" for v in
                 ([r[k] for r in rows] for k in ("reward", "attainment", "goodput"))]
        lines.append(f"| {label} | {' | '.join(cells)} | {paired(rows, naive)} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def training_table(names: list[str]) -> str:
    """How each agent was trained, from its metadata."""
    lines = ["| agent | algorithm | BC (expert, steps) | PPO steps | shipped weights | wall s | CPU s | "
             "train arrival rate |", "|---|---|---|---|---|---|---|---|"]
    for n in names:
        m = read_metadata(n)
        bc = f"{m['bc']['expert']}, {m['bc']['steps']}" if m["bc"]["steps"] else "none"
        lines.append(f"| {n} | {m['algo']} | {bc} | {m['total_timesteps']} | {m['selected']} | "
                     f"{m['train_wall_seconds']} | {m.get('train_cpu_seconds', 'n/a')} | "
                     f"{m.get('arrival_rate', float('nan')):.2f} req/s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", nargs="*", default=None, help="default: every shipped agent")
    ap.add_argument("--seeds", nargs="*", type=int, default=list(range(8)))
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.agents or available()
    out = [training_table(names)] + [table(n, args.seeds) for n in names]
    cmd = "python scripts/eval_agents.py" + (f" --agents {' '.join(args.agents)}" if args.agents else "") + \
        f" --seeds {' '.join(map(str, args.seeds))}"
    print("\n\n".join(out) + f"\n\nReproduce: `{cmd}` (test split, seeds {args.seeds}; mean (std) over windows)")


if __name__ == "__main__":
    main()

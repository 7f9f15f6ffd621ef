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

Scaling agents are also compared with static provisioning *at equal cost*, window by window
(:func:`equal_cost`): in each window the static pools 1..max_instances give points (instance-seconds,
SLO-meeting requests); the static frontier is interpolated linearly at the agent's own cost in that window and
the agent's paired difference to it is reported per window, with its mean, a 95 % t-interval and a 95 %
percentile-bootstrap interval over windows (the threshold scaler likewise, for reference).
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


def table(name: str, seeds: list[int], pool_seeds: list[int] | None = None) -> str:
    """The agent's comparison table on the test windows ``seeds`` of its pool or, with ``pool_seeds``, of each
    of these pools (the env's ``seed``: other generated traces of the same scenario, whose test splits are
    independent of the training pool and of each other; windows labelled ``pool/seed``)."""
    meta = read_metadata(name)
    kw = meta["env_kwargs"] | {"split": "test"}
    env, wins = windows(meta["env_id"], kw, seeds)
    labels = [str(s) for s in seeds]
    if pool_seeds:
        wins = [w for p in pool_seeds for w in windows(meta["env_id"], kw | {"seed": p}, seeds)[1]]
        labels = [f"{p}/{s}" for p in pool_seeds for s in seeds]
    header = f"### {name}: {meta['env_id']} {', '.join(f'{k}={v}' for k, v in meta['env_kwargs'].items())}"
    if pool_seeds:
        header += f" (test splits of pools seed={pool_seeds})"
    if hasattr(env, "comparison_table"):  # Scaling-v0: goodput and instance-seconds vs static-N, threshold
        paired_static = equal_cost(env, wins, labels, [(f"**{name}** (agent)", lambda e, i: load(name)),
                                                      ("threshold", lambda e, i: e.baseline_policy("threshold"))])
        return (f"{header}\n\n{env.comparison_table(name, wins)}\n\nPaired with static provisioning at equal cost "
                f"(SLO-meeting requests minus the static frontier's at the same instance-seconds, per window):"
                f"\n\n{paired_static}")
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


def frontier_at(cost: float, static: list[dict[str, float]]) -> float:
    """SLO-meeting requests of static provisioning at ``cost`` instance-seconds in one window: linear
    interpolation between the static pools' (instance-seconds, gain) points of that window, clamped to the
    smallest / largest pool outside their range."""
    pts = sorted((r["instance_seconds"], r["gain"]) for r in static)
    return float(np.interp(cost, [c for c, _ in pts], [g for _, g in pts]))


def mean_ci(d: np.ndarray, level: float = 0.95, n_boot: int = 10000) -> dict[str, float]:
    """Mean of the paired differences ``d``, its t-interval and percentile-bootstrap interval (``n_boot``
    resamples of the windows, NumPy seed 0) at ``level``; wins / losses / ties."""
    from scipy import stats

    n, m = len(d), float(d.mean())
    se = float(d.std(ddof=1)) / np.sqrt(n) if n > 1 else float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se if n > 1 else float("nan")
    boot = np.random.default_rng(0).choice(d, size=(n_boot, n)).mean(1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": m, "sd": float(d.std(ddof=1)) if n > 1 else float("nan"), "se": se, "t_lo": m - half,
            "t_hi": m + half, "boot_lo": float(lo), "boot_hi": float(hi), "wins": int((d > 0).sum()),
            "losses": int((d < 0).sum()), "ties": int((d == 0).sum())}


def equal_cost(env: Any, wins: list[Any], labels: list[str], contenders: list[Contender]) -> str:
    """Scaling-v0: each contender's SLO-meeting requests minus the static frontier's at the contender's cost,
    paired by window (:func:`frontier_at` over static-1..max_instances); a per-window table and the mean with
    95 % t- and bootstrap intervals. A mean whose interval excludes 0 is a difference at equal cost."""
    sizes = range(1, env.layout.max + 1)
    static = [[env.run_scaler(env.baseline_policy("static", n), w, n) for n in sizes] for w in wins]
    runs = {label: [env.run_scaler(make(env, i), w) for i, w in enumerate(wins)] for label, make in contenders}
    diffs = {label: np.array([r["gain"] - frontier_at(r["instance_seconds"], st) for r, st in zip(rows, static)])
             for label, rows in runs.items()}
    head = " | ".join(f"{label}: gain @ inst-s, vs static" for label in runs)
    lines = [f"| window | {head} | " + " | ".join(f"static-{n}" for n in sizes) + " |",
             "|---" * (1 + len(runs) + len(sizes)) + "|"]
    for k, s in enumerate(labels):
        cells = [f"{rows[k]['gain']:.0f} @ {rows[k]['instance_seconds']:.0f}, {diffs[label][k]:+.1f}"
                 for label, rows in runs.items()]
        lines.append(f"| {s} | {' | '.join(cells)} | " +
                     " | ".join(f"{r['gain']:.0f} @ {r['instance_seconds']:.0f}" for r in static[k]) + " |")
    lines += ["", "| policy | gain | instance-seconds | vs static at equal cost: mean | sd | 95 % t-interval | "
              "95 % bootstrap | W-L-T |", "|---|---|---|---|---|---|---|---|"]
    for label, rows in runs.items():
        c = mean_ci(diffs[label])
        lines.append(f"| {label} | {np.mean([r['gain'] for r in rows]):.2f} | "
                     f"{np.mean([r['instance_seconds'] for r in rows]):.1f} | {c['mean']:+.2f} | {c['sd']:.2f} | "
                     f"[{c['t_lo']:+.2f}, {c['t_hi']:+.2f}] | [{c['boot_lo']:+.2f}, {c['boot_hi']:+.2f}] | "
                     f"{c['wins']}-{c['losses']}-{c['ties']} |")
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
    ap.add_argument("--pool-seeds", nargs="*", type=int, default=None,
                    help="evaluate on the test splits of these pools (env seed=...; other generated traces) instead "
                         "of the agent's own pool: the windows are --seeds of each pool")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.agents or available()
    out = [training_table(names)] + [table(n, args.seeds, args.pool_seeds) for n in names]
    cmd = "python scripts/eval_agents.py" + (f" --agents {' '.join(args.agents)}" if args.agents else "") + \
        f" --seeds {' '.join(map(str, args.seeds))}" + \
        (f" --pool-seeds {' '.join(map(str, args.pool_seeds))}" if args.pool_seeds else "")
    pools = f"pools {args.pool_seeds}" if args.pool_seeds else "the agent's pool"
    print("\n\n".join(out) + f"\n\nReproduce: `{cmd}` (test split of {pools}, seeds {args.seeds}; mean (std) over "
          f"windows)")


if __name__ == "__main__":
    main()

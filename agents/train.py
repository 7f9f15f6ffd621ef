"""Train one slogym agent from a YAML config, top to bottom; writes ``<out>/<name>.zip`` and ``<name>.json``.

    python agents/train.py agents/configs/admission.yaml                        # as shipped
    python agents/train.py agents/configs/batching.yaml total_timesteps=20000 seed=1 --out /tmp/agents

Overrides are ``dotted.key=value`` (values parsed as YAML), e.g. ``env_kwargs.rate_scale=3 bc.steps=0``.

Steps: (1) config; (2) environments -- training episodes come from ``split="train"`` windows, evaluation from
the held-out ``split="test"`` windows; (3) the model (SB3 ``PPO`` for Box actions, ``MaskablePPO`` for discrete
ones) on the flattened observation -- an MLP, or with a ``slots`` block the slot-equivariant network of
``slogym.agents.nets`` (one shared scorer per candidate / instance); (4) optional behaviour cloning from the
env's ``expert_action``: cross-entropy (discrete) or squared error of the mean action (Box), plus a value-head
fit to the expert's discounted returns; (5) PPO fine-tuning; (6) model selection on *training-split*
validation windows (the BC-only weights are kept if fine-tuning made them worse); (7) evaluation on test
windows and saving.
Everything runs on one CPU thread; the metadata records wall and CPU seconds (they differ on a shared machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import yaml
from gymnasium.wrappers import FlattenObservation
from sb3_contrib import MaskablePPO
from sb3_contrib.common.wrappers import ActionMasker
from stable_baselines3 import PPO
from stable_baselines3.common.logger import Logger

import slogym  # noqa: F401  (registers the environments)
from slogym.agents import env_policy, model_actor
from slogym.agents.evaluation import evaluate, windows
from slogym.agents.nets import MaskableSlotPolicy, SlotPolicy, slot_layout
from slogym.envs.batching import level_of

SLACK = 6  # Batching-v0 candidate feature: slack to the next output's deadline (s)


def edf_priority(slack: np.ndarray) -> np.ndarray:
    """EDF's priority key as Batching-v0 scores: earlier deadline (smaller slack, s), higher score; all in
    [0.3, 1] (schedulable, clear of the skip threshold 0) and steepest within a second of the deadline."""
    return 0.65 - 0.35 * np.tanh(slack / 0.5)
from slogym.workloads.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------- 1. config
def load_config(path: str, overrides: list[str]) -> dict[str, Any]:
    cfg = yaml.safe_load(Path(path).read_text())
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} is not key=value")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return cfg


def make_env(cfg: dict[str, Any], split: str) -> gym.Env:
    """Flattened env (masks forwarded for MaskablePPO)."""
    env = FlattenObservation(gym.make(cfg["env_id"], **cfg["env_kwargs"], split=split))
    if cfg["algo"] == "MaskablePPO":
        env = ActionMasker(env, lambda e: e.unwrapped.action_masks())
    return env


# ---------------------------------------------------------------------------------------------- 4. imitation
def idle_drop(raw: Any, obs: dict[str, np.ndarray], busy: int, idle: int, idle_rate: float) -> np.ndarray:
    """Scaling-v0 expert computed from the observation alone (so an MLP can imitate it exactly): each pool
    should hold ``busy`` instances while its arrival rate -- the larger of the last interval's and the 0.5
    EWMA, in units of the pool's mean rate (``arrivals`` features) -- exceeds ``idle_rate``, else ``idle``
    (a silence of the bursty trace); it moves toward that size by at most +2 / -1 per decision, within the
    pool bounds. Ours, not from a paper: the cost-aware rule selected on training-split validation windows
    (docs/agents.md)."""
    lay = raw.layout
    rate = np.max(obs["arrivals"][:, :2], axis=1)
    rate = rate if lay.pooling == "tiers" else np.array([rate.max()])
    n = lay.sizes(raw.sim)
    target = np.where(rate > idle_rate, busy, idle)
    d = np.clip(np.clip(target - n, -1, 2), lay.min - n, lay.max - n)
    return np.clip(d, -raw.max_delta, raw.max_delta) + raw.max_delta


def expert_rollouts(env: gym.Env, expert: str | None, steps: int, gamma: float, seed: int,
                    min_budget: int | None = None, deadline_scores: bool = False,
                    rule: dict[str, Any] | None = None, explore: float = 0.0) -> dict[str, np.ndarray]:
    """``steps`` transitions of the expert on training windows: observations, actions, masks and the
    discounted return from each step to its episode's end. Batching-v0 targets: with ``min_budget`` the
    budget level is raised to at least that many tokens (the expert's level is its batch's exact token count,
    so a slightly low imitation would cut members out of the batch). With ``deadline_scores`` (expert EDF)
    every candidate's target is EDF's own priority key instead of its rank in the batch:
    :func:`edf_priority` of its next deadline's slack (an observed feature); in score order within the budget
    this forms EDF's batch (same metrics as native EDF on the validation windows checked), while rank targets
    depend on every other candidate and a per-candidate scorer fits them only approximately.
    With ``rule`` (Scaling-v0) the targets are :func:`idle_drop` with those keyword arguments instead of an env
    expert. With ``explore`` > 0 a step takes a uniformly random valid action with that probability (the target
    is still the expert's), so the rollouts also visit the states the expert itself never reaches."""
    raw = env.unwrapped
    rng = np.random.default_rng(seed)
    obs_l, act_l, mask_l, rew_l, done_l = [], [], [], [], []
    obs, _ = env.reset(seed=seed)
    while len(obs_l) < steps:
        if rule:
            a = idle_drop(raw, gym.spaces.unflatten(raw.observation_space, obs), **rule)
        else:
            a = raw.expert_action(expert) if expert else raw.expert_action()
        if min_budget:
            a[-1] = max(a[-1], level_of(min_budget))
        if deadline_scores:
            n = len(raw.candidates())
            slack = gym.spaces.unflatten(raw.observation_space, obs)["candidates"][:n, SLACK]
            a[:n] = edf_priority(slack)
        obs_l.append(obs)
        act_l.append(a)
        mask_l.append(raw.action_masks() if hasattr(raw, "action_masks") else np.ones(1, bool))
        if explore and rng.random() < explore:  # a random valid action per pool (MultiDiscrete masks)
            nvec, m = env.action_space.nvec, mask_l[-1]
            parts = np.split(m, np.cumsum(nvec)[:-1])
            obs, r, term, trunc, _ = env.step(np.array([rng.choice(np.flatnonzero(p)) for p in parts]))
        else:
            obs, r, term, trunc, _ = env.step(a)
        rew_l.append(r)
        done_l.append(term or trunc)
        if term or trunc:
            obs, _ = env.reset()
    ret = np.zeros(len(rew_l), np.float32)
    g = 0.0
    for i in reversed(range(len(rew_l))):
        g = rew_l[i] + gamma * g * (not done_l[i])
        ret[i] = g
    return {"obs": np.array(obs_l, np.float32), "act": np.array(act_l), "mask": np.array(mask_l),
            "ret": ret}


def behaviour_clone(model: Any, data: dict[str, np.ndarray], epochs: int, batch_size: int, lr: float,
                    seed: int, last_weight: float = 1.0, lr_decay: bool = False) -> list[float]:
    """Fit the policy to the expert -- cross-entropy of its action for discrete actions, squared error of the
    Gaussian mean for Box actions (the exploration std is left to PPO; the last action entry's error weighs
    ``last_weight``: Batching-v0's budget level, where 0.01 is ~160 tokens) -- and the value head to the
    expert's returns (scaled by their mean magnitude). With ``lr_decay`` Adam's learning rate decays linearly to 0
    over the epochs (a constant rate leaves the outputs jittering by about the rate). Returns the mean loss per
    epoch."""
    pol = model.policy
    opt = torch.optim.Adam(pol.parameters(), lr=lr)
    obs, act = torch.as_tensor(data["obs"]), torch.as_tensor(data["act"])
    ret = torch.as_tensor(data["ret"])
    masked = isinstance(model, MaskablePPO)
    weight = torch.ones(act.shape[-1]) if not masked else None
    if weight is not None:
        weight[-1] = last_weight
    scale = float(ret.abs().mean()) + 1e-8
    rng = np.random.default_rng(seed)
    losses = []
    pol.set_training_mode(True)
    for epoch in range(epochs):
        for g in opt.param_groups:
            g["lr"] = lr * (1.0 - epoch / epochs) if lr_decay else lr
        perm, total = rng.permutation(len(obs)), 0.0
        for lo in range(0, len(obs), batch_size):
            b = perm[lo:lo + batch_size]
            if masked:
                values, logp, _ = pol.evaluate_actions(obs[b], act[b], action_masks=data["mask"][b])
                imitation = -logp.mean()
            else:
                values = pol.predict_values(obs[b])
                mean = pol.get_distribution(obs[b]).distribution.mean
                imitation = (weight * (mean - act[b]) ** 2).sum(1).mean()
            loss = imitation + 0.5 * (((values.flatten() - ret[b]) / scale) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(b)
        losses.append(total / len(obs))
    pol.set_training_mode(False)
    return losses


# ---------------------------------------------------------------------------------------------- 6-7. evaluation
def score(model: Any, cfg: dict[str, Any], split: str, seeds: list[int]) -> dict[str, float]:
    """Mean episode reward / attainment / goodput of the deterministic agent on ``split`` windows."""
    kw = cfg["env_kwargs"] | {"split": split}
    env, wins = windows(cfg["env_id"], kw, seeds)
    make = lambda i: env_policy(cfg["name"], env, model_actor(model, env))  # noqa: E731
    if hasattr(env, "run_scaler"):  # Scaling-v0: its reward counts the instance-second cost
        return env.evaluate(make, wins)
    return evaluate(make, env, wins)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value")
    ap.add_argument("--out", default=str(ROOT / "checkpoints"),
                    help="folder for the checkpoint (.zip) and its metadata (.json); default: the shipped agents' "
                         "agents/checkpoints, which a run with overrides may not replace without --force")
    ap.add_argument("--force", action="store_true", help="let a run with overrides replace a shipped checkpoint")
    args = ap.parse_args()
    if args.overrides and Path(args.out).resolve() == (ROOT / "checkpoints").resolve() and not args.force:
        ap.error(f"overrides {args.overrides} change the agent: write it elsewhere with --out DIR (or --force to "
                 f"replace the shipped checkpoint in {ROOT / 'checkpoints'})")
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(1)
    seed = int(cfg["seed"])
    torch.manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()

    # 2. environments
    env = make_env(cfg, "train")
    env.reset(seed=seed)

    # 3. model
    algo = {"PPO": PPO, "MaskablePPO": MaskablePPO}[cfg["algo"]]
    policy, policy_kwargs = "MlpPolicy", dict(cfg["policy_kwargs"])
    if cfg.get("slots"):  # one shared scorer per slot (candidate / instance) + the extra action outputs
        space, act_space = env.unwrapped.observation_space, env.action_space
        n_act = act_space.n if isinstance(act_space, gym.spaces.Discrete) else act_space.shape[0]
        n_slots = space[cfg["slots"]["items"][0]].shape[0]
        policy = MaskableSlotPolicy if cfg["algo"] == "MaskablePPO" else SlotPolicy
        policy_kwargs["layout"] = slot_layout(space, cfg["slots"]["items"], cfg["slots"].get("mask"),
                                              n_act - n_slots)
    model = algo(policy, env, seed=seed, device="cpu", verbose=0, policy_kwargs=policy_kwargs, **cfg["ppo"])
    model.set_logger(Logger(folder=None, output_formats=[]))  # the default one leaves an empty SB3-<date> dir in /tmp

    # 4. behaviour cloning warm start
    bc = cfg.get("bc") or {}
    bc_log: dict[str, Any] = {"steps": int(bc.get("steps", 0))}
    if bc_log["steps"]:
        data = expert_rollouts(make_env(cfg, "train"), bc.get("expert"), bc_log["steps"], model.gamma, seed + 1,
                               bc.get("min_budget"), bool(bc.get("deadline_scores")), bc.get("rule"),
                               float(bc.get("explore", 0.0)))
        bc_log |= {"expert": ("idle-drop" if bc.get("rule") else bc.get("expert")) or cfg["env_kwargs"]["policy"],
                   "rule": bc.get("rule"), "explore": float(bc.get("explore", 0.0)), "epochs": bc["epochs"],
                   "min_budget": bc.get("min_budget"), "deadline_scores": bool(bc.get("deadline_scores")),
                   "last_weight": bc.get("last_weight", 1.0),
                   "lr_decay": bool(bc.get("lr_decay")),
                   "losses": behaviour_clone(model, data, int(bc["epochs"]), int(bc["batch_size"]),
                                             float(bc["learning_rate"]), seed, float(bc.get("last_weight", 1.0)),
                                             bool(bc.get("lr_decay")))}
        print(f"BC: {bc_log['steps']} expert steps, loss {bc_log['losses'][0]:.3f} -> {bc_log['losses'][-1]:.3f}")
        if isinstance(model, MaskablePPO):  # share of the expert's (training) actions the argmax reproduces
            pred, _ = model.predict(data["obs"], deterministic=True, action_masks=data["mask"])
            n = len(pred)
            bc_log["agreement"] = float((pred.reshape(n, -1) == data["act"].reshape(n, -1)).all(axis=1).mean())
            print(f"BC agreement with the expert on its rollouts: {bc_log['agreement']:.3f}")

    # 5. PPO fine-tuning
    val_seeds = list(cfg["eval"]["val_seeds"])
    before = copy.deepcopy(model.policy.state_dict()) if bc_log["steps"] and val_seeds else None
    val_bc = score(model, cfg, "train", val_seeds) if before is not None else None
    t_ppo = time.perf_counter()
    if cfg["total_timesteps"]:
        model.learn(total_timesteps=int(cfg["total_timesteps"]))
    print(f"PPO: {cfg['total_timesteps']} steps in {time.perf_counter() - t_ppo:.0f} s")

    # 6. model selection on training-split validation windows (never the test split)
    selected = "ppo"
    if before is not None:
        val_ppo = score(model, cfg, "train", val_seeds)
        print(f"validation reward: BC {val_bc['reward']:.3f}, BC+PPO {val_ppo['reward']:.3f}")
        if val_ppo["reward"] < val_bc["reward"]:
            model.policy.load_state_dict(before)
            selected = "bc"
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0

    # 7. held-out evaluation and saving
    test = score(model, cfg, "test", list(cfg["eval"]["test_seeds"])) if cfg["eval"]["test_seeds"] else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save(out / f"{cfg['name']}.zip")
    meta = {
        "name": cfg["name"], "env_id": cfg["env_id"], "env_kwargs": cfg["env_kwargs"], "algo": cfg["algo"],
        "arrival_rate": SCENARIOS[cfg["env_kwargs"]["scenario"]].default_rate * cfg["env_kwargs"].get("rate_scale", 1),
        "seed": seed, "total_timesteps": int(cfg["total_timesteps"]), "policy_kwargs": cfg["policy_kwargs"],
        "slots": cfg.get("slots"),
        "ppo": cfg["ppo"], "bc": bc_log, "selected": selected,
        "validation": {"seeds": val_seeds, "bc": val_bc, "bc_ppo": val_ppo if before is not None else None},
        "train_wall_seconds": round(wall, 1), "train_cpu_seconds": round(cpu, 1),
        "torch_threads": torch.get_num_threads(),
        "test_eval": {"split": "test", "seeds": list(cfg["eval"]["test_seeds"])} | test,
        "command": f"python agents/train.py {args.config} {' '.join(args.overrides)}".strip(),
    }
    (out / f"{cfg['name']}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({k: meta[k] for k in ("name", "selected", "train_wall_seconds", "test_eval")}, indent=2))


if __name__ == "__main__":
    main()

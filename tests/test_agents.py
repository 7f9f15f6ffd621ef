"""Learned agents: short PPO / MaskablePPO learning on every env, shipped checkpoints as Policies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("sb3_contrib")
import torch  # noqa: E402
from gymnasium.wrappers import FlattenObservation  # noqa: E402
from sb3_contrib import MaskablePPO  # noqa: E402
from sb3_contrib.common.wrappers import ActionMasker  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402

import slogym  # noqa: E402,F401
from slogym import agents  # noqa: E402
from slogym.agents.evaluation import evaluate, run_window, windows  # noqa: E402
from slogym.agents.nets import MaskableSlotPolicy, SlotPolicy, slot_layout  # noqa: E402
from slogym.baselines import make_policy  # noqa: E402
from slogym.envs.batching import level_of  # noqa: E402

torch.set_num_threads(1)
SMALL = {"scenario": "coder", "episode": 32, "pool_requests": 400, "seed": 0}


@pytest.mark.parametrize("env_id, kw", [
    ("slogym/Admission-v0", {"rate_scale": 2.0}),
    ("slogym/Routing-v0", {"rate_scale": 4.0, "n_instances": 4}),
    ("slogym/Batching-v0", {"rate_scale": 0.6, "K": 16}),
])
def test_short_learn(env_id: str, kw: dict) -> None:
    env = FlattenObservation(gym.make(env_id, split="train", **SMALL, **kw))
    if env_id == "slogym/Batching-v0":
        model = PPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=1, seed=0, device="cpu",
                    policy_kwargs={"net_arch": [16]})
    else:
        env = ActionMasker(env, lambda e: e.unwrapped.action_masks())
        model = MaskablePPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=1, seed=0, device="cpu",
                            policy_kwargs={"net_arch": [16]})
    model.learn(total_timesteps=256)
    assert model.num_timesteps >= 256


def _train_module():
    spec = importlib.util.spec_from_file_location("train", Path(__file__).parents[1] / "agents" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _slot_model(env_id: str, kw: dict, items: list[str], mask: str | None):
    env = FlattenObservation(gym.make(env_id, split="train", **SMALL, **kw))
    space = env.unwrapped.observation_space
    n_act = env.action_space.n if isinstance(env.action_space, gym.spaces.Discrete) else env.action_space.shape[0]
    layout = slot_layout(space, items, mask, n_act - space[items[0]].shape[0])
    if isinstance(env.action_space, gym.spaces.Discrete):
        env = ActionMasker(env, lambda e: e.unwrapped.action_masks())
        return env, MaskablePPO(MaskableSlotPolicy, env, n_steps=64, batch_size=32, n_epochs=1, seed=0,
                                device="cpu", policy_kwargs={"layout": layout, "hidden": 8})
    return env, PPO(SlotPolicy, env, n_steps=64, batch_size=32, n_epochs=1, seed=0, device="cpu",
                    policy_kwargs={"layout": layout, "hidden": 8, "extra_log_std": -4.0})


def test_slot_layout_matches_flatten() -> None:
    env = gym.make("slogym/Routing-v0", n_instances=3, **SMALL).unwrapped
    obs, _ = env.reset(seed=0)
    layout = slot_layout(env.observation_space, ["instances", "placed_since", "slack"], None, 1)
    flat = gym.spaces.flatten(env.observation_space, obs)
    assert layout["n_slots"] == 3 and [w for _, w in layout["items"]] == [5, 1, env.n_tiers]
    for (o, w), key in zip(layout["items"], ("instances", "placed_since", "slack")):
        np.testing.assert_array_equal(flat[o:o + 3 * w].reshape(3, w), obs[key].reshape(3, w))
    ctx = np.concatenate([flat[o:o + n] for o, n in layout["context"]])
    assert ctx.size == sum(obs[k].size for k in ("app", "recent", "request", "tier"))
    with pytest.raises(ValueError, match="slots"):
        slot_layout(env.observation_space, ["instances", "request"], None, 1)


@pytest.mark.parametrize("env_id, kw, items, mask", [
    ("slogym/Batching-v0", {"rate_scale": 0.6, "K": 8}, ["candidates", "valid"], "valid"),
    ("slogym/Routing-v0", {"rate_scale": 4.0, "n_instances": 4}, ["instances", "placed_since", "slack"], None),
])
def test_slot_policy_is_equivariant_learns_and_reloads(env_id: str, kw: dict, items: list[str], mask: str | None,
                                                      tmp_path: Path) -> None:
    """Permuting the slots permutes the slot outputs (extra outputs and value unchanged); a short learn runs;
    the saved model reloads with the same outputs."""
    env, model = _slot_model(env_id, kw, items, mask)
    pol, layout = model.policy, model.policy.layout
    n = layout["n_slots"]
    x = torch.randn(3, env.observation_space.shape[0])
    if mask is not None:
        x[:, layout["mask"]:layout["mask"] + n] = 1.0
    perm = torch.randperm(n)
    xp = x.clone()
    for o, w in layout["items"]:
        xp[:, o:o + n * w] = x[:, o:o + n * w].reshape(3, n, w)[:, perm].reshape(3, -1)
    with torch.no_grad():
        out, outp = pol.mlp_extractor.forward_actor(x), pol.mlp_extractor.forward_actor(xp)
        torch.testing.assert_close(outp[:, :n], out[:, :n][:, perm])
        torch.testing.assert_close(outp[:, n:], out[:, n:])
        torch.testing.assert_close(pol.predict_values(xp), pol.predict_values(x))
    model.learn(total_timesteps=128)
    assert model.num_timesteps >= 128
    model.save(tmp_path / "m.zip")
    again = type(model).load(tmp_path / "m.zip", device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(again.policy.mlp_extractor.forward_actor(x), pol.mlp_extractor.forward_actor(x))


def test_edf_priority_scores_reproduce_edf() -> None:
    """The BC target of the batching agent -- EDF's priority key as per-candidate scores within EDF's
    512-token budget -- forms EDF's batches: the same metrics as native EDF."""
    train = _train_module()
    env, wins = windows("slogym/Batching-v0", {"rate_scale": 0.8, "K": 64, "policy": "edf", **SMALL}, [0, 1])

    def act(obs: dict) -> np.ndarray:
        s = np.where(obs["valid"] > 0, train.edf_priority(obs["candidates"][:, train.SLACK]), -0.5)
        return np.append(s, level_of(512)).astype(np.float32)

    assert evaluate(lambda i: agents.env_policy("edf-scores", env, act), env, wins) == \
        evaluate(lambda i: make_policy("edf", env.engine), env, wins)
    assert train.edf_priority(np.array([-1.0, 0.05, 2.0])).tolist() == sorted(
        train.edf_priority(np.array([-1.0, 0.05, 2.0])).tolist(), reverse=True)


def test_round_robin_is_expressible_through_placed_since() -> None:
    """Routing-v0's placed_since feature: placing on its largest entry (ties: lowest index) is round-robin,
    the expert the routing agent imitates; same metrics as the native router."""
    env, wins = windows("slogym/Routing-v0", {"rate_scale": 4.0, "n_instances": 3, "policy": "round-robin",
                                              **SMALL}, [0, 1])
    lru = evaluate(lambda i: agents.env_policy("lru", env, lambda o: int(np.argmax(o["placed_since"]))), env, wins)
    assert lru == evaluate(lambda i: make_policy("round-robin", env.engine), env, wins)
    assert lru != evaluate(lambda i: agents.env_policy("first", env, lambda o: 0), env, wins)


def test_available_and_unknown() -> None:
    names = agents.available()
    assert {"admission-coder", "routing-coder-4x", "routing-tiers-4x", "batching-coder"} <= set(names)
    with pytest.raises(ValueError, match="available: .*admission-coder"):
        agents.load("no-such-agent")


@pytest.mark.parametrize("name", ["admission-coder", "routing-coder-4x", "routing-tiers-4x", "batching-coder"])
def test_shipped_agent_runs_on_a_test_window(name: str) -> None:
    meta = agents.read_metadata(name)
    env, wins = windows(meta["env_id"], meta["env_kwargs"] | {"split": "test", "episode": 48}, [0])
    res = run_window(agents.load(name), wins[0], env)
    assert 0.0 <= res["attainment"] <= 1.0 and np.isfinite(res["reward"])


def test_policy_matches_env_episode() -> None:
    """The agent as a Policy in the Simulator earns exactly the return of stepping its env with the model."""
    meta = agents.read_metadata("admission-coder")
    kw = meta["env_kwargs"] | {"split": "test", "episode": 64}
    env, wins = windows(meta["env_id"], kw, [3])
    policy = agents.load("admission-coder")
    model = MaskablePPO.load(agents.checkpoint_dir() / "admission-coder.zip", device="cpu")
    act = agents.model_actor(model, env)
    obs, _ = env.reset(seed=3)
    total, done = 0.0, False
    while not done:
        obs, r, done, _, _ = env.step(act(obs))
        total += r
    assert run_window(policy, wins[0], env)["reward"] == pytest.approx(total)


def _eval_module():
    path = Path(__file__).parents[1] / "scripts" / "eval_agents.py"
    spec = importlib.util.spec_from_file_location("eval_agents", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SCALING = {"scenario": "coder", "rate_scale": 4.0, "n_instances": 2, "episode": 120.0, "pool_requests": 4000, "seed": 0,
           "min_instances": 1, "max_instances": 4, "max_delta": 2, "lam": 0.3}


def test_idle_drop_rule_targets_and_run() -> None:
    """The scaling agent's BC expert: ``busy`` instances while the observed arrival rate exceeds ``idle_rate``
    (moving by at most +2 / -1), ``idle`` in silences; served as a Policy its cost lies between static-1's and
    static-2's on a window with a silence, and it meets at least static-1's SLOs."""
    train = _train_module()
    env = gym.make("slogym/Scaling-v0", split="train", **SCALING).unwrapped
    obs, _ = env.reset(seed=0)
    k = env.max_delta
    quiet = obs | {"arrivals": np.zeros_like(obs["arrivals"])}
    busy = obs | {"arrivals": np.full_like(obs["arrivals"], 0.5)}
    assert train.idle_drop(env, quiet, 2, 1, 0.15).tolist() == [k - 1]  # 2 -> 1
    assert train.idle_drop(env, busy, 2, 1, 0.15).tolist() == [k]  # stays at 2
    assert train.idle_drop(env, busy, 4, 1, 0.15).tolist() == [k + 2]  # 2 -> 4 (at most +2)
    assert train.idle_drop(env, busy, 6, 1, 0.15).tolist() == [k + 2]  # bounded by max_instances 4
    test_env, wins = windows("slogym/Scaling-v0", SCALING | {"split": "test"}, [0, 1, 2, 3])
    rule = [test_env.run_scaler(agents.env_policy("idle-drop", test_env, lambda o: train.idle_drop(
        test_env, o, 2, 1, 0.15)), w) for w in wins]
    static = [[test_env.run_scaler(test_env.baseline_policy("static", n), w, n) for n in (1, 2)] for w in wins]
    for r, (s1, s2) in zip(rule, static):
        assert s1["instance_seconds"] <= r["instance_seconds"] <= s2["instance_seconds"] + 10.0
        assert r["gain"] >= s1["gain"]
    assert any(r["instance_seconds"] < s2["instance_seconds"] - 10.0 for r, (_, s2) in zip(rule, static))


def test_equal_cost_frontier_and_intervals() -> None:
    """eval_agents' static frontier at equal cost (linear between the static pools, clamped outside) and the
    paired-difference summary (mean, t-interval, bootstrap interval, W-L-T)."""
    ev = _eval_module()
    static = [{"instance_seconds": c, "gain": g} for c, g in ((300.0, 16.0), (100.0, 10.0), (200.0, 15.0))]
    assert ev.frontier_at(150.0, static) == pytest.approx(12.5)
    assert ev.frontier_at(50.0, static) == 10.0 and ev.frontier_at(400.0, static) == 16.0
    c = ev.mean_ci(np.array([1.0, 2.0, 3.0, 4.0, 0.0, -1.0]))
    assert c["mean"] == pytest.approx(1.5)
    half = 2.5706 * np.std([1, 2, 3, 4, 0, -1], ddof=1) / np.sqrt(6)
    assert c["t_lo"] == pytest.approx(1.5 - half, abs=1e-3) and c["t_hi"] == pytest.approx(1.5 + half, abs=1e-3)
    assert -1.0 <= c["boot_lo"] < 1.5 < c["boot_hi"] <= 4.0
    assert (c["wins"], c["losses"], c["ties"]) == (4, 1, 1)


def test_shipped_scaling_agent_drops_to_one_instance_in_a_quiet_window() -> None:
    """scaling-coder (the idle-drop rule learned): on a held-out window that is mostly silence (test seed 3,
    15 requests in 300 s) it costs about static-1, far less than static-2 where it starts, and meets as many
    SLOs as static-1."""
    meta = agents.read_metadata("scaling-coder")
    env, wins = windows(meta["env_id"], meta["env_kwargs"] | {"split": "test"}, [3])
    agent = env.run_scaler(agents.load("scaling-coder"), wins[0])
    s1, s2 = (env.run_scaler(env.baseline_policy("static", n), wins[0], n) for n in (1, 2))
    assert agent["instance_seconds"] < 0.6 * s2["instance_seconds"]
    assert agent["gain"] >= s1["gain"]

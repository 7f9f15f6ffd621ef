"""Gymnasium environments: checkers, seeding, expert replay == native baseline, masks, vector envs, errors."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import slogym  # noqa: F401
from helpers import FF_FIELDS
from slogym.baselines import make_policy
from slogym.core.simulator import Simulator

SMALL = dict(episode=40, seed=0, pool_requests=400)
ENVS = [("slogym/Admission-v0", {}), ("slogym/Routing-v0", {"n_instances": 2, "policy": "round-robin"}),
        ("slogym/Batching-v0", {"K": 16})]


def play(env: gym.Env, pick) -> tuple[list[float], dict]:
    rewards, done, info = [], False, {}
    while not done:
        _, r, done, _, info = env.step(pick(env))
        rewards.append(r)
    return rewards, info


@pytest.mark.parametrize("env_id,kw", ENVS)
def test_gymnasium_and_sb3_checkers(env_id, kw):
    env = gym.make(env_id, **SMALL, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env.unwrapped, skip_render_check=True)
    sb3 = pytest.importorskip("stable_baselines3.common.env_checker", reason="stable-baselines3 not installed")
    sb3.check_env(gym.wrappers.FlattenObservation(gym.make(env_id, **SMALL, **kw)))


def test_make_without_prior_import():
    env = gym.make("slogym:slogym/Admission-v0", **SMALL)
    assert env.action_space == gym.spaces.Discrete(3)


@pytest.mark.parametrize("env_id,kw", ENVS)
def test_seeded_reset_gives_identical_episodes(env_id, kw):
    runs = []
    for _ in range(2):
        env = gym.make(env_id, **SMALL, **kw)
        env.reset(seed=7)
        env.action_space.seed(3)
        rewards, info = play(env, lambda e: e.action_space.sample() if "Batching" in env_id else 0)
        runs.append((rewards, info["summary"]["attainment"], info["summary"]["iterations"]))
    assert runs[0] == runs[1]
    other = gym.make(env_id, **SMALL, **kw)
    obs_a, _ = other.reset(seed=7)
    obs_b, _ = other.reset(seed=8)
    assert any(not np.array_equal(obs_a[k], obs_b[k]) for k in obs_a)


EXPERTS = [("slogym/Admission-v0", "sarathi", {}), ("slogym/Admission-v0", "vllm", {}),
           ("slogym/Routing-v0", "round-robin", {"n_instances": 3}),
           ("slogym/Routing-v0", "least-load", {"n_instances": 3}),
           ("slogym/Routing-v0", "random", {"n_instances": 3}),
           ("slogym/Batching-v0", "sarathi", {"K": 256}), ("slogym/Batching-v0", "vllm", {"K": 256}),
           ("slogym/Batching-v0", "edf", {"K": 256})]


@pytest.mark.parametrize("env_id,policy,kw", EXPERTS)
def test_expert_replay_equals_native_baseline(env_id, policy, kw):
    env = gym.make(env_id, scenario="mixed", rate_scale=2.0, episode=120, seed=0, pool_requests=600,
                   policy=policy, **kw)
    env.reset(seed=3)
    _, info = play(env, lambda e: e.unwrapped.expert_action())
    u = env.unwrapped
    native = Simulator(u.sim.w, u.engine, make_policy(policy, u.engine), u.n_instances, seed=u.sim.seed).run()
    assert u.sim.result().records.equals(native.result().records)
    assert info["summary"]["attainment"] == native.result().summary["attainment"]


def test_batching_expert_for_other_scheduler_changes_the_run():
    env = gym.make("slogym/Batching-v0", scenario="mixed", rate_scale=2.0, episode=120, seed=0,
                   pool_requests=600, K=256, policy="sarathi")
    env.reset(seed=3)
    _, edf = play(env, lambda e: e.unwrapped.expert_action("edf"))
    env.reset(seed=3)
    _, sar = play(env, lambda e: e.unwrapped.expert_action())
    assert edf["summary"]["iterations"] != sar["summary"]["iterations"]


def test_masks_exclude_exactly_the_requests_no_instance_can_hold():
    env = gym.make("slogym/Routing-v0", n_instances=2, **SMALL).unwrapped
    env.reset(seed=0)
    r = env._msg[1]
    assert env.action_masks().tolist() == [True, True, True]
    env.sim.instances[1].total_blocks = int(env.sim._max_ctx[r]) // env.sim.instances[1].block_size - 1
    assert env.action_masks().tolist() == [True, False, True]
    with pytest.raises(ValueError, match="masked"):
        env.step(1)
    adm = gym.make("slogym/Admission-v0", **SMALL).unwrapped
    adm.reset(seed=0)
    assert adm.action_masks().tolist() == [True, True, True]
    adm.sim.instances[0].total_blocks = 0
    assert adm.action_masks().tolist() == [False, False, True]


@pytest.mark.parametrize("env_id,kw,bad", [("slogym/Admission-v0", {}, 3), ("slogym/Routing-v0", {}, -1),
                                           ("slogym/Batching-v0", {"K": 4}, np.full(5, 2.0)),
                                           ("slogym/Batching-v0", {"K": 4}, np.full(5, np.nan)),
                                           ("slogym/Batching-v0", {"K": 4}, np.zeros(3)),
                                           ("slogym/Batching-v0", {"K": 4}, np.zeros((1, 5))),
                                           ("slogym/Admission-v0", {}, 1.5), ("slogym/Admission-v0", {}, 1.0),
                                           ("slogym/Admission-v0", {}, np.nan), ("slogym/Admission-v0", {}, None),
                                           ("slogym/Admission-v0", {}, "0"), ("slogym/Admission-v0", {}, True),
                                           ("slogym/Routing-v0", {}, np.array([0, 1])),
                                           ("slogym/Routing-v0", {}, np.array([0.0]))])
def test_invalid_actions_raise_with_space_and_value(env_id, kw, bad):
    env = gym.make(env_id, **SMALL, **kw)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(bad)


@pytest.mark.parametrize("kw,match", [({"scenario": "nope"}, "unknown scenario"), ({"rate_scale": -1.0}, "rate_scale"),
                                      ({"K": 0}, "K=0"), ({"reward": "fun"}, "unknown reward"),
                                      ({"policy": "magic"}, "unknown policy"), ({"split": "dev"}, "unknown split"),
                                      ({"n_instances": 0}, "n_instances"), ({"n_instances": 2.5}, "n_instances"),
                                      ({"seed": "x"}, "seed"), ({"episode": float("nan")}, "episode"),
                                      ({"episode": "10"}, "episode"), ({"pool_requests": 0}, "pool_requests")])
def test_bad_kwargs_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        gym.make("slogym/Batching-v0", **(SMALL | kw))


def test_splits_are_disjoint_and_test_is_held_out():
    tr = gym.make("slogym/Admission-v0", split="train", **SMALL).unwrapped
    te = gym.make("slogym/Admission-v0", split="test", **SMALL).unwrapped
    assert tr._range[1] == te._range[0] and tr._range[0] == 0 and te._range[1] == len(te.pool)
    for s in range(5):
        tr.reset(seed=s)
        assert tr.sim.w.name.startswith("chatbot[")
        lo = int(tr.sim.w.name.split("[")[1].split(":")[0])
        assert lo + len(tr.sim.w) <= tr._range[1]


@pytest.mark.parametrize("reward", ["goodput", "attainment", "service_gain"])
def test_reward_sums_match_the_run_summary(reward):
    env = gym.make("slogym/Admission-v0", reward=reward, **SMALL)
    env.reset(seed=2)
    rewards, info = play(env, lambda e: 0)
    s = info["summary"]
    expected = {"goodput": s["attainment"] * s["n_requests"], "attainment": s["attainment"],
                "service_gain": s["service_gain"] / 1000.0}[reward]
    assert sum(rewards) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("batch_timing", [None, True])
@pytest.mark.parametrize("env_id,kw", ENVS)
def test_native_vector_env_equals_independent_envs(env_id, kw, batch_timing):
    n = 3
    venv = gym.make_vec(env_id, num_envs=n, vectorization_mode="vector_entry_point", batch_timing=batch_timing,
                        **SMALL, **kw)
    envs = [gym.make(env_id, **SMALL, **kw) for _ in range(n)]
    obs, _ = venv.reset(seed=10)
    single = [e.reset(seed=10 + i)[0] for i, e in enumerate(envs)]
    assert all(np.array_equal(single[i][k], obs[k][i]) for i in range(n) for k in obs)
    venv.action_space.seed(0)
    ended = np.zeros(n, bool)
    for _ in range(60):
        acts = venv.action_space.sample()
        if "Batching" not in env_id:
            acts = np.zeros(n, np.int64)
        obs, rew, term, trunc, _ = venv.step(acts)
        for i, e in enumerate(envs):
            if ended[i]:
                o, r = e.reset()[0], 0.0
            else:
                o, r, _, _, _ = e.step(acts[i])
            assert r == rew[i]
            assert all(np.array_equal(o[k], obs[k][i]) for k in o)
        ended = term | trunc


def _same_info(a, b) -> bool:
    """Equal vector infos, apart from the wall-clock fields of summaries (two runs never share those) and the
    iteration counts of the shortcuts (batched timing runs without the compiled pilot; results are the same)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_info(a[k], b[k]) for k in a if k not in FF_FIELDS)
    if isinstance(a, np.ndarray) and a.dtype == object:
        return a.shape == b.shape and all(_same_info(x, y) for x, y in zip(a.tolist(), b.tolist()))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return a == b or (a != a and b != b)


def test_arrival_vector_env_writes_observations_in_place():
    """Admission-v0 / Routing-v0 sub-envs build their observations in the batch buffers; a single env's are its
    own arrays at every step."""
    venv = gym.make_vec("slogym/Routing-v0", num_envs=2, vectorization_mode="vector_entry_point", n_instances=2,
                        **SMALL)
    obs, _ = venv.reset(seed=1)
    rows = venv.unwrapped.envs[1].obs_rows
    obs, *_ = venv.step(np.zeros(2, np.int64))
    assert all(np.shares_memory(rows[k], obs[k][1]) for k in obs)
    env = gym.make("slogym/Routing-v0", n_instances=2, **SMALL)
    first, _ = env.reset(seed=1)
    second = env.step(0)[0]
    assert env.unwrapped.obs_rows is None and not any(np.shares_memory(first[k], second[k]) for k in first)


def test_native_vector_env_infos_and_batched_timing():
    """The vector infos have Gymnasium's ``_add_info`` layout (summary included when a sub-env ends), and the
    iterations of all sub-environments are timed together (one evaluator for their equal engines)."""
    from slogym.engines.arrays import BatchTimeEvaluator

    n = 4
    sizes: list[int] = []
    call = BatchTimeEvaluator.__call__

    def counting(self, f):
        sizes.append(len(f.decode_seqs))
        return call(self, f)

    venv = gym.make_vec("slogym/Admission-v0", num_envs=n, vectorization_mode="vector_entry_point",
                        batch_timing=True, **SMALL)
    envs = [gym.make("slogym/Admission-v0", **SMALL) for _ in range(n)]
    venv.reset(seed=4)
    for i, e in enumerate(envs):
        e.reset(seed=4 + i)
    BatchTimeEvaluator.__call__ = counting
    try:
        ended, n_summaries = np.zeros(n, bool), 0
        for _ in range(90):
            _, _, term, trunc, infos = venv.step(np.zeros(n, np.int64))
            want: dict = {}
            for i, e in enumerate(envs):
                info = e.reset()[1] if ended[i] else e.step(0)[4]
                n_summaries += "summary" in info
                want = venv.unwrapped._add_info(want, info, i)
            assert _same_info(infos, want)
            ended = term | trunc
    finally:
        BatchTimeEvaluator.__call__ = call
    assert n_summaries >= n  # every sub-env finished an episode: the summary path was compared too
    assert len(venv.unwrapped._evaluators) == 1 and max(sizes) == n
    # by default an engine with a compiled perf model times its own iterations (no round trips)
    auto = gym.make_vec("slogym/Admission-v0", num_envs=n, vectorization_mode="vector_entry_point", **SMALL)
    auto.reset(seed=4)
    sizes.clear()
    BatchTimeEvaluator.__call__ = counting
    try:
        for _ in range(20):
            auto.step(np.zeros(n, np.int64))
    finally:
        BatchTimeEvaluator.__call__ = call
    assert not sizes and not auto.unwrapped._evaluators


def test_sync_vector_env_runs():
    venv = gym.make_vec("slogym/Admission-v0", num_envs=2, vectorization_mode="sync", **SMALL)
    obs, _ = venv.reset(seed=0)
    obs, rew, *_ = venv.step(np.zeros(2, np.int64))
    assert rew.shape == (2,) and obs["request"].shape == (2, 8)


def test_render_modes():
    env = gym.make("slogym/Routing-v0", render_mode="ansi", n_instances=2, **SMALL)
    env.reset(seed=0)
    env.step(0)
    line = env.render()
    assert "route" in line and line.count("kv") == 2
    pytest.importorskip("matplotlib")
    env = gym.make("slogym/Batching-v0", render_mode="rgb_array", K=8, **SMALL)
    env.reset(seed=0)
    for _ in range(3):
        env.step(env.unwrapped.expert_action())
        img = env.render()
    assert img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8 and img.std() > 0


def test_routing_masks_decode_instances_on_a_pd_cluster():
    env = gym.make("slogym/Routing-v0", pd=(1, 2), policy="round-robin", **SMALL).unwrapped
    env.reset(seed=0)
    assert env.action_space.n == 4 and env.action_masks().tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="decode instance"):
        env.step(2)
    env.reset(seed=0)
    done, n = False, 0
    while not done:   # random masked actions run the P/D cluster to the end
        a = int(env.np_random.choice(np.flatnonzero(env.action_masks())))
        _, _, term, trunc, info = env.step(a)
        done, n = term or trunc, n + 1
    assert n > 0 and info["summary"]["kv_transfers"] > 0


def test_kv_link_bandwidth_is_an_env_kwarg():
    """``kv_gbps`` sets the P/D KV-transfer link: a slow link delays every second token (TPOT judged with it)."""
    tpot = {}
    for gbps in (0.5, 3600.0):
        env = gym.make("slogym/Routing-v0", pd=(1, 1), policy="distserve", kv_gbps=gbps, **SMALL).unwrapped
        env.reset(seed=0)
        assert env.sim.transfer.bandwidth_gbps == gbps
        done = False
        while not done:
            _, _, term, trunc, info = env.step(env.expert_action())
            done = term or trunc
        tpot[gbps] = info["summary"]["tpot_p50"]
    assert tpot[0.5] > tpot[3600.0]
    with pytest.raises(ValueError, match="kv_gbps"):
        gym.make("slogym/Routing-v0", kv_gbps=0.0)


def test_a_policy_that_resizes_the_cluster_stops_the_arrival_env_with_a_clear_error():
    """Routing-v0's spaces are sized for ``n_instances``: a policy whose scaler adds instances (HyperFlexis'
    threshold scaler) ends the episode with an error that says so, not observations and masks of another shape."""
    env = gym.make("slogym/Routing-v0", policy="hyperflexis-scaling", n_instances=2, scenario="chatbot",
                   rate_scale=3.0, episode=300, seed=0).unwrapped
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match="resized the cluster to 3 instances.*n_instances=2"):
        for _ in range(300):
            assert env.action_masks().size == 3
            env.step(env.expert_action())


def test_time_episodes_of_bursty_arrivals_always_hold_requests():
    """The ``code`` arrival pattern has silences longer than a 2 s episode: such windows are drawn again."""
    env = gym.make("slogym/Admission-v0", scenario="coder", episode=2.0, seed=0).unwrapped
    for seed in range(40):
        env.reset(seed=seed)
        assert len(env.sim.w) >= 1 and env.sim.w.arrival[-1] - env.sim.w.arrival[0] < 2.0


def test_batching_empty_batch_asks_again_after_idle_wait_and_an_agent_that_never_schedules_still_ends():
    env = gym.make("slogym/Batching-v0", **SMALL, K=256, idle_wait=0.05, stall_timeout=1.0).unwrapped
    env.reset(seed=0)
    skip = np.full(257, -0.5, np.float32)
    for _ in range(30):  # the instance holds requests: each empty batch is followed by a decision <= 0.05 s later
        t = env.sim.now
        _, _, done, _, info = env.step(skip)
        assert not done and info["time"] <= t + 0.05 + 1e-9
    # following vLLM from here on, nothing is lost to the skips
    _, info = play(env, lambda e: e.expert_action("vllm"))
    assert sum(info["summary"]["dropped_reasons"].values()) == 0
    # skipping everything after the last arrival used to end the episode at once, dropping every resident request
    env.reset(seed=0)
    while env.sim._na < len(env.sim.w):
        env.step(env.expert_action("vllm"))
    env.step(skip)
    _, info = play(env, lambda e: e.expert_action("vllm"))
    assert sum(info["summary"]["dropped_reasons"].values()) == 0
    # an agent that never schedules: re-asked for stall_timeout s per idle spell, then the episode ends
    env.reset(seed=0)
    _, info = play(env, lambda e: skip)
    assert info["summary"]["dropped_reasons"].get("never_scheduled", 0) > 0


def test_expert_actions_are_asked_once_per_decision():
    env = gym.make("slogym/Routing-v0", policy="round-robin", n_instances=3, **SMALL).unwrapped
    env.reset(seed=0)
    placed = []
    for _ in range(6):
        a = env.expert_action()
        assert env.expert_action() == a  # asking again does not advance round-robin's counter
        placed.append(a)
        env.step(a)
    assert placed == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("env_id", ["slogym/Admission-v0", "slogym/Routing-v0", "slogym/Batching-v0"])
def test_masks_and_experts_outside_an_episode_raise_clearly(env_id):
    env = gym.make(env_id, **SMALL).unwrapped
    for ask in (getattr(env, "action_masks", None), env.expert_action):
        if ask is not None:
            with pytest.raises(RuntimeError, match="reset"):
                ask()


def test_native_vector_env_rejects_a_batch_of_the_wrong_size():
    vec = gym.make_vec("slogym/Batching-v0", num_envs=2, vectorization_mode="vector_entry_point", K=4, **SMALL)
    vec.reset(seed=0)
    with pytest.raises(ValueError, match="3 actions for 2 environments"):
        vec.step(np.zeros((3, 5), np.float32))


def test_native_vector_env_reaches_masks_and_experts_through_call():
    kw = dict(SMALL, n_instances=2, policy="round-robin")
    vec = gym.make_vec("slogym/Routing-v0", num_envs=2, vectorization_mode="vector_entry_point", **kw)
    vec.reset(seed=0)
    masks = vec.call("action_masks")
    assert len(masks) == 2 and all(m.tolist() == [True, True, True] for m in masks)
    assert vec.call("expert_action") == (0, 0) and vec.get_attr("n_instances") == (2, 2)

"""slogym/Scaling-v0: checkers, seeding, reward = goodput - lam x cost, bounds, lifecycle, experts, serving."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import slogym  # noqa: F401
from helpers import WALL_FIELDS, assert_runs_equal
from slogym.agents import env_policy
from slogym.baselines import make_policy
from slogym.core.instance import InstanceState, Role
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome, Status
from slogym.envs.scaling import ROLE_POOLS, PoolLayout, ScalingEnv

SMALL = dict(scenario="coder", rate_scale=4.0, episode=60.0, seed=0, pool_requests=3000, control_interval=5.0)
TIERS = dict(scenario="polyserve-tiers", rate_scale=1.0, episode=30.0, seed=0, pool_requests=3000,
             control_interval=2.0, pools="tiers", n_instances=1, max_instances=3)
# PolyServe's tier autoscaling: its scheduler on every instance, its scaler's deltas as the expert; a load that
# makes tiers pend at the start and empties instances at the end
POLY = dict(TIERS, policy="polyserve-co", rate_scale=10.0, cold_start=1.0)
# prefill/decode role pools under HyperFlexis' P/D policy (its Dispatcher and Migrator route, its threshold scaler
# is the expert; Fast Scaling's d2d cold start), on a load that makes both stages scale and switch roles
ROLES = dict(scenario="chatbot", rate_scale=3.0, episode=30.0, seed=0, pool_requests=3000, control_interval=1.0,
             pools="roles", pd=(1, 1), max_instances=4, cold_start="d2d", policy="hyperflexis-pd-scaling")
ROLES_DS = dict(ROLES, policy="distserve", rate_scale=2.0, episode=15.0)


def play(env: gym.Env, pick) -> tuple[float, dict]:
    total, done, info = 0.0, False, {}
    while not done:
        _, r, done, _, info = env.step(pick(env))
        total += r
    return total, info


@pytest.mark.parametrize("kw", [SMALL, TIERS, POLY, ROLES, ROLES_DS])
def test_gymnasium_and_sb3_checkers(kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(gym.make("slogym/Scaling-v0", **kw).unwrapped, skip_render_check=True)
    sb3 = pytest.importorskip("stable_baselines3.common.env_checker", reason="stable-baselines3 not installed")
    sb3.check_env(gym.wrappers.FlattenObservation(gym.make("slogym/Scaling-v0", **kw)))


def test_spaces_follow_pools_and_tiers():
    env = gym.make("slogym/Scaling-v0", **TIERS).unwrapped
    n = env.n_tiers
    assert n > 1
    assert env.action_space == gym.spaces.MultiDiscrete([5] * n)
    obs, _ = env.reset(seed=0)
    assert obs["pools"].shape == (n, 8) and obs["arrivals"].shape == (n, 3)
    # every pool starts with n_instances active instances and serves only its own tier
    pools = [i.pool for i in env.sim.instances]
    assert sorted(pools) == list(range(n))
    done = False
    while not done:
        _, _, done, _, _ = env.step(env.action_space.sample())
    rs, w = env.sim.rs, env.sim.w
    served = rs.instance >= 0
    inst_pool = np.array([i.pool for i in env.sim.instances])
    assert np.array_equal(inst_pool[rs.instance[served]], w.tier[served])


def test_episode_return_is_goodput_minus_lam_cost_after_the_first_decision():
    lam = 0.3
    env = gym.make("slogym/Scaling-v0", **SMALL, lam=lam).unwrapped
    env.reset(seed=2)
    met0, cost0 = env._n_met, env._cost
    env.action_space.seed(0)
    total, info = play(env, lambda e: e.action_space.sample())
    s = info["summary"]
    assert s["cost_instance_seconds"] > 0
    expected = (info["slo_met"] - met0) - lam * (s["cost_instance_seconds"] - cost0)
    assert total == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_seeded_reset_gives_identical_episodes():
    runs = []
    for _ in range(2):
        env = gym.make("slogym/Scaling-v0", **SMALL)
        env.reset(seed=5)
        env.action_space.seed(3)
        total, info = play(env, lambda e: e.action_space.sample())
        runs.append((total, info["summary"]["cost_instance_seconds"], info["summary"]["attainment"]))
    assert runs[0] == runs[1]


def test_bounds_clip_and_masks():
    env = gym.make("slogym/Scaling-v0", **SMALL, n_instances=2, min_instances=1, max_instances=3).unwrapped
    env.reset(seed=0)
    # deltas -2..+2 -> with 2 instances in [1, 3]: -2 and +2 change nothing beyond the clip
    assert env.action_masks().tolist() == [False, True, True, True, False]
    env.step(np.array([4]))  # +2 clipped to +1
    live = [i for i in env.sim.instances if i.state in (InstanceState.ACTIVE, InstanceState.STARTING)]
    assert len(live) == 3
    assert env.action_masks().tolist() == [True, True, True, False, False]
    env.step(np.array([0]))  # -2 -> 1 instance left, always an active one
    states = [i.state for i in env.sim.instances]
    assert sum(s in (InstanceState.ACTIVE, InstanceState.STARTING) for s in states) == 1
    assert InstanceState.ACTIVE in states


def test_scale_up_pays_cold_start_and_drained_instances_stop():
    env = gym.make("slogym/Scaling-v0", **SMALL, n_instances=1, cold_start=3.0).unwrapped
    env.reset(seed=0)
    now = env.sim.now
    env.step(np.array([3]))  # +1
    new = env.sim.instances[1]
    assert new.started_at == now and new.ready_at == pytest.approx(now + 3.0)
    assert new.state == InstanceState.ACTIVE  # the step lasted one interval (5 s) > cold start
    env.step(np.array([1]))  # -1: the less loaded one drains, then stops
    play(env, lambda e: np.array([2]))
    stopped = [i for i in env.sim.instances if i.state == InstanceState.STOPPED]
    assert len(stopped) == 1 and stopped[0].stopped_at is not None


def test_static_expert_never_changes_the_cluster_and_threshold_scales():
    env = gym.make("slogym/Scaling-v0", **SMALL, n_instances=2).unwrapped
    env.reset(seed=1)
    _, info = play(env, lambda e: e.expert_action("static"))
    assert len(env.sim.instances) == 2
    assert info["summary"]["cost_instance_seconds"] == pytest.approx(2 * info["summary"]["sim_seconds"])
    env.reset(seed=1)
    actions = []
    play(env, lambda e: actions.append(e.expert_action("threshold")) or actions[-1])
    assert len({int(a[0]) for a in actions}) > 1  # it moves both ways on bursty arrivals
    with pytest.raises(ValueError, match="unknown expert"):
        env.expert_action("oracle")


def test_polyserve_tier_autoscaling_replayed_as_the_expert_equals_the_native_run():
    """PolyServe's scaler (§4.3: +1 for a tier whose requests pend, -1 for a tier with an empty instance)
    replayed through the env's actions gives the very run of the baseline served natively with the same pools
    (``baseline_policy("policy")``: the env's router, PolyServe's scheduler, the scaler's clipped deltas)."""
    env = gym.make("slogym/Scaling-v0", **POLY).unwrapped
    env.reset(seed=1)
    actions = []
    _, info = play(env, lambda e: actions.append(e.expert_action("policy")) or actions[-1])
    d = np.array(actions) - env.max_delta
    assert (d > 0).any() and (d < 0).any(), "the episode should make tiers scale up and return instances"
    assert len(env.sim.instances) > env.layout.n_pools  # scaled up: PolyServe's scheduler served added instances
    native = Simulator(env.sim.w, env.engine, env.baseline_policy("policy"), env.n_instances, seed=env.sim.seed,
                       attainment=env.attainment).run()
    assert_runs_equal(native.result(), env.sim.result(), WALL_FIELDS | {"policy"})  # the name differs
    timeline = [[(i.pool, i.started_at, i.ready_at, i.stopped_at) for i in s.instances] for s in (native, env.sim)]
    assert timeline[0] == timeline[1]
    assert sum(info["summary"]["outcomes"].values()) == len(env.sim.w)
    # one delta per tier pool: the single-pool layout cannot carry it
    single = gym.make("slogym/Scaling-v0", **(POLY | {"pools": "single"})).unwrapped
    single.reset(seed=1)
    with pytest.raises(ValueError, match="pools='single' has 1 pools"):
        single.expert_action("policy")


def test_agent_policy_in_a_plain_simulator_earns_the_env_return():
    """The agent served as a Policy (its observations built by attach/observe) gives the same run as stepping."""
    kw = dict(SMALL, split="test")
    env = gym.make("slogym/Scaling-v0", **kw).unwrapped
    env.reset(seed=4)
    act = lambda obs: np.array([3]) if obs["pools"][0, 4] > 0.1 else np.array([1])  # noqa: E731
    _, info = play(env, lambda e: act(e._last_obs))
    served = gym.make("slogym/Scaling-v0", **kw).unwrapped
    sim = Simulator(env.sim.w, env.engine, env_policy("rule", served, act), env.n_instances, seed=env.sim.seed)
    s = sim.run().result().summary
    assert s["cost_instance_seconds"] == pytest.approx(info["summary"]["cost_instance_seconds"])
    assert s["attainment"] == info["summary"]["attainment"]
    r = env.run_scaler(env.baseline_policy("static", 3), (env.sim.w, env.sim.seed), 3)
    assert r["reward"] == pytest.approx(r["gain"] - env.lam * r["instance_seconds"])
    # static: 3 instances for the whole run, whose length is (SLO-met requests) / goodput
    assert r["instance_seconds"] == pytest.approx(3 * r["gain"] / r["goodput"])


@pytest.mark.parametrize("kw,match", [({"pools": "pods"}, "unknown pools"), ({"pd": (1, 1)}, "needs pools='roles'"),
                                      ({"pools": "roles", "pd": (1, 9)}, r"pd \(9\) <= max_instances"),
                                      ({"pools": "roles", "policy": "polyserve-co"}, "cannot serve pools='roles'"),
                                      ({"control_interval": 0}, "control_interval"), ({"max_delta": 0}, "max_delta"),
                                      ({"lam": -1.0}, "lam"),
                                      ({"min_instances": 3, "n_instances": 2}, "min_instances"),
                                      ({"cold_start": "teleport"}, "teleport")])
def test_bad_parameters_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        gym.make("slogym/Scaling-v0", **(SMALL | kw))


@pytest.mark.parametrize("bad", [np.array([5]), np.array([-1]), np.array([1.5]), np.array([1, 1]), np.array([np.nan])])
def test_invalid_actions_raise(bad):
    env = gym.make("slogym/Scaling-v0", **SMALL)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(bad)


def test_rgb_render_draws_instances_added_during_the_episode():
    pytest.importorskip("matplotlib")
    env = gym.make("slogym/Scaling-v0", **SMALL, render_mode="rgb_array", n_instances=1, max_instances=4).unwrapped
    env.reset(seed=0)
    env.render()
    env.step(np.array([env.max_delta + 2]))  # +2 instances
    img = env.render()
    assert len(env.sim.instances) == 3 and img.ndim == 3 and img.std() > 0


@pytest.mark.parametrize("policy", ["rr-pd", "hyperflexis-pd"])
def test_prefill_decode_policies_are_refused_with_colocated_pools(policy):
    env = gym.make("slogym/Scaling-v0", **SMALL, policy=policy, n_instances=2)
    with pytest.raises(ValueError, match="colocated.*needs pools='roles'"):
        env.reset(seed=0)


class _RouteSpy(ScalingEnv):
    """Records the role of every instance the episode's router picks: new requests, and KV hand-offs."""

    def _configure(self, sim):
        super()._configure(sim)
        router, self.routed = sim.policy.router, []
        for kind in ("route", "route_decode"):
            def spy(r, s, t, f=getattr(router, kind), kind=kind):
                i = f(r, s, t)
                if i >= 0:
                    self.routed.append((kind, s.instances[i].role, s.instances[i].pool))
                return i
            setattr(router, kind, spy)


@pytest.mark.parametrize("policy", ["distserve", "hyperflexis-pd", "rr-pd", "sarathi"])
def test_role_pools_route_by_role_keep_kv_in_capacity_and_end_with_every_request_once(policy):
    """P/D policies are accepted with role pools: new requests go to the prefill pool, KV to the decode pool (the
    policy's own P/D-aware router), every pool's instances have its role (or are joining it by a role switch), no
    instance's KV exceeds its capacity, and every request reaches exactly one outcome."""
    env = _RouteSpy(**(ROLES_DS | {"policy": policy}))
    env.reset(seed=0)
    env.action_space.seed(1)
    done, info = False, {}
    while not done:
        _, _, done, _, info = env.step(env.action_space.sample())
        for inst in env.sim.instances:
            assert 0 <= inst.free_blocks <= inst.total_blocks
            if inst.state != InstanceState.STOPPED:
                assert (inst.switch_to or inst.role) == ROLE_POOLS[inst.pool]
    sim = env.sim
    assert {(k, role, pool) for k, role, pool in env.routed} == {("route", Role.PREFILL, 0),
                                                                 ("route_decode", Role.DECODE, 1)}
    assert sim.kv_transfers > 0 and len(sim.instances) > 2
    assert any(e[1] == "role_switch" for e in sim.events)  # random deltas of opposite signs switch roles
    outcomes = info["summary"]["outcomes"]
    assert sum(outcomes.values()) == len(sim.w)
    assert (sim.rs.outcome != Outcome.NONE).all() and (sim.rs.status == Status.DONE).all()
    assert all(i.empty for i in sim.instances)  # nothing left resident, parked or in flight


def test_role_pools_seeded_episodes_are_identical_and_masks_cover_both_pools():
    runs = []
    for _ in range(2):
        env = gym.make("slogym/Scaling-v0", **ROLES_DS).unwrapped
        obs, _ = env.reset(seed=4)
        assert env.action_space == gym.spaces.MultiDiscrete([5, 5]) and obs["pools"].shape == (2, 8)
        assert env.action_masks().tolist() == [False, False, True, True, True] * 2  # 1 instance each, in [1, 4]
        env.action_space.seed(2)
        total, info = play(env, lambda e: e.action_space.sample())
        runs.append((total, info["summary"]["cost_instance_seconds"], info["summary"]["attainment"],
                     [(e[0], e[1], e[3]) for e in env.sim.events if e[2] == -1]))
    assert runs[0] == runs[1]


def test_opposite_role_deltas_switch_an_instance_instead_of_starting_one():
    env = gym.make("slogym/Scaling-v0", **(ROLES_DS | {"pd": (2, 1)})).unwrapped
    env.reset(seed=0)
    k = env.max_delta
    env.step(np.array([k - 1, k + 1]))  # prefill -1, decode +1: one role switch, no new instance
    sim = env.sim
    assert len(sim.instances) == 3 and all(i.started_at == 0.0 for i in sim.instances)
    switched = [i for i in sim.instances if i.pool == 1 and i.id < 2]
    assert len(switched) == 1 and (switched[0].switch_to or switched[0].role) == Role.DECODE
    assert env.layout.sizes(sim).tolist() == [1, 2]
    assert any(e[1] == "role_switch" and e[3] == switched[0].id for e in sim.events)
    # the switched instance counts in the decode pool (joining while it drains), so the bound applies to it
    assert env.action_masks().tolist()[5:] == [False, True, True, True, True]  # 2 in [1, 4]: -2 is clipped


def test_hyperflexis_pd_scaler_replayed_in_role_pools():
    """HyperFlexis' P/D threshold scaler (§6, Algorithm 3) replayed as the expert gives the run of
    ``baseline_policy("policy")`` (its deltas clipped by the env, served natively), its role switches included;
    on a window where none of the stated differences arises (a refused switch, the bounds; the instances given up
    differ only when idle) it is the native ``hyperflexis-pd-scaling`` run, and on one where another busy instance
    drains it still takes the same scaling decisions (time, kind, role) as the native run."""
    env = gym.make("slogym/Scaling-v0", **ROLES).unwrapped

    def replay(seed: int) -> tuple[Simulator, dict]:
        env.reset(seed=seed)
        return env.sim, play(env, lambda e: e.expert_action("policy"))[1]

    def native(policy) -> Simulator:
        return Simulator(env.sim.w, env.engine, policy, pd=env.pd, seed=env.sim.seed,
                         attainment=env.attainment).run()

    def decisions(sim: Simulator) -> list[tuple]:
        return [(e[0], e[1], Role(e[4]) if e[1] != "instance_drain" else None) for e in sim.events
                if e[1] in ("instance_start", "instance_drain", "role_switch") and e[0] == round(e[0])]

    sim, info = replay(1)
    assert any(e[1] == "role_switch" for e in sim.events) and len(sim.instances) > 3
    assert sum(info["summary"]["outcomes"].values()) == len(sim.w)
    assert_runs_equal(native(env.baseline_policy("policy")).result(), sim.result(), WALL_FIELDS | {"policy"})
    own = native(make_policy("hyperflexis-pd-scaling", env.engine))
    assert decisions(own) == decisions(sim)
    sim, _ = replay(2)
    own = native(make_policy("hyperflexis-pd-scaling", env.engine))
    # the end of the run may count a last scaler tick, which the core's timer and the env's generator tick (the
    # ensure_cluster_api mixin) can place a few ms apart: cost fields are compared as instance timelines
    end = {"cost_instance_seconds", "cost_per_request", "utilization"}
    assert_runs_equal(own.result(), sim.result(), WALL_FIELDS | {"policy"} | end)
    assert decisions(own) == decisions(sim)
    assert own.result().summary["cost_instance_seconds"] == pytest.approx(sim.result().summary["cost_instance_seconds"],
                                                                          abs=0.01)


def test_role_pools_take_only_per_role_scaler_deltas():
    layout = PoolLayout("roles", 2, (1, 1), 1, 4, "d2d")

    class PerTier:
        def deltas(self, sim, now):
            return np.zeros(2, np.int64)

    with pytest.raises(ValueError, match="not per prefill/decode role"):
        layout.deltas_of(PerTier(), None, 0.0)


def test_baseline_runs_use_the_envs_kv_link():
    """``run_scaler`` (baseline scores) replays on the env's own cluster: its P/D split and its KV link."""
    kw = dict(SMALL, pools="roles", pd=(1, 1), policy="distserve")
    slow = gym.make("slogym/Scaling-v0", kv_gbps=0.5, **kw).unwrapped
    fast = gym.make("slogym/Scaling-v0", **kw).unwrapped
    slow.reset(seed=4)
    win = (slow.sim.w, slow.sim.seed)
    a = slow.run_scaler(slow.baseline_policy("static"), win)
    b = fast.run_scaler(fast.baseline_policy("static"), win)
    assert a["attainment"] < b["attainment"]

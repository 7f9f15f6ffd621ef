"""The compiled env kernels against plain-Python / NumPy oracles written from the documented rules, on live
simulator states (busy instances: many running requests, a queue, KV pressure)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import slogym  # noqa: F401
from slogym.baselines.common import BatchBuilder
from slogym.core.batch import BatchFeatures
from slogym.envs import base, kernels
from slogym.envs.base import CLIP, log_token_table, log_tokens
from slogym.envs.batching import PREEMPT, SKIP, budget_of


def busy_batching_env(steps: int = 150, **kw):
    """A Batching-v0 env driven by random scores into a loaded state (random scores preempt and skip)."""
    env = gym.make("slogym/Batching-v0", scenario="chatbot", rate_scale=3.0, episode=300, seed=0,
                   pool_requests=1000, **kw).unwrapped
    env.reset(seed=1)
    env.action_space.seed(2)
    for _ in range(steps):
        env.step(env.action_space.sample())
    return env


def form_oracle(inst, cands: list[int], sc: list[float], level: float):
    """Batching-v0's batch rules (module docstring) one candidate at a time with the shared BatchBuilder."""
    rs = inst.sim.rs
    running = set(inst.running)
    preempt = [r for r, s in zip(cands, sc) if s < PREEMPT and r in running]
    free = inst.free_blocks + sum(int(rs.kv_blocks[r]) for r in preempt)
    order = sorted((i for i, s in enumerate(sc) if s >= SKIP), key=lambda i: -sc[i])
    victims = sorted((i for i, s in enumerate(sc) if cands[i] in running and s >= PREEMPT), key=lambda i: sc[i])
    b = BatchBuilder(inst, budget_of(level), free)
    for i in order:
        if b.full:
            break
        r = cands[i]
        if r in preempt:
            continue
        if b.is_decode(r):
            while b.decode_need(r) > b.free and victims and sc[victims[0]] < sc[i]:
                v = cands[victims.pop(0)]
                if v not in b.reqs and v not in preempt:
                    preempt.append(v)
                    b.free += int(rs.kv_blocks[v])
        b.take(r)
    return b.reqs, b.toks, preempt


def test_form_batch_follows_the_scoring_rules():
    env = busy_batching_env()
    rng = np.random.default_rng(0)
    checked = preempted = 0
    for _ in range(60):
        inst = env._msg[1]
        cands, n_run = env._candidates()
        assert cands.tolist() == (inst.running + inst.waiting)[: env.K]
        for _ in range(5):
            # coarse scores make ties (candidate order decides) and every band (preempt / skip / schedule) likely
            sc = np.round(rng.uniform(-1, 1, cands.size), 1)
            level = float(rng.uniform(-1, -0.9))  # budgets of 16..1.6k tokens: some batches end on the budget
            reqs, toks, pre = kernels.form_batch(env.sim.rs.I, cands, sc, n_run, inst.free_blocks, budget_of(level),
                                                 inst.block_size, PREEMPT, SKIP)
            want = form_oracle(inst, cands.tolist(), sc.tolist(), level)
            assert (reqs.tolist(), toks.tolist(), pre.tolist()) == want
            checked += 1
            preempted += len(want[2]) > 0
        env.step(env.action_space.sample())
    assert checked == 300 and preempted > 0


def test_candidate_features_match_the_numpy_definition():
    env = busy_batching_env()
    for _ in range(30):
        _, inst, now = env._msg
        rs, w = env.sim.rs, env.sim.w
        c = np.array((inst.running + inst.waiting)[: env.K], dtype=np.int64)
        n = c.size
        want = np.zeros((env.K, 10), np.float32)
        rem = rs.num_tokens[c] - rs.num_computed[c]
        want[:n] = np.column_stack([
            rs.status[c] == 4, rem == 1, log_tokens(rem), log_tokens(rs.num_tokens[c]), log_tokens(rs.generated[c]),
            log_tokens(env.predictor.predict(w.app[c])[:, -1]),
            np.nan_to_num(rs.next_deadline(w, c) - now, posinf=CLIP),
            np.minimum(w.min_tpot[c] / 0.1, CLIP), now - rs.ready[c], w.best_effort[c],
        ])
        obs = env._observe()
        assert np.array_equal(obs["candidates"], np.clip(want, -CLIP, CLIP))
        assert obs["valid"].sum() == n
        env.step(env.action_space.sample())


@pytest.mark.parametrize("compiled", [True, False])
def test_arrival_cluster_features_match_the_numpy_definition(compiled):
    """Load, slack and placed_since features against their definitions; the decode-step time both from the
    compiled perf model in the kernel and (``compiled=False``) from the Python path's memo."""
    env = gym.make("slogym/Routing-v0", scenario="mixed", rate_scale=3.0, n_instances=3, episode=300, seed=0,
                   pool_requests=1000).unwrapped
    env.reset(seed=1)
    assert np.isfinite(env._coef).all()  # the preset's perf model has a compiled form
    if not compiled:
        env._coef[:] = np.nan
    env.action_space.seed(2)
    placed: list[int] = []
    for _ in range(80):
        sim, now = env.sim, env._msg[2]
        rs, w = sim.rs, sim.w
        slack = np.full((3, env.n_tiers), CLIP, np.float32)
        inst_f = np.zeros((3, 5), np.float32)
        for i, inst in enumerate(sim.instances):
            if inst.waiting:
                inst_f[i, 0] = float((rs.num_tokens[inst.waiting] - rs.num_computed[inst.waiting]).sum()) / 8192.0
            inst_f[i, 1:4] = len(inst.waiting) / 64.0, len(inst.running) / inst.engine.max_num_seqs, inst.kv_utilization
            if inst.running:
                run = np.array(inst.running)
                ctx = int((rs.num_computed[run] + 1).sum())
                inst_f[i, 4] = inst.time_one(BatchFeatures(0, 0, 0, 0, run.size, run.size, ctx, ctx, 0)) / 0.1
                s = np.clip(rs.next_deadline(w, run) - now, -CLIP, CLIP).astype(np.float32)
                np.minimum.at(slack[i], w.tier[run], s)
        obs = env._observe()
        assert np.array_equal(obs["instances"], np.clip(inst_f, -CLIP, CLIP))
        assert np.array_equal(obs["slack"], slack)
        # requests placed elsewhere since the last placement on each instance (all of them if none yet)
        since = [len(placed) - 1 - max(k for k, p in enumerate(placed) if p == i) if i in placed else len(placed)
                 for i in range(3)]
        assert np.array_equal(obs["placed_since"], np.minimum(np.array(since, np.float32) / 3, CLIP))
        a = int(np.flatnonzero(env.action_masks())[0]) if env.np_random.random() < 0.2 else env.expert_action()
        env.step(a)
        placed += [a] if a < 3 else []  # 3 defers: places nothing
    assert compiled or (env._memo_nc >= 0).any()  # the Python path timed (and remembered) decode steps


@pytest.mark.parametrize("kw", [dict(scenario="mixed", rate_scale=3.0, engine="llama2-70b-a100-tp2"),
                                dict(scenario="chatbot", rate_scale=1.0)])
def test_resident_scan_finds_the_instances_queues(kw, monkeypatch):
    """The arrival observation's scan of the request states finds each instance's waiting and running requests
    (as sets, grouped by instance, counted in ``shape``) exactly as its lists hold them, and the observation is the
    same either way: on a small KV with requests deferred to the global queue and preempted, and on a light load
    where the scan starts past the requests all finished."""
    env = gym.make("slogym/Routing-v0", n_instances=3, episode=300, seed=0, pool_requests=1000, **kw).unwrapped
    env.reset(seed=4)
    env.action_space.seed(5)
    done = False
    lo_max = deferred = 0
    scan_max = base.SCAN_MAX
    while not done:
        insts = env.sim.instances
        run, wait, shape = env._resident_inputs(insts)
        run_l, wait_l, shape_l = env._load_inputs(insts)
        assert np.array_equal(shape, shape_l)
        k_run = k_wait = 0
        for i, inst in enumerate(insts):  # grouped by instance, each group the instance's list as a set
            n_wait, n_run = shape[6 * i: 6 * i + 2]
            assert sorted(wait[k_wait: k_wait + n_wait].tolist()) == sorted(inst.waiting)
            assert sorted(run[k_run: k_run + n_run].tolist()) == sorted(inst.running)
            k_wait += n_wait
            k_run += n_run
        assert (k_run, k_wait) == (run.size, wait.size) == (run_l.size, wait_l.size)
        obs = {k: v.copy() for k, v in env._observe().items()}
        lo = env._lo
        monkeypatch.setattr(base, "SCAN_MAX", -1)  # every stretch beyond the scan's reach: the lists are gathered
        assert all(np.array_equal(obs[k], v) for k, v in env._observe().items())
        monkeypatch.setattr(base, "SCAN_MAX", scan_max)
        assert env._lo == lo  # the scan's start advances either way
        lo_max, deferred = max(lo_max, lo), max(deferred, len(env.sim.global_queue))
        _, _, done, _, _ = env.step(env.action_space.sample())
    if "engine" in kw:
        assert env.sim.rs.n_preempt.sum() > 0 and deferred > 0
    else:
        assert lo_max > 100  # requests finished before the scan's start were skipped


def test_log_token_table_is_log_tokens_bit_for_bit():
    x = np.random.default_rng(0).integers(0, 300_000, 5000)
    table = log_token_table(int(x.max()) + 1)
    assert table.size > x.max()
    assert np.array_equal(table[x], log_tokens(x))
    assert all(table[v] == log_tokens(v) for v in x[:50].tolist())


def test_expert_batch_beyond_K_raises_naming_the_requests():
    env = busy_batching_env(steps=40, K=2)
    with pytest.raises(ValueError, match=r"not among the first K=2 candidates"):
        for _ in range(200):  # some Sarathi batch soon holds more than 2 requests
            env.step(env.expert_action())


def loaded_runs():
    """Finished runs under overload with every served/unserved kind: SLO misses, best-effort demotions
    (SLOs-Serve), rejections (HyperFlexis), in each attainment mode."""
    from slogym.baselines import make_policy
    from slogym.core.simulator import Simulator
    from slogym.engines.registry import get_engine
    from slogym.workloads.scenarios import make_workload

    eng = get_engine("llama3-8b-h100")
    for scenario, mode, policy in [("mixed", "dslo", "slos-serve"), ("polyserve-tiers", "strict", "hyperflexis"),
                                   ("sa-mix", "mean_tpot", "vllm"), ("tempo-mix", "ttlt", "tempo")]:
        w = make_workload(scenario, n_requests=240, seed=4, engine=eng)
        rate = 6.0 if scenario == "sa-mix" else 4.0
        yield Simulator(w.with_arrivals(w.arrival / rate), eng, make_policy(policy, eng), 1, seed=1,
                        attainment=mode).run()


def verdict_oracle(sim, mode: str) -> np.ndarray:
    """slogym.core.metrics' SLO rules (module docstring) as whole-array NumPy expressions."""
    from slogym.core.metrics import EPS
    from slogym.core.state import Outcome

    rs, w = sim.rs, sim.w
    served = (rs.outcome == Outcome.FINISHED) | (rs.outcome == Outcome.BEST_EFFORT)
    ttlt_ok = rs.finish - w.arrival <= w.ttlt + EPS
    ttft_ok = rs.ttft_slack >= -EPS
    ok = {"strict": ttft_ok & (rs.tpot_slack >= -EPS), "dslo": ttft_ok & (rs.dslo_slack >= -EPS),
          "mean_tpot": ttft_ok & (rs.mean_slack >= -EPS),
          "ttlt": rs.finish <= np.where(np.isfinite(w.ttlt), w.arrival + w.ttlt, rs.final_deadline) + EPS}[mode]
    return served & (ok & ttlt_ok | w.best_effort)


def test_slo_verdicts_and_env_credit_follow_the_rules():
    from slogym.core.metrics import MODES, slo_verdicts, verdict_arrays

    for sim in loaded_runs():
        got = slo_verdicts(sim)
        for m in MODES:
            want = verdict_oracle(sim, m)
            assert np.array_equal(got[m], want), m
            assert 0 < want.sum() < len(want) or m != sim.attainment  # the runs' own modes mix hits and misses
        idx = np.random.default_rng(0).permutation(len(sim.w))[:50]
        idx[-3:] = idx[:3]  # ties in finish time keep their order
        in_time = idx[np.argsort(sim.rs.finish[idx], kind="stable")]  # the EWMA follows outcomes in time order
        met = verdict_oracle(sim, sim.attainment)[in_time]
        ewma = 0.3
        for m in met.tolist():
            ewma = 0.95 * ewma + 0.05 * float(m)
        n_met, got_ewma = kernels.credit(idx, MODES.index(sim.attainment), 0.3, *verdict_arrays(sim))
        assert (n_met, got_ewma) == (int(met.sum()), ewma)
        assert np.array_equal(idx, in_time)  # sorted in place (the service-gain reward sums in this order)


def test_run_summary_equals_its_pandas_definition_on_the_records():
    """``run_summary`` (array-based, what the env's terminal step reports) against the summary's definition
    on the per-request table, bit for bit."""
    from slogym.core.metrics import MODES, run_summary

    for sim in loaded_runs():
        df, s = sim.result().records, run_summary(sim)
        scored = df[~sim.w.best_effort]
        served = df["outcome"].isin(("finished", "best_effort"))
        span = max(sim.end_time - float(sim.w.arrival[0]), 1e-9)
        assert s["attainment"] == scored["slo_met"].mean()
        assert s["attainment_by_app"] == dict(scored.groupby("app")["slo_met"].mean().items())
        assert s["attainment_by_tier"] == dict(scored.groupby("tier")["slo_met"].mean().items())
        assert s["attainment_modes"] == {m: scored[f"slo_met_{m}"].mean() for m in MODES}
        assert s["goodput"] == int(df["slo_met"].sum()) / span
        assert s["throughput"] == float(served.sum()) / span
        assert s["service_gain"] == df["service_gain"].sum()
        assert s["sa_objective"] == s["attainment"] / df.loc[served, "ttlt"].mean()
        assert s["outcomes"] == {k: int((df["outcome"] == k).sum()) for k in s["outcomes"]}
        assert sum(s["outcomes"].values()) == len(df)
        for col, name in (("ttft", "ttft"), ("mean_tpot", "tpot"), ("ttlt", "ttlt")):
            x = df.loc[served, col].to_numpy()
            x = x[np.isfinite(x)]
            assert s[f"{name}_p90"] == np.percentile(x, 90) and s[f"{name}_mean"] == x.mean()

"""Property tests of the simulator core over random workloads x every baseline policy and router.

Checked on every run: exactly one outcome per request; KV never over capacity and exactly accounted (checked
before every scheduling decision by :class:`helpers.InvariantScheduler`); per-instance time monotonic; per-request
time order; token conservation (vLLM-v1 accounting, recompute recorded); preemptions logged; collective ordering.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ToyEngine
from helpers import (InvariantScheduler, SpecScheduler, check_instance, expected_compute, max_context, served_mask,
                     toy_engines, workloads)
from slogym.baselines import make_policy
from slogym.core.batch import Batch
from slogym.core.policy import Policy, Scheduler
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome, Status

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def run_checked(w: Workload, engine, policy_name: str, router: str, n_instances: int, params: dict,
                spec: int = 0, fast_forward: bool = True) -> Simulator:
    pol = make_policy(policy_name, engine, router=router, **params)
    inv = InvariantScheduler(SpecScheduler(pol.scheduler, spec) if spec else pol.scheduler)
    pol.scheduler = inv
    sim = Simulator(w, engine, pol, n_instances=n_instances, seed=3, fast_forward=fast_forward).run()
    return sim


def check_run(sim: Simulator) -> None:
    w, rs = sim.w, sim.rs
    n = len(w)
    # --- exactly one outcome, nothing left behind
    assert (rs.outcome != Outcome.NONE).all(), np.flatnonzero(rs.outcome == Outcome.NONE)
    assert (rs.status == Status.DONE).all()
    res = sim.result()
    assert sum(res.summary["outcomes"].values()) == n
    assert set(res.records["outcome"]) <= {"finished", "rejected", "best_effort", "dropped", "failed"}
    assert sum(sim.dropped_reasons.values()) == int((rs.outcome == Outcome.DROPPED).sum())
    for inst in sim.instances:
        assert inst.free_blocks == inst.total_blocks and not inst.waiting and not inst.running
        check_instance(sim, inst)
    # --- requests whose whole context cannot fit are dropped with the documented reason; the others are served
    cap = np.array([sim.instances[0].total_blocks * sim.instances[0].block_size])
    too_big = max_context(w) > cap
    assert (rs.outcome[too_big] == Outcome.DROPPED).all()
    assert sim.dropped_reasons.get("exceeds_kv_capacity", 0) == int(too_big.sum())
    served = served_mask(rs)
    assert served[~too_big].all(), (f"requests that fit KV but were not served: "
                                    f"{np.flatnonzero(~too_big & ~served)}, reasons {sim.dropped_reasons}")
    # --- token conservation
    assert (rs.generated[served] == w.output_tokens[served]).all()
    assert (rs.computed_total[served] == expected_compute(w)[served] + rs.recomputed[served]).all()
    assert (rs.computed_total >= 0).all() and (rs.recomputed >= 0).all()
    # --- every preemption recorded, in the event log and in the counters
    pre = [e for e in sim.events if e[1] == "preempt"]
    per_req = np.bincount(np.array([e[2] for e in pre], dtype=np.int64), minlength=n)
    assert (per_req == rs.n_preempt).all()
    rec = np.zeros(n, np.int64)
    for e in pre:
        rec[e[2]] += e[4]
    assert (rec == rs.recomputed).all()
    assert res.summary["preemptions"] == len(pre)
    # --- time order per request
    s = served & (w.output_tokens > 0)
    a, fs, ft, lt, fin = w.arrival[s], rs.first_scheduled[s], rs.first_token[s], rs.last_token[s], rs.finish[s]
    assert (a <= fs).all() and (fs <= ft).all() and (ft <= fin).all()
    has_dec = rs.generated[s] > 0
    assert (ft[has_dec] <= lt[has_dec]).all() and (lt[has_dec] <= fin[has_dec]).all()
    assert (rs.finish[~np.isnan(rs.finish)] >= w.arrival[~np.isnan(rs.finish)]).all()
    assert (rs.max_gap >= 0).all()
    # --- collective groups: a stage starts only after every earlier stage of its group has finished
    for g in np.unique(w.group[w.group >= 0]):
        m = w.group == g
        for stg in np.unique(w.group_stage[m]):
            if stg == 0:
                continue
            before = m & (w.group_stage < stg)
            later = m & (w.group_stage == stg) & ~np.isnan(rs.first_scheduled)
            if later.any():
                assert rs.first_scheduled[later].min() >= rs.finish[before].max()


POLICIES = st.sampled_from(["vllm", "sarathi", "edf"])
ROUTERS = st.sampled_from(["round-robin", "random", "least-load"])


@settings(max_examples=140, **SETTINGS)
@given(w=workloads(), engine=toy_engines(), policy=POLICIES, router=ROUTERS, n_inst=st.integers(1, 3),
       budget=st.sampled_from([8, 64, 512]), spec=st.sampled_from([0, 0, 0, 2]))
def test_random_workloads_keep_invariants(w, engine, policy, router, n_inst, budget, spec):
    params = {} if policy == "vllm" else {"token_budget": budget}
    sim = run_checked(w, engine, policy, router, n_inst, params, spec=spec)
    check_run(sim)


# ------------------------------------------------------------------------------------ targeted cases
@pytest.mark.parametrize("policy", ["vllm", "sarathi", "edf"])
def test_tiny_kv_forces_preemption_and_recompute_is_recorded(policy):
    """Many long decodes on a KV of 512 tokens: preemption must happen, and every invariant still holds."""
    eng = ToyEngine(kv_capacity_tokens=512, block_size=16)
    w = Workload.from_requests([Request(0.001 * i, [prefill(40), decode(150)]) for i in range(8)])
    sim = run_checked(w, eng, policy, "round-robin", 1, {})
    check_run(sim)
    assert sim.rs.n_preempt.sum() > 0
    assert sim.rs.recomputed.sum() > 0
    assert (sim.rs.outcome == Outcome.FINISHED).all()


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "edf"])
def test_prompt_larger_than_kv_is_dropped(policy):
    eng = ToyEngine(kv_capacity_tokens=256, block_size=16)
    w = Workload.from_requests([Request(0.0, [prefill(100), decode(10)]), Request(0.01, [prefill(300), decode(5)]),
                                Request(0.02, [prefill(250), decode(7)]),  # prompt fits, prompt+output does not
                                Request(0.03, [prefill(200), decode(56)])])  # exactly the capacity
    sim = run_checked(w, eng, policy, "round-robin", 1, {})
    check_run(sim)
    out = sim.result().records["outcome"].tolist()
    assert out == ["finished", "dropped", "dropped", "finished"]
    assert sim.dropped_reasons == {"exceeds_kv_capacity": 2}


def test_tool_call_keeps_kv_parked_on_instance():
    """While a request is in its tool call, its KV stays allocated on its instance (and is freed at the end)."""
    from slogym.core.request import external

    eng = ToyEngine()
    w = Workload.from_requests([Request(0.0, [prefill(64), decode(5), external(1.0), prefill(10), decode(3)])])
    pol = make_policy("vllm", eng)
    sim = Simulator(w, eng, pol)
    seen = []
    orig = sim._on_external_done

    def spy(r, t):
        seen.append((int(sim.rs.status[r]), int(sim.rs.kv_blocks[r]), sim.instances[0].free_blocks))
        yield from orig(r, t)

    sim._on_external_done = spy
    sim.run()
    (status, kv, free), = seen
    assert status == Status.EXTERNAL
    assert kv == -(-(64 + 4) // 16)  # prompt + 4 computed output tokens (the 5th is sampled, not computed)
    assert free == sim.instances[0].total_blocks - kv
    assert sim.instances[0].free_blocks == sim.instances[0].total_blocks


# ------------------------------------------------------------------------------------ collective groups
def test_collective_stage_starts_after_previous_stage_finishes():
    eng = ToyEngine()
    reqs = [Request(0.0, [prefill(50), decode(30)], group=0, group_stage=0),
            Request(0.0, [prefill(30), decode(3)], group=0, group_stage=0),
            Request(0.0, [prefill(20), decode(2)], group=0, group_stage=1),
            Request(0.0, [prefill(20), decode(4)], group=0, group_stage=2),
            Request(0.0, [prefill(10), decode(40)])]  # standalone, runs immediately
    w = Workload.from_requests(reqs)
    for policy in ("vllm", "sarathi", "edf"):
        sim = run_checked(w, eng, policy, "round-robin", 1, {})
        check_run(sim)
        rs = sim.rs
        assert (rs.outcome == Outcome.FINISHED).all()
        stage0_end = max(rs.finish[0], rs.finish[1])
        # released when the last stage-0 request finishes; it joins at the next iteration boundary (the
        # standalone request's decode iteration starting at that same instant is already committed)
        assert stage0_end <= rs.first_scheduled[2] < stage0_end + 0.01
        assert rs.finish[2] <= rs.first_scheduled[3] < rs.finish[2] + 0.01
        assert rs.finish[2] < rs.finish[4]  # the standalone request was still running meanwhile
        assert rs.first_scheduled[4] < stage0_end  # not held: it is no member of the group
        # TTFT is reported from the group's arrival
        assert sim.result().records["ttft"][3] == rs.first_token[3] - 0.0 > rs.finish[2]


# ------------------------------------------------------------------------------------ speculation
class SpecDecodeScheduler(Scheduler):
    """Every waiting prompt whole, then every running request decodes with speculation length ``sl``."""

    def __init__(self, sl: int) -> None:
        self.sl = sl

    def next_batch(self, inst, now):
        if inst.waiting:
            r = inst.waiting[0]
            return Batch(req=np.array([r]), tokens=inst.remaining([r]))
        if not inst.running:
            return None
        idx = np.array(inst.running, dtype=np.int64)
        return Batch(req=idx, tokens=np.ones(idx.size, np.int64), spec=np.full(idx.size, self.sl, np.int64))


class _Probe(Scheduler):
    """Records (generated, computed, kv_blocks) of every request at each decision."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def reset(self, sim):
        self.sim = sim

    def next_batch(self, inst, now):
        rs = self.sim.rs
        check_instance(self.sim, inst)
        self.log.append((now, rs.generated.copy(), rs.num_computed.copy(), rs.kv_blocks.copy()))
        return self.inner.next_batch(inst, now)


def _spec_run(acceptance: float, seed: int, sl: int = 3, out: int = 40, block_size: int = 1, n: int = 1):
    eng = ToyEngine(block_size=block_size)
    w = Workload.from_requests([Request(0.0, [prefill(16), decode(out + i)]) for i in range(n)])
    probe = _Probe(SpecDecodeScheduler(sl))
    sim = Simulator(w, eng, Policy("spec", probe), seed=seed, spec_acceptance=acceptance).run()
    return sim, probe.log


def test_speculation_emits_accepted_plus_one_and_frees_rejected_drafts():
    sim, log = _spec_run(0.7, seed=11)
    rs = sim.rs
    assert rs.outcome[0] == Outcome.FINISHED and rs.generated[0] == 40
    assert rs.computed_total[0] == 16 + 39  # only accepted drafts + the verified token enter the KV
    gens = np.array([g[0] for _, g, _, _ in log] + [rs.generated[0]])
    steps = np.diff(gens)[1:]  # after the prefill iteration (which emits the first token)
    assert ((steps >= 1) & (steps <= 4)).all()  # 1 + accepted, accepted <= sl
    assert (steps > 1).any() and (steps == 1).any()  # p = 0.7: both outcomes happen over ~15 iterations
    for _, g, nc, kv in log[1:]:
        # block size 1: the KV holds exactly the computed tokens, rejected drafts were freed
        assert kv[0] == nc[0] == 16 + g[0] - 1


def test_speculation_acceptance_extremes_give_exact_iteration_counts():
    sim0, _ = _spec_run(0.0, seed=1)   # every draft rejected: one token per iteration
    assert sim0.instances[0].iterations == 1 + 39
    sim1, _ = _spec_run(0.999999999, seed=1)  # all accepted: 4 per iteration, capped at the stage end
    assert sim1.instances[0].iterations == 1 + 10
    assert sim1.rs.generated[0] == 40 and sim1.rs.computed_total[0] == 55
    # decode-time gaps: the accepted drafts and the bonus token are emitted at the same time
    assert sim1.rs.max_gap[0] > 0


def test_speculation_is_seeded():
    a, _ = _spec_run(0.6, seed=5, n=3, block_size=4)
    b, _ = _spec_run(0.6, seed=5, n=3, block_size=4)
    c, _ = _spec_run(0.6, seed=6, n=3, block_size=4)
    assert a.result().records.equals(b.result().records)
    assert np.array_equal(a.rs.last_token, b.rs.last_token)
    assert a.instances[0].iterations == b.instances[0].iterations
    assert not np.array_equal(a.rs.finish, c.rs.finish)  # another seed draws other acceptances


def test_spec_on_last_prefill_chunk_is_rejected_or_harmless():
    """prefill(17) chunked 8+8+1: the final 1-token chunk has remaining == 1 but is not a decode step. A scheduler
    that sets spec on it must either get a SchedulerError or see it ignored; the request must not generate more
    output tokens than its decode stage has."""
    from slogym.core.errors import SchedulerError

    class Chunk8Spec(Scheduler):
        def next_batch(self, inst, now):
            if not inst.running and not inst.waiting:
                return None
            r = (inst.running or inst.waiting)[0]
            rem = int(inst.remaining([r])[0])
            return Batch(req=np.array([r]), tokens=np.array([min(rem, 8)]), spec=np.array([2 if rem == 1 else 0]))

    w = Workload.from_requests([Request(0.0, [prefill(17), decode(1)])])
    sim = Simulator(w, ToyEngine(block_size=1), Policy("s", Chunk8Spec()), spec_acceptance=0.99999)
    try:
        sim.run()
    except SchedulerError:
        return
    assert sim.rs.generated[0] == 1  # currently 3: two accepted "drafts" of a prefill
    assert sim.rs.computed_total[0] == 17

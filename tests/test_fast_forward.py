"""Fast-forward (vectorized steady decode stretches) gives bit-identical results to stepping one iteration at a
time: on every scenario preset with every baseline scheduler, and on random workloads with several instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ToyEngine
from helpers import FF_FIELDS, assert_runs_equal, toy_engines, workloads
from slogym.baselines import REFERENCE_ONLY, ROUTERS, list_policies, make_policy
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import list_scenarios, make_workload

ENGINE = get_engine("llama3-8b-h100")
# requests per scenario: small enough that stepping every iteration stays fast (reasoning requests decode
# ~5000 thinking tokens each, tempo-mix collective arrivals expand into 6 rows)
N_REQ = {"reasoning": 16, "tempo-mix": 60}


# every registered scheduling policy (the router-only names share vLLM's scheduler)
SCHED_POLICIES = [p for p in list_policies() if p not in ROUTERS and p not in REFERENCE_ONLY]


def _pair(w, policy, engine=ENGINE, n_instances=1, router=None, **params):
    out = []
    for ff in (True, False):
        pol = make_policy(policy, engine, router=router, **params)
        sim = Simulator(w, engine, pol, n_instances=n_instances, seed=7, fast_forward=ff).run()
        out.append((sim, sim.result()))
    return out


@pytest.mark.parametrize("scenario", list_scenarios())
def test_fast_forward_equals_stepping_on_every_scenario(scenario):
    w = make_workload(scenario, n_requests=N_REQ.get(scenario, 150), seed=1, engine=ENGINE)
    any_ff = False
    for policy in SCHED_POLICIES:
        (sa, ra), (sb, rb) = _pair(w, policy)
        assert_runs_equal(ra, rb, ignore=FF_FIELDS)
        assert np.array_equal(sa.rs.last_token, sb.rs.last_token, equal_nan=True)
        assert sb.ff_iterations == 0
        any_ff |= sa.ff_iterations > 0
    assert any_ff, "fast-forward never engaged: the comparison would be vacuous"


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=60, **SETTINGS)
@given(w=workloads(max_requests=8, groups=False), engine=toy_engines(),
       policy=st.sampled_from(SCHED_POLICIES),
       router=st.sampled_from(["round-robin", "random", "least-load"]), n_inst=st.integers(1, 3))
def test_fast_forward_equals_stepping_on_random_workloads(w, engine, policy, router, n_inst):
    (sa, ra), (sb, rb) = _pair(w, policy, engine, n_inst, router)
    assert_runs_equal(ra, rb, ignore=FF_FIELDS)
    assert np.array_equal(sa.rs.last_token, sb.rs.last_token, equal_nan=True)


@settings(max_examples=30, **SETTINGS)
@given(w=workloads(max_requests=8, groups=True), engine=toy_engines(), policy=st.sampled_from(SCHED_POLICIES))
def test_fast_forward_equals_stepping_single_instance_with_groups(w, engine, policy):
    (sa, ra), (sb, rb) = _pair(w, policy, engine, 1)
    assert_runs_equal(ra, rb, ignore=FF_FIELDS)


def test_fast_forward_with_group_release_from_another_instance():
    """r0 (group 0, stage 0) finishes quickly on instance 0 and releases r3 (stage 1), which round-robin sends to
    instance 1; instance 1 is in a long steady decode of r1 that fast-forward ran to the next arrival."""
    eng = ToyEngine()
    w = Workload.from_requests([
        Request(0.0, [prefill(10), decode(3)], group=0, group_stage=0),    # -> instance 0
        Request(0.0, [prefill(10, 0.05), decode(3, 0.01)], group=0, group_stage=1),  # held; released -> inst 1
        Request(0.001, [prefill(10), decode(400)]),                        # -> instance 1, long steady decode
        Request(0.002, [prefill(10), decode(5)]),                          # -> instance 0
        Request(5.0, [prefill(10), decode(2)]),                            # a far arrival: the FF horizon
    ])
    (sa, ra), (sb, rb) = _pair(w, "vllm", eng, 2, "round-robin")
    assert sb.rs.instance[1] == 1
    assert sa.rs.first_scheduled[1] == sb.rs.first_scheduled[1]
    assert_runs_equal(ra, rb, ignore=FF_FIELDS)


def test_ff_first_scheduled_is_exact():
    eng = ToyEngine(kv_capacity_tokens=64, block_size=1, max_num_seqs=2, max_num_batched_tokens=32)
    w = Workload.from_requests([Request(a, [prefill(p), decode(1)])
                                for a, p in [(0, 1), (0, 1), (0, 1), (0.03, 1), (0.06, 17)]])
    (sa, _), (sb, _) = _pair(w, "sarathi", eng, token_budget=8)
    assert (sb.rs.first_scheduled >= w.arrival).all()
    assert (sa.rs.first_scheduled >= w.arrival).all()
    assert np.array_equal(sa.rs.first_scheduled, sb.rs.first_scheduled)

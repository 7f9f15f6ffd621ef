"""Bad input gets a clear error: workload validation names the request and field; impossible scheduler and router
decisions raise SchedulerError naming the request, instance and what was wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import ToyEngine
from slogym.core.batch import Batch
from slogym.core.errors import SchedulerError
from slogym.core.policy import Policy, Router, Scheduler
from slogym.core.request import INF, Request, Stage, StageKind, Workload, WorkloadError, decode, external, prefill
from slogym.core.simulator import Simulator


def raw(arrival, stages):
    """A Workload built field by field, in the given order (no sorting), so validation sees the input as is."""
    flat = [s for ss in stages for s in ss]
    n = len(arrival)
    return Workload(
        arrival=np.asarray(arrival, np.float64), app=np.zeros(n, np.int32), tier=np.zeros(n, np.int32),
        ttlt=np.full(n, INF), priority=np.zeros(n, np.int32), best_effort=np.zeros(n, bool),
        stage_ptr=np.concatenate(([0], np.cumsum([len(s) for s in stages]))).astype(np.int64),
        stage_kind=np.array([int(s.kind) for s in flat], np.int8),
        stage_tokens=np.array([s.tokens for s in flat], np.int64),
        stage_delay=np.array([s.delay for s in flat], np.float64),
        stage_ttft=np.array([s.ttft for s in flat], np.float64),
        stage_tpot=np.array([s.tpot for s in flat], np.float64))


CHAT = [prefill(10, 1.0), decode(5, 0.1)]


def test_valid_workload_passes():
    w = raw([0.0, 1.0, 1.0], [CHAT, CHAT + [external(0.5), prefill(3), decode(2)], CHAT + [decode(4)]])
    assert len(w) == 3 and list(w.input_tokens) == [10, 13, 10] and list(w.output_tokens) == [5, 7, 9]


@pytest.mark.parametrize("arrival,stages,pattern", [
    ([0.0, math.nan, 2.0], [CHAT] * 3, r"request 1: field 'arrival' is .*nan"),
    ([0.0, math.inf], [CHAT] * 2, r"request 1: field 'arrival'"),
    ([0.0, 2.0, 1.0], [CHAT] * 3, r"request 2: field 'arrival' decreases"),
    ([0.0, 1.0], [CHAT, [prefill(10), decode(0)]], r"request 1: stage 1 field 'tokens' is 0"),
    ([0.0, 1.0], [[prefill(0), decode(3)], CHAT], r"request 0: stage 0 field 'tokens' is 0"),
    ([0.0], [[prefill(5), decode(3), external(1.0), decode(2)]],
     r"request 0: external stage 2 must be followed by a prefill"),
    ([0.0, 0.5], [CHAT, [prefill(5), decode(3), external(1.0)]], r"request 1: external stage 2 must be followed"),
    ([0.0], [[decode(3)]], r"request 0: field 'stages' must start with a prefill"),
    ([0.0, 0.0], [CHAT, [prefill(5, math.nan), decode(1)]], r"request 1: stage 0 field 'ttft'"),
    ([0.0, 0.0], [CHAT, [prefill(5), decode(1, -0.1)]], r"request 1: stage 1 field 'tpot'"),
    ([0.0], [[prefill(5), decode(1), external(-1.0), prefill(2), decode(1)]], r"request 0: stage 2 field 'delay'"),
    ([0.0, 0.0], [CHAT, []], r"request 1: has no stages"),
])
def test_validation_names_request_and_field(arrival, stages, pattern):
    with pytest.raises(WorkloadError, match=pattern):
        raw(arrival, stages)


@pytest.mark.parametrize("second,pattern", [
    (dict(ttlt=9.0), r"request 1: field 'ttlt' is 9.0 but request 0 of the same collective group 7 has 5.0"),
    (dict(best_effort=True), r"request 1: field 'best_effort' is True but request 0 .* group 7 has False"),
    (dict(arrival=0.5), r"request 1: field 'arrival' is 0.5 but request 0 .* group 7 has 0.0"),
    (dict(group_stage=-1), r"request 1: field 'group_stage' is -1 in collective group 7"),
])
def test_collective_calls_must_agree_on_what_the_group_is_scored_with(second, pattern):
    first = dict(arrival=0.0, stages=CHAT, ttlt=5.0, group=7, group_stage=0)
    ok = Workload.from_requests([Request(**first), Request(**(first | {"group_stage": 1}))])
    assert list(ok.group) == [7, 7]
    with pytest.raises(WorkloadError, match=pattern):
        Workload.from_requests([Request(**first), Request(**(first | {"group_stage": 1} | second))])


def test_from_requests_sorts_and_two_stage_validates():
    w = Workload.from_requests([Request(2.0, CHAT), Request(1.0, [prefill(7), decode(1)])])
    assert list(w.arrival) == [1.0, 2.0] and list(w.input_tokens) == [7, 10]
    with pytest.raises(WorkloadError, match="request 1: stage 1 field 'tokens' is 0"):
        Workload.two_stage([0.0, 1.0], [5, 5], [3, 0], 1.0, 0.1)
    with pytest.raises(WorkloadError, match="'arrival'"):
        Workload.two_stage([0.0, math.nan], [5, 5], [3, 3], 1.0, 0.1)


# ------------------------------------------------------------------------------------ invalid decisions
class Scripted(Scheduler):
    """Returns ``make(inst)`` once the trigger request is waiting; otherwise runs every request FCFS, whole."""

    def __init__(self, make, when=lambda inst: True):
        self.make, self.when, self.fired = make, when, False

    def next_batch(self, inst, now):
        if not self.fired and self.when(inst):
            self.fired = True
            return self.make(inst)
        reqs = inst.waiting + inst.running
        if not reqs:
            return None
        idx = np.array(reqs[:1])
        return Batch(req=idx, tokens=inst.remaining(idx))


def _run(make, w=None, engine=None, n_instances=1, when=lambda inst: True):
    w = w or Workload.from_requests([Request(0.0, [prefill(40), decode(3)]), Request(0.0, [prefill(40), decode(3)]),
                                     Request(5.0, [prefill(8), decode(2)])])
    sim = Simulator(w, engine or ToyEngine(), Policy("scripted", Scripted(make, when)), n_instances=n_instances)
    return sim.run()


B = lambda req, tok, **kw: Batch(req=np.array(req, np.int64), tokens=np.array(tok, np.int64), **kw)  # noqa: E731


# the trigger fires when request 0 has been prefilled (running, 1 token left) and request 1 waits (40 left)
TRIGGER = lambda inst: len(inst.running) == 1 and len(inst.waiting) == 1  # noqa: E731


@pytest.mark.parametrize("make,pattern", [
    (lambda inst: B([2], [8]), r"instance 0: request 2 is not waiting or running here \(status PENDING"),
    (lambda inst: B([1], [41]), r"instance 0: request 1 scheduled 41 tokens; it has 40 left to compute"),
    (lambda inst: B([0], [2]), r"instance 0: request 0 scheduled 2 tokens; it has 1 left"),
    (lambda inst: B([1], [0]), r"request 1 scheduled 0 tokens"),
    (lambda inst: B([1, 1], [10, 10]), r"instance 0: batch lists a request twice: \[1, 1\]"),
    (lambda inst: B([0, 1], [1]), r"batch.req has 2 entries, tokens 1"),
    (lambda inst: B([1], [40], spec=np.array([2])), r"batch.spec"),
    (lambda inst: B([0], [1], spec=np.array([-1])), r"batch.spec"),
    (lambda inst: B([0], [1], preempt=(1,)), r"instance 0: cannot preempt request 1 \(status WAITING"),
])
def test_invalid_batch_raises_scheduler_error(make, pattern):
    with pytest.raises(SchedulerError, match=pattern):
        _run(make, when=TRIGGER)


def test_batch_over_kv_capacity_raises():
    eng = ToyEngine(kv_capacity_tokens=64, block_size=16)  # 4 blocks; request 0 holds 3 after its prefill
    with pytest.raises(SchedulerError, match=r"instance 0: batch needs 3 KV blocks, 1 free \(requests \[1\]\)"):
        _run(lambda inst: B([1], [40]), engine=eng, when=TRIGGER)


def test_request_on_other_instance_raises():
    w = Workload.from_requests([Request(0.0, [prefill(40), decode(3)]), Request(0.0, [prefill(40), decode(3)])])
    # request 1 goes to instance 1 (round-robin); instance 1 schedules first, instance 0 then claims request 1
    with pytest.raises(SchedulerError, match=r"instance 0: request 1 is not waiting or running here .*instance 1"):
        _run(lambda inst: B([1], [40]), w=w, n_instances=2,
             when=lambda inst: inst.id == 0 and inst.sim.rs.instance[1] == 1)


def test_steady_batch_with_duplicate_raises():
    def make(inst):
        r = inst.running[0]
        return B([r, r], [1, 1], steady=True)

    w = Workload.from_requests([Request(0.0, [prefill(10), decode(50)])])
    with pytest.raises(SchedulerError, match="twice"):
        _run(make, w=w, when=lambda inst: bool(inst.running) and inst.sim.rs.generated[inst.running[0]] >= 1)


class BadRouter(Router):
    def __init__(self, value):
        self.value = value

    def route(self, req, sim, now):
        return self.value


@pytest.mark.parametrize("value,pattern", [
    (2, r"router sent request 0 to instance 2; there are 2"),
    (-7, r"router returned -7 for request 0; expected an instance index 0..1"),
])
def test_router_out_of_range_raises(value, pattern):
    w = Workload.from_requests([Request(0.0, CHAT)])
    pol = Policy("bad", Scripted(lambda inst: None), router=BadRouter(value))
    with pytest.raises(SchedulerError, match=pattern):
        Simulator(w, ToyEngine(), pol, n_instances=2).run()


@pytest.mark.parametrize("kw,pattern", [
    ({"attainment": "p99"}, "attainment"), ({"n_instances": 0}, "n_instances"),
    ({"spec_acceptance": 1.0}, "spec_acceptance"), ({"sg_alpha": 0.0}, "sg_alpha"),
])
def test_simulator_argument_errors(kw, pattern):
    w = Workload.from_requests([Request(0.0, CHAT)])
    with pytest.raises(ValueError, match=pattern):
        Simulator(w, ToyEngine(), Policy("p", Scripted(lambda inst: None)), **kw)

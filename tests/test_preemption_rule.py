"""The shared preemption rules: ``make_room_for_decodes``'s array-key path picks the victims the per-request key
function picks, on real KV-pressure states of the schedulers that call it; ``unstick`` and the simulator's
livelock guard keep a stuck instance from restarting the same work forever."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from slogym.baselines import common, make_policy
from slogym.core.cluster import KVTransfer
from slogym.core.errors import SchedulerError
from slogym.core.simulator import MAX_PREEMPTIONS, Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload


@pytest.mark.parametrize("policy", ["edf", "vllm", "sarathi", "tempo"])
def test_array_keys_pick_the_same_victims_as_a_key_function(policy: str, toy_engine, monkeypatch) -> None:
    calls = {"preempting": 0}
    original = common.make_room_for_decodes

    def both(inst, dec, victim_key):
        got = original(inst, dec, victim_key)
        if isinstance(victim_key, np.ndarray):
            key_of = dict(zip(inst.running, victim_key.tolist()))
            want = original(inst, dec, key_of.__getitem__)
            assert got[0].tolist() == want[0].tolist() and got[1] == want[1] and got[2] == want[2]
            calls["preempting"] += bool(got[1])
        return got

    for module in ("edf", "vllm", "sarathi", "tempo", "common"):
        monkeypatch.setattr(f"slogym.baselines.{module}.make_room_for_decodes", both, raising=False)
    w = make_workload("chatbot", rate=40.0, n_requests=300, seed=1)
    sim = Simulator(w, toy_engine, make_policy(policy), 1, seed=1, fast_forward=False).run()
    assert sim.result().summary["preemptions"] > 0
    assert calls["preempting"] > 0  # the comparison ran on states that needed victims


def _instance(running: list[int], waiting: list[int], kv_blocks: list[int], arrival: list[float]) -> SimpleNamespace:
    rs = SimpleNamespace(kv_blocks=np.array(kv_blocks))
    sim = SimpleNamespace(rs=rs, w=SimpleNamespace(arrival=np.array(arrival)))
    holders = sum(1 for r in waiting if kv_blocks[r] > 0)
    return SimpleNamespace(sim=sim, running=running, waiting=waiting, n_waiting_kv=holders)


def test_unstick_drops_a_waiting_holders_kv_before_restarting_a_lone_running_request() -> None:
    # r0 runs alone and needs the KV that r1 and r2 hold while back from tool calls; r3 waits without KV
    inst = _instance([0], [3, 1, 2], kv_blocks=[10, 4, 6, 0], arrival=[0.0, 1.0, 2.0, 3.0])
    assert common.unstick(inst, lambda r: -r).preempt == (2,)  # the latest-arrived holder, not r0
    inst = _instance([0, 3], [1], kv_blocks=[10, 4, 0, 2], arrival=[0.0, 1.0, 2.0, 3.0])
    assert common.unstick(inst, lambda r: r).preempt == (3,)  # several running: the largest key
    inst = _instance([0], [3], kv_blocks=[10, 0, 0, 0], arrival=[0.0, 1.0, 2.0, 3.0])
    assert common.unstick(inst, lambda r: r).preempt == (0,)  # no holder: the lone request


def test_a_scheduler_that_restarts_the_same_request_forever_raises(toy_engine) -> None:
    policy = make_policy("vllm")
    policy.scheduler.pilot_rule = lambda inst: None  # every decision through next_batch

    def restart(inst, now):  # a 16-token chunk of the head prompt, then preempt it: no request ever progresses
        if inst.running:
            return common.batch_of([], [], inst.running[:1])
        return common.batch_of(inst.waiting[:1], [16]) if inst.waiting else None

    policy.scheduler.next_batch = restart
    w = make_workload("chatbot", rate=1.0, n_requests=2, seed=0)
    assert w.input_tokens.min() > 16
    with pytest.raises(SchedulerError, match=f"preempted {MAX_PREEMPTIONS} times.*livelock"):
        Simulator(w, toy_engine, policy, 1, seed=0, fast_forward=False).run()


@pytest.mark.parametrize("n_decode", [1, 2])
def test_polyserve_pd_progresses_when_requests_back_from_tool_calls_hold_the_kv(n_decode: int) -> None:
    """A 4,096-token decode instance, tool-calling requests at 16x their arrival rate: PolyServe's deadline order
    put a lone preempted prompt back ahead of the KV holders (and preempted the head of two prompts that could
    not share the instance), restarting it forever; every request now ends in one outcome."""
    engine = dataclasses.replace(get_engine("llama3-8b-h100"), kv_capacity_tokens=4096)
    w = make_workload("toolllm", n_requests=77, seed=230, engine=engine)
    w = w.with_arrivals(w.arrival / 16)
    link = KVTransfer(bytes_per_token=65536.0, bandwidth_gbps=100.0, latency_s=1e-3)
    sim = Simulator(w, engine, make_policy("polyserve-pd", engine), pd=(1, n_decode), transfer=link, seed=5).run()
    outcomes = sim.result().summary["outcomes"]
    assert sum(outcomes.values()) == len(w) and outcomes["finished"] > 0
    assert int(sim.rs.n_preempt.max()) < MAX_PREEMPTIONS

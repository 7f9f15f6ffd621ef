"""The shared preemption rule (``make_room_for_decodes``): its array-key path picks the victims the per-request
key function picks, on real KV-pressure states of the schedulers that call it."""

from __future__ import annotations

import numpy as np
import pytest

from slogym.baselines import common, make_policy
from slogym.core.simulator import Simulator
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

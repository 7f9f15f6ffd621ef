"""Cluster mechanisms: backend hooks, instance lifecycle and cold starts, cost accounting, prefill/decode
disaggregation with KV transfer, and scaling actions at random times (property tests)."""

from __future__ import annotations

import numpy as np

from conftest import ToyEngine
from helpers import FF_FIELDS, assert_runs_equal
from slogym.baselines import make_policy
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome


def _chat(n: int, gap: float = 0.01, p: int = 64, o: int = 40) -> Workload:
    return Workload.from_requests([Request(i * gap, [prefill(p, 1.0), decode(o, 0.1)]) for i in range(n)])


# ---------------------------------------------------------------------------------------------- backend hooks
class HookedSim(Simulator):
    """Overrides every backend hook: times iterations itself (a stand-in for a live engine) and logs KV events."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.placed: list[tuple[int, int]] = []
        self.freed: list[tuple[int, int]] = []
        self.timed = 0

    def iteration_time(self, inst, idx, tok, spec, features) -> float:
        self.timed += 1
        return inst.time_one(features)

    def on_kv_freed(self, r, inst) -> None:
        self.freed.append((r, inst.id))

    def on_request_placed(self, r, inst) -> None:
        self.placed.append((r, inst.id))


def test_backend_hooks_called_and_fast_forward_disabled_when_timing_is_overridden():
    eng = ToyEngine(kv_capacity_tokens=800)
    w = _chat(30, gap=0.002, p=48, o=120)
    hooked = HookedSim(w, eng, make_policy("vllm", eng), n_instances=2, seed=1)
    assert not hooked.fast_forward
    hooked.run()
    plain = Simulator(w, eng, make_policy("vllm", eng), n_instances=2, seed=1).run()
    assert plain.ff_iterations > 0 and hooked.ff_iterations == 0
    assert_runs_equal(hooked.result(), plain.result(), ignore=FF_FIELDS)
    assert hooked.timed == sum(i.iterations for i in hooked.instances)
    n_pre = int(hooked.rs.n_preempt.sum())
    assert n_pre > 0, "KV pressure never preempted: the freed/placed accounting would be vacuous"
    # every request placed once, plus once per preemption; KV freed once per preemption and once at the end
    assert len(hooked.placed) == len(w) + n_pre
    assert len(hooked.freed) == len(w) + n_pre
    assert sorted({r for r, _ in hooked.freed}) == list(range(len(w)))


def test_live_subclass_disables_fast_forward():
    class Live(Simulator):
        live = True

    eng = ToyEngine()
    assert not Live(_chat(2), eng, make_policy("vllm", eng)).fast_forward
    assert Simulator(_chat(2), eng, make_policy("vllm", eng)).fast_forward
    assert (Live(_chat(4), eng, make_policy("vllm", eng)).run().rs.outcome == Outcome.FINISHED).all()

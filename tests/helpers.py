"""Test helpers: an invariant-checking scheduler wrapper, a speculating scheduler, random-workload strategies,
and the accounting rules the property tests check (derived from the vLLM-v1 semantics in slogym.core.state)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

from slogym.core.batch import Batch
from slogym.core.policy import Scheduler
from slogym.core.request import INF, Request, StageKind, Workload, decode, external, prefill
from slogym.core.state import Outcome, Status

from conftest import ToyEngine

# summary fields that legitimately differ between two identical runs or between fast-forward and stepping
WALL_FIELDS = frozenset({"wall_seconds", "requests_per_wall_second"})
FF_FIELDS = WALL_FIELDS | {"ff_iterations", "pilot_iterations"}


# ---------------------------------------------------------------------------------------------- comparisons
def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):  # np.float64 is a float: values must be identical
        return (math.isnan(a) and math.isnan(b)) or float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def summary_diff(a: dict, b: dict, ignore: frozenset = WALL_FIELDS) -> dict:
    """Fields whose values differ (NaN == NaN), ignoring ``ignore``."""
    keys = (set(a) | set(b)) - ignore
    return {k: (a.get(k), b.get(k)) for k in sorted(keys) if not _same(a.get(k), b.get(k))}


def assert_runs_equal(ra: Any, rb: Any, ignore: frozenset = WALL_FIELDS) -> None:
    if not ra.records.equals(rb.records):
        a, b = ra.records, rb.records
        cols = [c for c in a.columns if not a[c].equals(b[c])] if list(a.columns) == list(b.columns) else "columns"
        raise AssertionError(f"per-request records differ in {cols}")
    diff = summary_diff(ra.summary, rb.summary, ignore)
    assert not diff, f"summaries differ: {diff}"


# ---------------------------------------------------------------------------------------------- accounting rules
def expected_compute(w: Workload) -> np.ndarray:
    """Tokens a request computes when never preempted (vLLM v1, KV kept across stages and tool calls).

    Every prompt token and every output token enters the KV exactly once, except the last output token of the
    request: nothing is computed after it is sampled. (prefill(p)+decode(o): p + o - 1; reasoning: p + o1 + o2 - 1;
    a tool loop's second prefill computes its new tokens plus the last generated token, which the first decode
    stage sampled but never computed, so the -1 of that stage cancels.)
    """
    last_kind = w.stage_kind[w.stage_ptr[1:] - 1]
    return w.input_tokens + w.output_tokens - (last_kind == StageKind.DECODE).astype(np.int64)


def max_context(w: Workload) -> np.ndarray:
    tok = np.where(w.stage_kind != StageKind.EXTERNAL, w.stage_tokens, 0)
    c = np.concatenate(([0], np.cumsum(tok)))
    return c[w.stage_ptr[1:]] - c[w.stage_ptr[:-1]]


# ---------------------------------------------------------------------------------------------- schedulers
def check_instance(sim: Any, inst: Any) -> None:
    """KV and list invariants of one instance (called between iterations)."""
    rs = sim.rs
    assert 0 <= inst.free_blocks <= inst.total_blocks, (inst.id, inst.free_blocks, inst.total_blocks)
    on = np.flatnonzero(rs.instance == inst.id)
    held = int(rs.kv_blocks[on].sum()) + sim.staged_blocks(inst.id)
    assert held == inst.total_blocks - inst.free_blocks, \
        f"instance {inst.id}: requests hold {held} blocks, instance has {inst.total_blocks - inst.free_blocks} used"
    assert (rs.kv_blocks >= 0).all()
    # paged KV holds exactly the computed tokens, rounded up to blocks (no leak, no overcommit)
    # (an instance with an iteration in flight has already allocated the blocks of the tokens it is computing)
    need = -(-rs.num_computed[on] // inst.block_size)
    ok = rs.kv_blocks[on] >= need if inst.inflight is not None else rs.kv_blocks[on] == need
    assert ok.all(), f"instance {inst.id}: kv_blocks {rs.kv_blocks[on]} vs computed tokens need {need}"
    assert (rs.num_computed[on] <= rs.num_tokens[on]).all()
    lists = list(inst.waiting) + list(inst.running)
    assert len(set(lists)) == len(lists), f"instance {inst.id}: request listed twice {lists}"
    assert all(rs.status[r] == Status.WAITING for r in inst.waiting)
    assert all(rs.status[r] == Status.RUNNING for r in inst.running)
    assert all(rs.instance[r] == inst.id for r in lists)
    # the O(1) guard of Simulator._kv_holders_first counts exactly the waiting requests holding KV
    assert inst.n_waiting_kv == int((rs.kv_blocks[inst.waiting] > 0).sum()) if inst.waiting else inst.n_waiting_kv == 0


class InvariantScheduler(Scheduler):
    """Wraps a scheduler; before every decision checks KV/list invariants and per-instance time monotonicity."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.calls = 0

    def reset(self, sim: Any) -> None:
        self.sim = sim
        self.last_now: dict[int, float] = {}
        self.inner.reset(sim)

    def next_batch(self, inst: Any, now: float) -> Batch | None:
        self.calls += 1
        assert inst.inflight is None, "scheduler asked while an iteration is in flight"
        prev = self.last_now.get(inst.id, -INF)
        assert now >= prev, f"instance {inst.id}: time went back from {prev} to {now}"
        self.last_now[inst.id] = now
        for i in self.sim.instances:
            check_instance(self.sim, i)
        return self.inner.next_batch(inst, now)


class SpecScheduler(Scheduler):
    """Wraps a scheduler and adds speculation length ``sl`` to every decode step whose KV allows it."""

    def __init__(self, inner: Scheduler, sl: int) -> None:
        self.inner, self.sl = inner, sl

    def reset(self, sim: Any) -> None:
        self.inner.reset(sim)

    def next_batch(self, inst: Any, now: float) -> Batch | None:
        b = self.inner.next_batch(inst, now)
        if b is None or b.empty or b.preempt or b.drop or b.demote:
            return b
        idx = np.asarray(b.req, np.int64)
        tok = np.asarray(b.tokens, np.int64)
        # decode steps only (a last prefill chunk of one token also has remaining == 1: see
        # test_spec_on_last_prefill_chunk_is_rejected_or_harmless)
        dec = (inst.remaining(idx) == 1) & (inst.sim.w.stage_kind[inst.sim.rs.stage[idx]] == StageKind.DECODE)
        spec = np.where(dec, self.sl, 0).astype(np.int64)
        if int(inst.blocks_needed(idx, tok + spec).sum()) > inst.free_blocks:
            return b
        return Batch(req=idx, tokens=tok, spec=spec, steady=b.steady)


@dataclass
class RecordingEngine:
    """A ToyEngine that records the features of every single-batch call (fast_forward=False runs)."""

    inner: ToyEngine = field(default_factory=ToyEngine)
    calls: list = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch_time(self, f: Any) -> np.ndarray:
        if len(f) == 1:
            self.calls.append({k: int(getattr(f, k)[0]) for k in f._fields})
        return self.inner.batch_time(f)


# ---------------------------------------------------------------------------------------------- strategies
_TTFT = st.sampled_from([INF, 0.02, 0.2, 2.0])
_TPOT = st.sampled_from([INF, 0.006, 0.02, 0.2])
_SMALL = st.integers(1, 48)
_TOKENS = st.one_of(_SMALL, st.integers(49, 200))


@st.composite
def request_stages(draw: Any, big: bool = True) -> list:
    kind = draw(st.sampled_from(["chat", "chat", "reasoning", "tool", "tool2", "prefill_only", "huge"]
                                if big else ["chat", "chat", "reasoning", "tool", "tool2", "prefill_only"]))
    p = draw(_TOKENS)
    if kind == "huge":
        return [prefill(draw(st.integers(2000, 6000)), draw(_TTFT)), decode(draw(_SMALL), draw(_TPOT))]
    if kind == "prefill_only":
        return [prefill(p, draw(_TTFT))]
    if kind == "chat":
        return [prefill(p, draw(_TTFT)), decode(draw(_TOKENS), draw(_TPOT))]
    if kind == "reasoning":
        return [prefill(p, draw(_TTFT)), decode(draw(_TOKENS), draw(_TPOT)), decode(draw(_SMALL), draw(_TPOT))]
    stages = [prefill(p, draw(_TTFT)), decode(draw(_SMALL), draw(_TPOT))]
    for _ in range(1 if kind == "tool" else 2):
        stages += [external(draw(st.sampled_from([0.0, 0.003, 0.05, 0.5]))), prefill(draw(_SMALL), draw(_TTFT)),
                   decode(draw(_SMALL), draw(_TPOT))]
    return stages


@st.composite
def workloads(draw: Any, max_requests: int = 10, groups: bool = True, big: bool = True) -> Workload:
    n = draw(st.integers(1, max_requests))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0005, 0.004, 0.03, 0.2, 1.0]), min_size=n, max_size=n))
    t = np.cumsum(gaps)
    reqs = []
    for i in range(n):
        reqs.append(Request(float(t[i]), draw(request_stages(big)), app=draw(st.sampled_from(["a", "b"])),
                            ttlt=draw(st.sampled_from([INF, INF, 0.5, 5.0])),
                            priority=draw(st.integers(0, 2)), best_effort=draw(st.booleans()) and
                            draw(st.booleans())))
    if groups and draw(st.booleans()):
        # a collective request: two or three stages of requests sharing one arrival and end-to-end deadline
        ta = float(t[draw(st.integers(0, n - 1))])
        ttlt = draw(st.sampled_from([INF, 3.0]))
        n_stages = draw(st.integers(2, 3))
        for s in range(n_stages):
            for _ in range(draw(st.integers(1, 2))):
                reqs.append(Request(ta, [prefill(draw(_SMALL), 2.0), decode(draw(_SMALL), 0.2)], app="coll",
                                    ttlt=ttlt, group=0, group_stage=s))
    return Workload.from_requests(reqs)


@st.composite
def toy_engines(draw: Any) -> ToyEngine:
    return ToyEngine(kv_capacity_tokens=draw(st.sampled_from([64, 256, 1024, 20000])),
                     block_size=draw(st.sampled_from([1, 4, 16])),
                     max_num_seqs=draw(st.sampled_from([2, 8, 64])),
                     max_num_batched_tokens=draw(st.sampled_from([32, 256, 2048])))


def served_mask(rs: Any) -> np.ndarray:
    return (rs.outcome == Outcome.FINISHED) | (rs.outcome == Outcome.BEST_EFFORT)

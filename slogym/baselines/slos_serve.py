"""SLOs-Serve (Chen et al. 2025, "SLOs-Serve: Optimized Serving of Multi-SLO LLMs"), the whole system.

**Soft admission control (§3.1, Alg. 1).** Every replica has a :class:`Planner` (the per-replica scheduler of the
centralized controller, Fig. 7). When a request arrives, :class:`SLOsServeRouter` asks the planner of the
round-robin replica whether the request's SLOs are attainable together with every request it already admitted
(*forced admission*, continuous optimization); if not, the request is routed to the next replica, up to
``route_limit`` replicas (§4.2), then the backup policy serves it best-effort (§4.1) or declines it. Admitted requests
keep their guarantee until they finish. Requests placed on a replica without a planner decision (an agent's choice
in Admission-v0/Routing-v0, or ``router=`` overriding this router) are admitted or demoted by the scheduler on
its next invocation (Alg. 1 line 2 with those requests as ``Req_new``).

**Multi-SLO DP (§3.2.1, Eq. 2-3, App. C Eq. 5).** :func:`solve_admission`: requests sorted by prefill deadline
``pDDL``; state ``pb[i, m, (n_1..n_L)]`` = the largest prefill budget left at ``pDDL_i`` when ``i`` is the last
accepted request, ``m`` memory units are used and ``n_l`` requests of TPOT tier ``l`` are accepted (the request-
throughput objective of App. C: every value ``v_i = 1``). Transition (Eq. 5): enumerate the previous accepted
request ``j``; ``pb = pb[j] + Delta - p_i`` with ``Delta = PB*(pDDL_i - pDDL_j, n_prev)`` (Eq. 2), kept only if
``pb >= 0`` and the decodes of the new counts still fit in a batch. Forced admission: ``j`` may not skip a running
(admitted) request -- it is the latest running request before ``i`` or a new request after it. The optimum is the
largest accepted count (ties: largest final budget); ``j*`` pointers reconstruct the admitted set and the planned
partial batches ``B*`` (per interval: batch time, batch count, prefill budget per batch), and the prefill budget
of every interval is allocated earliest-deadline-first (:func:`allocate_prefill`). Memory ``m`` is in
``mem_units`` units of the KV blocks left after the admitted requests (each new request rounded up).

*Vectorization* (the benchmark target is <= 1 ms for 10 new + 100 running requests): running requests in their
decode stage need no DP position (they are the base counts at time 0), so positions are only the new requests and
running ones still prefilling. For position ``i`` all predecessors ``j``, all memory units and all count vectors
are one NumPy array ``(J, M+1, K_1+1, .., K_L+1)``: ``Delta`` depends only on ``(j, k)`` (no running request lies
between ``j`` and ``i``, so the decode counts of the interval are ``base + forced-so-far + k``), the shift by
``(m_i, e_l)`` is a slice, and the max/argmax over ``j`` is one reduction. ``PB*`` per count vector comes from one
table computed for the whole grid of counts at once (:func:`speculation_plan`), whose ``time2bs`` is one vectorized
perf-model call over a token grid (:class:`BatchTimeInverse`).

**Batch formation with dynamic batch sizing (§3.2.2, Alg. 2).** The batch time is set by the running decodes'
tightest TPOT (with speculation: App. D's optimum), and the batch is the largest token batch the engine's perf
model runs within it (``time2bs``); decodes are scheduled earliest-deadline-first only when due (their next
token's deadline falls before the next batch could end -- Alg. 2's ``schDDL`` queue, with the deadline lines of the
simulator as ``schDDL``), the rest of the budget is prefill, allocated EDF by prefill deadline. A batch ends by
the earliest due token deadline ahead (no decode waits past its line, Alg. 2's once-per-TPOT schedule) and by
the earliest admitted prefill deadline it can meet (the DP's shorter partial batch).

**SLO-adaptive speculative decoding (§3.2.3, App. D).** ``Acc(sl) = (1 - alpha^sl) / (1 - alpha)`` tokens per
verification of ``sl`` tokens (``sl = 1`` is plain decoding; the simulator's ``Batch.spec`` is ``sl - 1`` drafts).
For counts ``n_1..n_L`` the planner enumerates the binding tier ``l*`` and its ``sl*`` (batch time
``T = TPOT_l* * Acc(sl*)``), gives every other tier the closed-form smallest ``sl_l`` with
``TPOT_l * Acc(sl_l) >= T``, and keeps the choice with the largest prefill throughput
``(time2bs(T, max sl - 1) - sum_l n_l * sl_l * T / (TPOT_l * Acc(sl_l))) / T``. The draft model's cost is the perf
model's ``spec_steps`` term (``k2 * #SpecStep``; :func:`with_draft_model` adds it to presets that lack it).
SLO tightening: a decode whose next token is already due within the current batch is treated as the tightest
tier (that tier's App. D speculation length, the longest of the plan) until it catches up.

**Burst-resilient best-effort tier (§4.1).** Leftover budget (after admitted decodes and prefills) serves best-
effort requests, which may only use KV memory not reserved for the admitted requests' future growth; when an
admission raises that reservation above the free memory, best-effort requests are preempted by recompute (KV
dropped, generated tokens kept). When no admitted work is due, the whole batch is theirs (low-load periods).

Reconstructions and deviations (also in ``docs/baselines/slos_serve.md``):

* Alg. 2 line 9 reads ``schDDL >= i * t0``; we read it as "due" (``<=``), the only reading that schedules anything.
* Alg. 2 charges a tier-``l`` decode once per ``TPOT_l``; the DP therefore counts ``n_l * t0 / TPOT_l`` decode
  tokens per batch (App. D's formula charges ``n_l * sl_l`` per batch, which equals it for the binding tier).
* ``Delta = PB*(t, n)`` is ``floor(t / T)`` planned batches plus one shorter batch ending at the deadline (its
  decode tokens pro rata, every decode's context read; :class:`IntervalBudget`) -- with ``floor`` alone every
  deadline closer than one batch gets nothing. Execution matches it by ending a batch at the earliest admitted
  prefill deadline it can meet. The interval that starts now is the exception when it is shorter than one batch:
  its one batch holds exactly the running decodes due by then (known from their deadline lines), as formed.
* With several tiers, a full planned batch reads the context of the decodes it verifies (Alg. 2: a tier-``l``
  decode once per ``TPOT_l``), a share of the running ones (:data:`SHARES` levels, rounded up).
* Memory is the full context (prompt + all outputs + drafts) of every accepted request, reserved from admission to
  finish. An admitted request already late in the model (its prefill fits neither the next batch nor
  ``prefill / peak + one TPOT batch``) gets that time as its deadline, so the forced set stays feasible.
* Alg. 1's invocation thresholds: the DP runs for every arrival (``thresh_new = 0``) because the router needs a
  decision per request (to route it elsewhere, §4.2); the batch plan is refreshed at every iteration. Budget
  accrues from the end of the iteration in flight.
* Speculation is given to due decodes only (decodes ahead of their deadline line run plain from leftover budget).
* The planner's ``time2bs`` treats all tokens of a batch as one prefill chunk and every running decode's context as
  read (conservative for context-dependent perf models); the formed batch is then checked against the exact
  features; if it exceeds the batch time its optional tail (best-effort work, decodes not yet due) is cut.
  Measured alternative not adopted: modeling the batch as chunks of the longest pending prompt (closer to the
  engine) makes App. D pick ``sl = 2`` (180 ms batches on ChatBot) and lowers capacity (long batches delay the
  prefills of arrivals whose TTFT SLO, ~110 ms here, is close to one batch).
* Without dynamic batch sizing (ablation) nothing speculates: SLO-adaptive speculation is the batch-time-adaptive
  part of batch formation (§3.2.3, "we extend the batch formation technique"), and App. D's optimum at the fixed
  batch time ``min TPOT`` is ``sl = 1`` for every tier.
* Requests without a TPOT SLO get a very loose tier (:data:`NO_SLO_TPOT`); requests without a TTFT SLO get a
  deadline ``HORIZON`` seconds out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from slogym.baselines.common import split_running, unstick
from slogym.core import kernels
from slogym.core.batch import Batch, BatchFeatures
from slogym.core.instance import ENTRY_ROLES, Instance
from slogym.core.policy import BEST_EFFORT, DEFER, REJECT, Policy, Router, Scheduler
from slogym.core.request import StageKind
from slogym.core.state import Status
from slogym.engines.base import EngineSpec, PerfModel

if TYPE_CHECKING:
    from slogym.core.simulator import Simulator

NO_SLO_TPOT = 10.0
"""TPOT (s) of the tier given to requests without a TPOT SLO (almost no decode load in the plan)."""
HORIZON = 3600.0
"""Prefill deadline (s from now) of a request without a TTFT SLO."""
_DECODE = int(StageKind.DECODE)
_PREFILL = int(StageKind.PREFILL)
_EMPTY = np.zeros(0, np.int64)


# ================================================================================ perf model (§3.1.1)
class DraftModelPerf(PerfModel):
    """A perf model plus the draft model's term ``k2 * spec_steps`` of the SLOs-Serve roofline (§3.1.1).

    The shipped analytic presets have no ``spec_steps`` term (a draft pass would be free); wrapping them adds one
    draft forward pass of ``k2`` seconds per speculation step. Unregistered (no ``family``): build it with
    :func:`with_draft_model`.
    """

    def __init__(self, base: PerfModel, k2: float) -> None:
        if not (k2 >= 0 and math.isfinite(k2)):
            raise ValueError(f"draft step time k2={k2!r}; must be a finite number >= 0 (seconds)")
        self.base, self.k2 = base, float(k2)

    def batch_time(self, f: BatchFeatures, x: Any = None) -> Any:
        return self.base.batch_time(f, x) + f.spec_steps * self.k2

    def params(self) -> dict[str, Any]:
        return {"base": self.base.to_dict(), "k2": self.k2}


def with_draft_model(engine: EngineSpec, k2: float) -> EngineSpec:
    """``engine`` whose iterations also pay ``k2`` seconds per draft-model step (``spec_steps``)."""
    return dataclasses.replace(engine, name=f"{engine.name}+draft", perf=DraftModelPerf(engine.perf, k2),
                               provenance=engine.provenance | {"draft_model_k2_s": k2})


def expected_tokens(sl: np.ndarray | int, alpha: float) -> np.ndarray:
    """App. D: ``Acc(sl) = (1 - alpha^sl) / (1 - alpha)`` tokens generated by verifying ``sl`` tokens."""
    return (1.0 - alpha ** np.asarray(sl, np.float64)) / (1.0 - alpha)


SHARES = 8
"""Decode-share levels of :class:`BatchTimeInverse`: a batch holds ``k / SHARES`` of the running decodes."""


class BatchTimeInverse:
    """``time2bs(T, steps, share)``: the largest token batch the engine runs within ``T`` seconds (Alg. 2 line 7).

    One vectorized ``batch_time`` call over a token grid (``step`` tokens apart, up to ``max_tokens``) x draft steps
    ``0..max_steps`` x decode shares ``k / SHARES``, tabulated on a uniform time grid of ``resolution`` seconds
    (times round down). The batch is modeled as one prefill chunk of all its tokens (attending to ``past``
    earlier tokens) while ``share`` of the ``decode_seqs`` running decodes read their share of the ``decode_ctx``
    KV tokens. The share is the fraction of decodes the plan puts in the batch (Alg. 2 schedules a tier-``l``
    decode once per ``TPOT_l``, so a batch shorter than a TPOT holds only the decodes due in it); it rounds up
    to the next level (conservative).
    """

    def __init__(self, engine: Any, max_tokens: int, max_steps: int, decode_seqs: int = 0, decode_ctx: int = 0,
                 past: int = 0, step: int = 16, resolution: float = 2.5e-4) -> None:
        self.grid = np.arange(0, max_tokens + step, step, dtype=np.int64)
        n_s = max_steps + 1
        q, s, x = np.meshgrid(np.arange(SHARES + 1), np.arange(n_s, dtype=np.int64), self.grid, indexing="ij")
        q, s, x = q.ravel(), s.ravel(), x.ravel()
        seqs, ctx = -(-decode_seqs * q // SHARES), -(-decode_ctx * q // SHARES)  # rounded up
        f = BatchFeatures.build(prefill_tokens=x, prefill_seqs=(x > 0), prefill_attn=x * (x + past),
                                prefill_sq=x * x, decode_seqs=seqs, decode_ctx=ctx, kv_tokens=ctx + x + past,
                                spec_steps=s)
        t = np.asarray(engine.batch_time(f), np.float64).reshape(-1, self.grid.size)  # rows (share, steps)
        t = np.maximum.accumulate(t, axis=1)  # monotone in tokens, so searchsorted is valid
        full = SHARES * n_s  # row of every decode in the batch, no drafts
        self.peak_rate = float(self.grid[-1] / t[full, -1]) if t[full, -1] > 0 else 1.0
        """tokens/s of the largest batch (every decode in it, no drafts)"""
        self.min_time = float(t[full, 1]) if t.shape[1] > 1 else 0.0
        """time of the smallest non-empty batch on the grid (every decode in it, no drafts)"""
        self.alone_time = float(t[0, 1]) if t.shape[1] > 1 else 0.0
        """time of the smallest non-empty batch on the grid without decodes"""
        # the inverse on a uniform time grid (resolution ``res``, rounded down: conservative), so a lookup is an
        # index computation instead of a search
        self.res = resolution
        n_t = int(math.ceil(float(t.max()) / resolution)) + 2
        tq = np.arange(n_t) * resolution
        cnt = np.stack([np.searchsorted(row, tq, side="right") for row in t])  # grid points within each time
        # (shares x steps x n_t) capacities, flattened; int32 keeps the gathers of the DP in cache
        self._tcap = np.concatenate(([0], self.grid))[cnt].ravel().astype(np.int32)
        self._n_t = n_t
        self.share_stride = n_s * n_t
        """offset between consecutive decode-share levels in :meth:`lookup`'s table"""

    def __call__(self, T: np.ndarray | float, steps: np.ndarray | int, share: np.ndarray | float = 1.0
                 ) -> np.ndarray:
        return self.lookup(np.asarray(T, np.float64), self.offsets(np.asarray(steps, np.int64), share))

    def offsets(self, steps: np.ndarray, share: np.ndarray | float = 1.0) -> np.ndarray:
        """Row offsets of ``steps`` draft steps with ``share`` (0..1) of the decodes, for :meth:`lookup`."""
        return self.share_offsets(share) + steps * self._n_t

    def share_offsets(self, share: np.ndarray | float) -> np.ndarray:
        """Row offsets of decode ``share`` (0..1), rounded up to the next level."""
        level = np.clip(np.ceil(np.asarray(share, np.float64) * SHARES - 1e-9), 0, SHARES).astype(np.int64)
        return level * self.share_stride

    def lookup(self, T: np.ndarray, off: np.ndarray) -> np.ndarray:
        k = np.minimum(T * (1.0 / self.res), self._n_t - 1).astype(np.int64)  # T >= 0; inf -> the last cell
        return self._tcap[k + off]


# ================================================================================ App. D: speculation lengths
@dataclass(frozen=True)
class PartialBatch:
    """Planned batch shapes (Eq. 3), one per count vector: batch time, prefill budget per batch, decode tokens
    verified per batch, draft steps, per-tier tokens verified per decode (1 = no speculation), and the share of
    the running decodes verified in a batch (Alg. 2: a tier-``l`` decode once per ``TPOT_l * Acc(sl_l)``)."""

    time: np.ndarray    # (G,) seconds; inf where the counts cannot be served
    budget: np.ndarray  # (G,) prefill tokens per batch; -inf where infeasible
    demand: np.ndarray  # (G,) decode tokens per batch
    steps: np.ndarray   # (G,) draft-model steps per batch
    sl: np.ndarray      # (G, L)
    share: np.ndarray   # (G,) in [0, 1]


def speculation_plan(counts: np.ndarray, tpot: np.ndarray, alpha: float, max_sl: int,
                     time2bs: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> PartialBatch:
    """Per count vector (rows of ``counts``, shape ``(G, L)``) the batch maximizing prefill throughput (App. D).

    Candidates: binding tier ``l*`` x ``sl* in 1..max_sl`` gives ``T = TPOT_l* * Acc(sl*)``; every tier ``l`` then
    verifies the smallest ``sl_l`` with ``TPOT_l * Acc(sl_l) >= T`` (closed form), i.e. ``T / (TPOT_l Acc(sl_l))``
    verifications of ``sl_l`` tokens per batch on average (Alg. 2's once-per-TPOT schedule). The draft model runs
    ``max sl_l - 1`` steps over the tiers present. With ``max_sl = 1`` this is Alg. 2: ``T = min TPOT``.
    ``time2bs`` is given the share of the running decodes that a batch verifies (their context is read).
    """
    counts = np.asarray(counts, np.float64)
    tpot = np.asarray(tpot, np.float64)
    acc = expected_tokens(np.arange(1, max_sl + 1), alpha)                      # (S,)
    Tc = (tpot[:, None] * acc[None, :]).ravel()                                  # (C,)
    need = Tc[:, None] / tpot[None, :]                                           # (C, L) tokens per batch
    si = np.searchsorted(acc, need * (1.0 - 1e-12), side="left")                # smallest sl with Acc >= need
    ok_tier = si < max_sl
    si = np.minimum(si, max_sl - 1)
    sl = si + 1
    verif = need / acc[si]                                                       # verifications per batch
    rate = sl * verif                                                            # verified tokens per batch
    present = counts > 0                                                         # (G, L)
    steps = (present[:, None, :] * (sl - 1)[None]).max(axis=2)                   # (G, C)
    demand = (counts[:, None, :] * rate[None]).sum(axis=2)                       # (G, C)
    share = (counts[:, None, :] * verif[None]).sum(axis=2) / np.maximum(counts.sum(axis=1), 1.0)[:, None]
    share = np.minimum(share, 1.0)
    cap = time2bs(np.broadcast_to(Tc, steps.shape), steps, share)
    budget = cap - demand
    binding = np.repeat(np.arange(tpot.size), max_sl)                            # (C,) tier l* of each candidate
    # the binding tier is one of the running decodes' tiers (Alg. 2 line 1); any tier when none runs
    bound = present[:, binding] | ~present.any(axis=1, keepdims=True)
    ok = (ok_tier[None] | ~present[:, None, :]).all(axis=2) & (budget >= 0) & bound
    thr = np.where(ok, budget / Tc, -np.inf)
    best = thr.argmax(axis=1)
    rows = np.arange(counts.shape[0])
    feas = ok[rows, best]
    return PartialBatch(np.where(feas, Tc[best], np.inf), np.where(feas, budget[rows, best], -np.inf),
                        demand[rows, best], steps[rows, best], np.where(feas[:, None], sl[best], 1),
                        share[rows, best])


class IntervalBudget:
    """Eq. 2-3's ``PB*(t, n)`` for every count vector of a :class:`PartialBatch` table: the prefill budget of the
    partial batches filling an interval of ``t`` seconds -- ``floor(t / T)`` planned batches plus one shorter
    batch for the remainder (dynamic batch sizing: the largest batch that ends by the deadline; its decode tokens
    pro rata, every decode's context read, as Alg. 2 schedules every decode from the interval's start). 0 for
    count vectors that cannot be served. Tables are precomputed for the DP's inner loop.

    The interval that starts now (:meth:`first`) knows its decodes: when it is shorter than one batch, that
    batch holds exactly the running decodes due before the batch after it could end (``due``: their next token
    deadlines, s from now, sorted; of ``n_run`` running requests) -- the batch :class:`SLOsServeScheduler`
    forms. ``due=None``: no such knowledge, :meth:`first` is :meth:`__call__`."""

    def __init__(self, pb: PartialBatch, time2bs: BatchTimeInverse, shape: tuple[int, ...],
                 due: np.ndarray | None = None, n_run: int = 0) -> None:
        self.ok = (pb.budget >= 0).reshape(shape)
        ok = self.ok.ravel()
        self.T = np.where(ok, pb.time, 1.0).reshape(shape)
        self.inv_T = 1.0 / self.T
        self.budget = np.where(ok, pb.budget, 0.0).reshape(shape)
        self.rate = np.where(ok, pb.demand / np.where(ok, pb.time, 1.0), 0.0).reshape(shape)
        self.cap_ok = ok.reshape(shape) * 1.0
        self.soff = (pb.steps * time2bs._n_t).reshape(shape)     # draft-step row offsets
        self.foff = self.soff + SHARES * time2bs.share_stride    # ... with every decode in the batch
        self.time2bs = time2bs
        self.due, self.n_run = due, max(int(n_run), 1)
        self.T_max = float(self.T.max())

    def __call__(self, dt: np.ndarray, cnt: Any) -> np.ndarray:
        """Budget over ``dt`` (broadcast against the count vectors selected by ``cnt``: a tuple of slices or
        indices into the table, or an array of flat indices)."""
        return self._budget(dt, *self._select(cnt))

    def first(self, dt: np.ndarray, cnt: Any, full: np.ndarray | None = None) -> np.ndarray:
        """Budget over the interval from now to ``dt`` (see the class docstring); ``full``: ``self(dt, cnt)``
        when the caller has it already."""
        if full is None:
            full = self(dt, cnt)
        if self.due is None or float(np.min(dt)) >= self.T_max:  # no interval shorter than a batch
            return full
        T, cap_ok, soff = self._select(cnt, (self.T, self.cap_ok, self.soff))
        n_due = np.searchsorted(self.due, dt + T)   # decodes due before the batch after this one could end
        part = self.time2bs.lookup(dt, self.time2bs.share_offsets(n_due / self.n_run) + soff) - n_due
        return np.where(dt < T, np.maximum(part, 0.0) * cap_ok, full)

    def _select(self, cnt: Any, tabs: tuple[np.ndarray, ...] | None = None) -> tuple[np.ndarray, ...]:
        if tabs is None:
            tabs = (self.T, self.inv_T, self.budget, self.rate, self.cap_ok, self.foff)
        if isinstance(cnt, np.ndarray):
            return tuple(a.ravel()[cnt] for a in tabs)
        return tuple(a[cnt] for a in tabs)

    def _budget(self, dt: np.ndarray, T: np.ndarray, inv_T: np.ndarray, budget: np.ndarray, rate: np.ndarray,
                cap_ok: np.ndarray, foff: np.ndarray) -> np.ndarray:
        nb = np.floor(dt * inv_T)
        rem = dt - nb * T
        part = self.time2bs.lookup(rem, foff) - rate * rem
        return nb * budget + np.maximum(part, 0.0) * cap_ok


# ================================================================================ §3.2.1: the multi-SLO DP
@dataclass
class AdmissionProblem:
    """Input of one DP invocation (§3.2.1); times are seconds from now.

    deadline  prefill deadline ``pDDL_i`` of each request with prefill work (new or running)
    prefill   prefill tokens ``p_i`` it still needs
    memory    memory units ``m_i`` (new requests; forced ones are pre-subtracted from ``mem_units``)
    tier      decode tier (index into ``tpot``) by the tightest-SLO rule
    forced    True for running (admitted) requests: continuous optimization forces them in
    base      running requests already decoding, per tier (decode load from time 0)
    tpot      TPOT of each tier (s)
    mem_units M, the memory units available to new requests
    due       next token deadlines (s from now, sorted) of the running decodes; None = unknown
    n_run     running requests whose context the perf model reads (the share denominator of ``due``)
    """

    deadline: np.ndarray
    prefill: np.ndarray
    memory: np.ndarray
    tier: np.ndarray
    forced: np.ndarray
    base: np.ndarray
    tpot: np.ndarray
    mem_units: int
    due: np.ndarray | None = None
    n_run: int = 0

    def __post_init__(self) -> None:
        n = self.deadline.shape[0]
        for name in ("prefill", "memory", "tier", "forced"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"AdmissionProblem.{name} has shape {getattr(self, name).shape}; expected ({n},)")
        if self.base.shape != self.tpot.shape:
            raise ValueError(f"base {self.base.shape} and tpot {self.tpot.shape} must have one entry per tier")
        if np.isnan(self.deadline).any() or (self.prefill < 0).any() or (self.memory < 0).any():
            raise ValueError("AdmissionProblem: deadlines must not be NaN; prefill and memory must be >= 0")


@dataclass
class AdmissionPlan:
    """DP result: which requests are accepted and the planned partial batches ``B*`` per interval.

    intervals rows ``(start, end, batch_time, n_full_batches, prefill_budget)`` between consecutive accepted
              prefill deadlines, from now to the last one (Eq. 2-3's partial batches; the budget includes the
              shorter batch that ends at the deadline)
    """

    accepted: np.ndarray
    feasible: bool
    budget_left: float
    _intervals: Callable[[], list[tuple[float, float, float, int, float]]] = list

    @property
    def intervals(self) -> list[tuple[float, float, float, int, float]]:
        """Built on demand (reconstruction of ``B*`` is not needed for the admission decision itself)."""
        return self._intervals()

    @property
    def count(self) -> int:
        return int(self.accepted.sum())


PlanFn = Callable[[np.ndarray], PartialBatch]
"""Count vectors ``(G, L)`` -> their batch shapes; budget < 0 = the decodes do not fit in a batch."""


def solve_admission(prob: AdmissionProblem, plan: PlanFn, time2bs: BatchTimeInverse) -> AdmissionPlan:
    """The multi-SLO DP (Eq. 5 with per-tier counts and forced admission), vectorized per position.

    Returns the admitted set of the largest size (ties: most prefill budget left at the end). When the forced
    (running) requests alone are infeasible under the model, nothing new is accepted and ``feasible`` is False.
    """
    n, L = prob.deadline.shape[0], prob.tpot.shape[0]
    order = np.argsort(prob.deadline, kind="stable")
    d = np.minimum(prob.deadline[order], HORIZON)
    p = prob.prefill[order].astype(np.float64)
    mem = prob.memory[order]
    tier = prob.tier[order]
    forced = prob.forced[order]
    M = int(prob.mem_units)
    F = np.bincount(tier[forced], minlength=L)
    K = np.bincount(tier[~forced], minlength=L)
    # PB* tables over every reachable count vector: base + forced so far + new accepted
    dims = tuple((F + K + 1).tolist())
    grid = np.indices(dims).reshape(L, -1).T + prob.base
    delta = IntervalBudget(plan(grid), time2bs, dims, prob.due, prob.n_run)
    ok_tab = delta.ok
    none = AdmissionPlan(prob.forced.copy(), False, 0.0)
    if not ok_tab[(0,) * L]:
        return none
    kdims = tuple((K + 1).tolist())
    V = np.full((n + 1, M + 1) + kdims, -np.inf)
    V[(0, 0) + (0,) * L] = 0.0
    t_at = np.concatenate(([0.0], d))  # V index j -> its prefill deadline (0 = now)
    # Eq. 2's PB* for every (position i, predecessor j, new counts k) in one vectorized call: the interval's
    # counts are the forced requests before i plus k, whatever j is (no forced request lies between j and i)
    fc = np.zeros((n, L), np.int64)  # forced positions before each position, per tier
    fc[1:] = np.cumsum(np.eye(L, dtype=np.int64)[tier[:-1]] * forced[:-1, None], axis=0)
    kg = np.indices(kdims)
    flat = np.ravel_multi_index(tuple(fc[:, t].reshape((n,) + (1,) * L) + kg[t][None] for t in range(L)), dims)
    dt_all = np.maximum(d[:, None] - t_at[None, :], 0.0).reshape((n, n + 1) + (1,) * L)
    gains = delta(dt_all, flat[:, None])                # (n, n+1, *kdims)
    near = np.flatnonzero(d < delta.T_max)              # the interval from now is shorter than a batch: its
    if near.size:                                       # decodes are known
        gains[near, 0] = delta.first(dt_all[near, 0], flat[near], gains[near, 0])
    lo_at = [0] * n                    # first allowed predecessor of each position (forced admission)
    fcum_at: list[list[int]] = [[]] * n
    alive = [True] + [False] * n       # positions with any reachable state
    lo, fcum = 0, [0] * L              # fcum: forced positions passed, per tier
    kh, mh = [0] * L, 0                # reachable new counts per tier / memory units so far (the state box)
    for i in range(n):
        l, m_i, f_i = int(tier[i]), int(mem[i]), bool(forced[i])
        lo_at[i], fcum_at[i] = lo, fcum
        live = alive[lo:i + 1]
        if not any(live) or (not f_i and m_i > M):
            continue
        js = slice(lo, i + 1) if all(live) else [lo + j for j, a in enumerate(live) if a]  # a view if all live
        reach = (slice(0, mh + 1),) + tuple(slice(0, kh[t] + 1) for t in range(L))
        gain = gains[(i, js) + reach[1:]]                            # (J, *k box): PB* of the intervals j -> i
        best = (V[(js,) + reach] + gain[:, None]).max(axis=0)       # Eq. 5: max over the previous accepted j
        best -= p[i]
        if f_i:
            fcum = fcum.copy()
            fcum[l] += 1
            cnt = tuple(slice(fcum[t], fcum[t] + kh[t] + 1) for t in range(L))
            best[(best < 0) | ~ok_tab[cnt][None]] = -np.inf
            V[(i + 1,) + reach] = best
            alive[i + 1] = bool(best.max() > -np.inf)
            lo = i + 1
        else:  # accepting i: memory m -> m + m_i, tier count k_l -> k_l + 1
            top = min(mh, M - m_i)
            dst = (i + 1, slice(m_i, m_i + top + 1)) + tuple(
                slice(1, kh[t] + 2) if t == l else slice(0, kh[t] + 1) for t in range(L))
            cnt = tuple(slice(fcum[t] + (t == l), fcum[t] + kh[t] + 1 + (t == l)) for t in range(L))
            b = best[:top + 1]
            b[(b < 0) | ~ok_tab[cnt][None]] = -np.inf
            V[dst] = b
            alive[i + 1] = bool(b.max() > -np.inf)
            mh = min(M, mh + m_i)
            kh[l] += 1
    ends = V[lo:]
    if not alive[lo] and not any(alive[lo + 1:]):
        return none
    ksum = np.indices(kdims).sum(axis=0)
    score_cnt = np.where(ends > -np.inf, ksum[None, None], -1)
    top = int(score_cnt.max())
    flat = np.where(score_cnt == top, ends, -np.inf).argmax()
    q, m, *k = (int(v) for v in np.unravel_index(flat, ends.shape))
    q += lo
    budget_left = float(V[(q, m) + tuple(k)])
    accepted = forced.copy()
    while top and q > 0:  # reconstruction: recompute Eq. 5's argmax j* at the chosen state only
        i = q - 1
        accepted[i] = True
        if not forced[i]:
            m -= int(mem[i])
            k[int(tier[i])] -= 1
        cnt = tuple(fcum_at[i][t] + k[t] for t in range(L))
        js = np.arange(lo_at[i], i + 1)
        cand = V[(js, m) + tuple(k)] + delta(d[i] - t_at[js], cnt)
        if js[0] == 0:
            cand[0] = V[(0, m) + tuple(k)] + delta.first(np.array(d[i]), cnt)
        q = int(js[cand.argmax()])
    out = np.zeros(n, bool)
    out[order] = accepted

    def intervals() -> list[tuple[float, float, float, int, float]]:
        """B*: the partial batches of each interval between consecutive accepted deadlines."""
        rows, t0, c = [], 0.0, [0] * L
        for i in np.flatnonzero(accepted).tolist():
            idx = tuple(c)
            T = float(delta.T[idx]) if ok_tab[idx] else math.inf
            nb = int(math.floor((d[i] - t0) / T)) if math.isfinite(T) else 0
            gain = delta.first if t0 == 0.0 and not rows else delta
            rows.append((t0, float(d[i]), T, nb, float(gain(np.array(d[i] - t0), idx))))
            t0 = float(d[i])
            c[int(tier[i])] += 1
        return rows

    return AdmissionPlan(out, True, budget_left, intervals)


def allocate_prefill(plan: AdmissionPlan, deadline: np.ndarray, prefill: np.ndarray) -> np.ndarray:
    """Time (s from now) at which each accepted request's prefill completes when every planned interval's budget
    (available by the interval's end) goes to the accepted requests
    earliest-deadline-first (§3.2.1 "we allocate the prefill budget ... prioritizing earlier deadlines");
    ``inf`` for requests not accepted or not completed within the plan."""
    acc = np.flatnonzero(plan.accepted)
    acc = acc[np.argsort(deadline[acc], kind="stable")]
    left = prefill[acc].astype(np.float64)
    finish = np.full(deadline.shape[0], np.inf)
    finish[acc[left <= 0]] = 0.0
    for _, end, _, _, budget in plan.intervals:
        for j in np.flatnonzero(left > 0).tolist():
            take = min(left[j], budget)
            left[j] -= take
            budget -= take
            if left[j] <= 1e-9:
                finish[acc[j]] = end
            if budget <= 0:
                break
    return finish


# ================================================================================ the per-replica planner
@dataclass(frozen=True)
class SLOsServeConfig:
    """Knobs of SLOs-Serve (defaults: the paper's mechanisms all on).

    max_sl          longest verification per decode (``1`` disables speculative decoding; App. D: < 10)
    alpha           draft acceptance rate; ``None`` = the simulator's ``spec_acceptance`` (profiled)
    mem_units       memory units of the DP (M)
    route_limit     replicas tried per request before the backup policy (``None`` = all)
    backup          ``"best_effort"`` or ``"reject"`` for requests no replica can guarantee
    admission       False admits everything (ablation: no admission control)
    dynamic_batch   False fixes the batch time to the tightest TPOT of the workload (ablation, Sarathi-like);
                    it also turns speculation off (see :class:`SLOsServeState`)
    grid_step       token resolution of ``time2bs``
    """

    max_sl: int = 4
    alpha: float | None = None
    mem_units: int = 32
    route_limit: int | None = None
    backup: str = "best_effort"
    admission: bool = True
    dynamic_batch: bool = True
    grid_step: int = 16

    def __post_init__(self) -> None:
        if self.max_sl < 1 or self.mem_units < 1 or self.grid_step < 1:
            raise ValueError(f"max_sl={self.max_sl}, mem_units={self.mem_units}, grid_step={self.grid_step} "
                             f"must be >= 1")
        if self.alpha is not None and not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha={self.alpha!r}; must be in [0, 1)")
        if self.backup not in ("best_effort", "reject"):
            raise ValueError(f"backup={self.backup!r}; expected 'best_effort' or 'reject'")
        if self.route_limit is not None and self.route_limit < 1:
            raise ValueError(f"route_limit={self.route_limit}; must be >= 1 or None")


class SLOsServeState:
    """What the router and the scheduler share: the config and one :class:`Planner` per replica.

    ``admitted_on[r]`` is the replica that guaranteed request ``r`` (-1: none). It is read lazily: a request that
    left, was demoted or was moved by someone else no longer counts as admitted there.
    """

    def __init__(self, config: SLOsServeConfig) -> None:
        self.config = config
        self.sim: "Simulator | None" = None

    def reset(self, sim: "Simulator") -> None:
        self.sim = sim
        w = sim.w
        self.alpha = sim.spec_acceptance if self.config.alpha is None else self.config.alpha
        # speculation is the batch-time-adaptive part of batch formation (§3.2.3): without dynamic batch sizing
        # the batch time is fixed and App. D's optimum there is sl = 1 for every tier, so nothing speculates
        self.max_sl = self.config.max_sl if self.alpha > 0 and self.config.dynamic_batch else 1
        self.admitted_on = np.full(len(w), -1, np.int64)
        tp = w.min_tpot
        self.tpot = np.where(np.isfinite(tp), tp, NO_SLO_TPOT)  # tightest-SLO rule (§3.2.1 "Multi-Decode SLOs")
        finite = self.tpot[np.isfinite(w.min_tpot)]
        self.tightest = float(finite.min()) if finite.size else NO_SLO_TPOT
        # largest context a request reaches (prompt + every output token + drafts): its memory m_i
        tok = np.where(w.stage_kind != StageKind.EXTERNAL, w.stage_tokens, 0)
        c = np.concatenate(([0], np.cumsum(tok)))
        self.max_ctx = c[w.stage_ptr[1:]] - c[w.stage_ptr[:-1]] + (self.max_sl - 1)
        self.planners = [Planner(self, inst) for inst in sim.instances]

    def planner(self, inst: Instance) -> Planner:
        while inst.id >= len(self.planners):  # replicas added by a scaler
            self.planners.append(Planner(self, self.sim.instances[len(self.planners)]))
        return self.planners[inst.id]


class Planner:
    """One replica's SLOs-Serve scheduler state: its admitted set (in :class:`SLOsServeState`), admission (the DP)
    and the per-iteration batch plan (App. D for the current decode counts)."""

    def __init__(self, state: SLOsServeState, inst: Instance) -> None:
        self.state, self.inst = state, inst
        self._plans: dict[tuple[int, ...], tuple[float, np.ndarray]] = {}
        self._inverse: dict[tuple[int, int, int], BatchTimeInverse] = {}
        self.busy_until = 0.0  # end of the iteration this replica's scheduler launched last
        self.invocations = 0

    # ------------------------------------------------------------------ the admitted set
    def admitted(self) -> np.ndarray:
        """Requests this replica guarantees that are still on it, or admitted at routing and not yet placed
        (stale entries -- departed, demoted, placed elsewhere -- are cleared lazily)."""
        st, rs = self.state, self.state.sim.rs
        cand = np.flatnonzero(st.admitted_on == self.inst.id)
        if not cand.size:
            return cand
        status = rs.status[cand]
        here = (rs.instance[cand] == self.inst.id) & (status >= Status.WAITING) & (status != Status.DONE)
        keep = ~rs.be[cand] & (here | (status <= Status.QUEUED))
        st.admitted_on[cand[~keep]] = -1
        return cand[keep]

    def is_admitted(self, idx: np.ndarray) -> np.ndarray:
        return self.state.admitted_on[idx] == self.inst.id

    # ------------------------------------------------------------------ admission (Alg. 1 line 2)
    def time2bs(self, decode_seqs: int, decode_ctx: int, past: int) -> BatchTimeInverse:
        """``time2bs`` for the replica's current load, cached per bucket of (running decodes: 8, KV tokens read:
        16k, prompt length: 256), built at the bucket's upper edge so the cached table stays conservative."""
        key = (decode_seqs >> 3, decode_ctx >> 14, past >> 8)
        inv = self._inverse.get(key)
        if inv is None:
            eng = self.inst.engine
            up = lambda v, b: ((v >> b) + 1) << b  # noqa: E731
            inv = BatchTimeInverse(eng, int(eng.max_num_batched_tokens), self.state.max_sl - 1, up(decode_seqs, 3),
                                   up(decode_ctx, 14), up(past, 8), self.state.config.grid_step)
            if len(self._inverse) > 256:
                self._inverse.clear()
            self._inverse[key] = inv
        return inv

    def problem(self, new: np.ndarray, now: float) -> tuple[AdmissionProblem, np.ndarray, PlanFn, BatchTimeInverse]:
        """The DP input for admitting ``new`` on top of this replica's admitted requests."""
        st, sim = self.state, self.state.sim
        rs, w, inst = sim.rs, sim.w, self.inst
        adm = self.admitted()
        adm = adm[~np.isin(adm, new)]
        tiers_tp = np.unique(st.tpot[np.concatenate((adm, new))])
        if not st.config.dynamic_batch:
            tiers_tp = np.unique(np.append(tiers_tp, st.tightest))
        tier_of = lambda idx: np.searchsorted(tiers_tp, st.tpot[idx])  # noqa: E731
        remaining = rs.num_tokens[adm] - rs.num_computed[adm]
        in_prefill = ((w.stage_kind[rs.stage[adm]] == _PREFILL) | (remaining > 1)) & \
                     (rs.status[adm] != Status.EXTERNAL)
        pos_f = adm[in_prefill]
        dec_f = adm[~in_prefill]
        base = np.bincount(tier_of(dec_f), minlength=tiers_tp.size).astype(np.int64)
        bs = inst.block_size
        forced_blocks = int((-(-st.max_ctx[adm] // bs)).sum())
        free_new = inst.total_blocks - forced_blocks
        M = st.config.mem_units
        unit = free_new / M if free_new > 0 else 0.0
        blocks_new = -(-st.max_ctx[new] // bs)
        mem_new = np.ceil(blocks_new / unit).astype(np.int64) if unit > 0 else np.full(new.size, M + 1)
        pos = np.concatenate((pos_f, new))
        # budget accrues from the end of the iteration in flight
        origin = max(now, self.busy_until) if inst.inflight is not None else now
        dl = np.minimum(rs.next_deadline(w, pos) - origin, HORIZON)
        prefill = (rs.num_tokens[pos] - rs.num_computed[pos]).astype(np.int64)
        run = inst.running_array()
        ctx = int((rs.num_computed[run] + 1).sum()) if run.size else 0
        past = int(np.mean(w.input_tokens[pos])) if pos.size else 0
        inv = self.time2bs(int(run.size), ctx, past)
        due = np.sort(rs.next_deadline(w, dec_f) - origin)
        if pos_f.size:
            dl[:pos_f.size] = self._late_deadlines(dl[:pos_f.size], prefill[:pos_f.size], base, tiers_tp, due,
                                                   int(run.size), inv)
        prob = AdmissionProblem(
            deadline=dl,
            prefill=prefill,
            memory=np.concatenate((np.zeros(pos_f.size, np.int64), mem_new)),
            tier=tier_of(pos).astype(np.int64),
            forced=np.concatenate((np.ones(pos_f.size, bool), np.zeros(new.size, bool))),
            base=base, tpot=tiers_tp, mem_units=M, due=due, n_run=int(run.size))
        if st.config.dynamic_batch:
            def plan(g: np.ndarray) -> PartialBatch:
                return speculation_plan(g, tiers_tp, st.alpha, st.max_sl, inv)
        else:
            def plan(g: np.ndarray) -> PartialBatch:
                return self._fixed_plan(g, tiers_tp, inv)
        return prob, pos, plan, inv

    @staticmethod
    def _late_deadlines(dl: np.ndarray, prefill: np.ndarray, base: np.ndarray, tiers_tp: np.ndarray,
                        due: np.ndarray, n_run: int, inv: BatchTimeInverse) -> np.ndarray:
        """Deadlines of the admitted requests still prefilling, for the DP: an admitted request already late in
        the model -- its prefill (with the earlier-deadline ones before it) fits neither in the next batch,
        ending at its deadline with only the decodes due by then, nor before ``prefill / peak + one batch of
        the running decodes' tightest TPOT`` -- gets that time instead, so the forced set stays feasible."""
        T0 = float(tiers_tp[base > 0].min()) if (base > 0).any() else 0.0
        soonest = prefill / inv.peak_rate + max(inv.min_time, T0)
        if not (dl < soonest).any():
            return dl
        order = np.argsort(dl, kind="stable")
        cum = np.empty_like(dl)
        cum[order] = np.cumsum(prefill[order])
        t = np.maximum(dl, 0.0)
        n_due = np.searchsorted(due, t + T0)
        fits = (t < T0) & (cum + n_due <= inv(t, 0, n_due / max(n_run, 1)))
        return np.where((dl < soonest) & ~fits, soonest, dl)

    def _fixed_plan(self, g: np.ndarray, tiers_tp: np.ndarray, inv: BatchTimeInverse) -> PartialBatch:
        """Ablation without dynamic batch sizing: every batch takes the workload's tightest TPOT (Sarathi's
        fixed budget, §6 "Baseline") whatever is running; no speculation (a fixed token budget)."""
        t0 = self.state.tightest
        demand = (g * (t0 / tiers_tp)[None]).sum(axis=1)
        share = np.minimum(demand / np.maximum(g.sum(axis=1), 1), 1.0)
        zero = np.zeros(g.shape[0], np.int64)
        return PartialBatch(np.full(g.shape[0], t0), inv(np.full(g.shape[0], t0), zero, share) - demand, demand,
                            zero, np.ones(g.shape, np.int64), share)

    def admit(self, new: np.ndarray, now: float) -> np.ndarray:
        """Run the DP for ``new`` requests; record and return which are admitted (Alg. 1 lines 2-3)."""
        new = np.asarray(new, np.int64)
        st = self.state
        if not st.config.admission:
            ok = np.ones(new.size, bool)
        else:
            self.invocations += 1
            prob, pos, plan, inv = self.problem(new, now)
            res = solve_admission(prob, plan, inv)
            ok = res.accepted[pos.size - new.size:]
        st.admitted_on[new[ok]] = self.inst.id
        return ok

    # ------------------------------------------------------------------ batch plan for the current decodes
    def batch_plan(self, counts: np.ndarray, tiers_tp: np.ndarray, decode_seqs: int, decode_ctx: int, past: int
                   ) -> tuple[float, np.ndarray]:
        """(batch time, verified tokens per tier) for the running decode counts (Alg. 2 / App. D); cached per
        counts, tiers and context bucket (64k KV tokens), so ``time2bs`` is rebuilt only when they change."""
        key = tuple(counts.tolist()) + tuple(tiers_tp.tolist()) + (decode_ctx >> 16,)
        hit = self._plans.get(key)
        if hit is None:
            if self.state.config.dynamic_batch:
                inv = self.time2bs(decode_seqs, decode_ctx, past)
                pb = speculation_plan(counts[None], tiers_tp, self.state.alpha, self.state.max_sl, inv)
                T, sl = float(pb.time[0]), pb.sl[0]
                if not math.isfinite(T):  # overloaded: keep the tightest deadline, no speculation
                    T, sl = float(tiers_tp[counts > 0].min()), np.ones(tiers_tp.size, np.int64)
            else:
                T, sl = self.state.tightest, np.ones(tiers_tp.size, np.int64)
            hit = (T, np.asarray(sl, np.int64))
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = hit
        return hit


# ================================================================================ router (§4.2) and scheduler
class SLOsServeRouter(Router):
    """SLO-driven routing (§4.2): round-robin first placement, then sequential re-routing of requests whose SLOs
    the replica cannot attain, up to ``route_limit`` replicas; then the backup policy (best-effort or decline).

    Only replicas that accept new requests are candidates (``Simulator.accepting_instances``: ACTIVE, colocated
    or prefill role) -- a starting, draining or decode-only instance is skipped; with none accepting: DEFER."""

    coupled = True  # admission reads every replica's running set

    def __init__(self, state: SLOsServeState) -> None:
        self.state = state

    def reset(self, sim: "Simulator") -> None:
        self.state.reset(sim)
        self._next = 0

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        st = self.state
        cands = sim.accepting_instances(ENTRY_ROLES)  # ACTIVE colocated/prefill replicas only (Fig. 7)
        prev = int(st.admitted_on[req])
        if prev >= 0 and sim.rs.status[req] <= Status.QUEUED:  # asked again (an env's expert query, a DEFER)
            if prev in cands:
                return prev
            st.admitted_on[req] = -1  # that replica stopped accepting: decide afresh
        if not cands:  # every replica starting or draining: the simulator offers the request again later
            return DEFER
        n = len(cands)
        start = self._next % n
        self._next += 1
        limit = min(st.config.route_limit or n, n)
        new = np.array([req], np.int64)
        for a in range(limit):
            inst = sim.instances[cands[(start + a) % n]]
            if st.planner(inst).admit(new, now)[0]:
                return inst.id
        return BEST_EFFORT if st.config.backup == "best_effort" else REJECT


class SLOsServeScheduler(Scheduler):
    """Per-iteration batch formation (Alg. 2 with App. D's speculation and §4.1's best-effort tier)."""

    def __init__(self, state: SLOsServeState) -> None:
        self.state = state

    def reset(self, sim: "Simulator") -> None:
        self.state.reset(sim)

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        st = self.state
        sim = st.sim
        rs, w = sim.rs, sim.w
        pl = st.planner(inst)
        demote = self._admit_placed(pl, inst, now)
        dec, pre = split_running(inst)
        waiting = np.array([r for r in inst.waiting if r not in demote], np.int64)
        if not (dec.size or pre.size or waiting.size):
            return Batch(demote=tuple(demote)) if demote else None
        adm_d = pl.is_admitted(dec) & ~rs.be[dec]
        a_dec, b_dec = dec[adm_d], dec[~adm_d]
        pend = np.concatenate((pre, waiting))
        adm_p = pl.is_admitted(pend) & ~rs.be[pend]
        a_pre, b_pre = pend[adm_p], pend[~adm_p]
        a_pre = a_pre[np.argsort(rs.next_deadline(w, a_pre), kind="stable")]   # EDF by prefill deadline
        # Alg. 2 line 1 / App. D: batch time and speculation from the admitted decodes' tiers
        tiers_tp = np.unique(st.tpot[a_dec]) if a_dec.size else np.zeros(0)
        is_dec_stage = w.stage_kind[rs.stage[a_dec]] == _DECODE
        ctx = int((rs.num_computed[dec] + 1).sum()) if dec.size else 0
        if a_dec.size:
            counts = np.bincount(np.searchsorted(tiers_tp, st.tpot[a_dec]), minlength=tiers_tp.size)
            past = int(np.mean(w.input_tokens[pend])) if pend.size else 0
            T, sl = pl.batch_plan(counts, tiers_tp, int(dec.size), ctx, past)
        else:  # admitted prefills decode right after: their tightest TPOT bounds the batch (none: best-effort only)
            T, sl = (float(st.tpot[a_pre].min()) if a_pre.size else math.inf), np.ones(0, np.int64)
        dl = rs.next_deadline(w, a_dec)
        order = np.argsort(dl, kind="stable")
        a_dec, dl, is_dec_stage = a_dec[order], dl[order], is_dec_stage[order]
        T_batch = self._align(pl, inst, now, T, a_pre, dl, int(dec.size), ctx)
        # decodes due before the next batch could end (Alg. 2 lines 8-14), EDF; late ones tightened (§3.2.3).
        # The batch ends by the earliest due token deadline still ahead (Alg. 2: no decode waits past its TPOT)
        due = dl < now + T_batch + T
        ahead = dl[due] - now
        ahead = ahead[ahead > 0]
        if ahead.size and ahead[0] < T_batch:
            T_batch = float(ahead[0])
            due = dl < now + T_batch + T
        spec = np.zeros(a_dec.size, np.int64)
        if st.max_sl > 1 and a_dec.size:
            spec = sl[np.searchsorted(tiers_tp, st.tpot[a_dec])] - 1
            spec = np.where(dl < now + T, sl[0] - 1, spec)  # late: the tightest tier's App. D length
            left = rs.stage_len[a_dec] - rs.gen_in_stage[a_dec] - 1  # drafts past the stage end are wasted
            spec = np.where(is_dec_stage & due, np.clip(spec, 0, np.maximum(left, 0)), 0)
        return self._form(inst, now, T_batch, a_dec[due], spec[due], a_pre, b_dec, b_pre, a_dec[~due], demote)

    def _align(self, pl: Planner, inst: Instance, now: float, T: float, a_pre: np.ndarray, dec_dl: np.ndarray,
               n_dec: int, ctx: int) -> float:
        """End the batch at the earliest admitted prefill deadline before ``now + T`` whose prefill (with the
        EDF ones before it) fits in the shortened batch: the DP's partial batch ending at that deadline. The
        shortened batch holds the admitted decodes due before the batch after it could end (``dec_dl``: their
        next token deadlines, sorted), so only their share of the decodes' context is read."""
        if not a_pre.size or not math.isfinite(T):
            return T
        sim = self.state.sim
        rs = sim.rs
        head = a_pre[:8]
        slack = rs.next_deadline(sim.w, head) - now
        need = np.cumsum(rs.num_tokens[head] - rs.num_computed[head])
        inv = pl.time2bs(n_dec, ctx, int(np.mean(sim.w.input_tokens[head])))
        n_due = np.searchsorted(dec_dl, now + slack + T)
        fits = (slack < T) & (slack > 0) & (need + n_due <= inv(np.maximum(slack, 0.0), 0, n_due / max(n_dec, 1)))
        return float(slack[fits.argmax()]) if fits.any() else T

    def _admit_placed(self, pl: Planner, inst: Instance, now: float) -> list[int]:
        """Requests placed here without an admission decision (not by this router): the DP admits them or they
        are demoted to best-effort (Alg. 1 lines 2-6)."""
        rs = self.state.sim.rs
        if not inst.waiting:
            return []
        wt = np.array(inst.waiting, np.int64)
        new = wt[~pl.is_admitted(wt) & ~rs.be[wt] & np.isnan(rs.first_scheduled[wt])]
        if not new.size:
            return []
        ok = pl.admit(new, now)
        return new[~ok].tolist()

    def _form(self, inst: Instance, now: float, T: float, due: np.ndarray, spec: np.ndarray, a_pre: np.ndarray,
              b_dec: np.ndarray, b_pre: np.ndarray, not_due: np.ndarray, demote: list[int]) -> Batch | None:
        """Fill the batch in priority order within ``time2bs(T)``: due admitted decodes (with drafts), admitted
        prefills EDF, best-effort decodes, best-effort prefills, then admitted decodes not yet due."""
        st = self.state
        rs = st.sim.rs
        bs = inst.block_size
        eng = inst.engine
        adm = st.admitted_on == inst.id
        # KV reserved for the admitted requests' future growth; best-effort work may only use the rest (§4.1)
        a_all = np.flatnonzero(adm & ~rs.be & (rs.status != Status.DONE) & (rs.instance == inst.id))
        reserve = int(np.maximum(-(-st.max_ctx[a_all] // bs) - rs.kv_blocks[a_all], 0).sum())
        free = inst.free_blocks
        preempt: list[int] = []
        be_running = [r for r in inst.running if not adm[r] or rs.be[r]]
        if free < reserve and be_running:  # new admissions: preempt best-effort requests (recompute)
            for r in sorted(be_running, key=lambda r: -int(rs.kv_blocks[r])):
                if free >= reserve:
                    break
                preempt.append(r)
                free += int(rs.kv_blocks[r])
            gone = set(preempt)
            b_dec = np.array([r for r in b_dec.tolist() if r not in gone], np.int64)
            b_pre = np.array([r for r in b_pre.tolist() if r not in gone], np.int64)
        cap = int(eng.max_num_batched_tokens) if not math.isfinite(T) else None
        reqs, toks, sps = self._fill(inst, T, cap, due, spec, a_pre, b_dec, b_pre, not_due, free, reserve)
        if not reqs and not preempt and not demote:
            # nothing fits in KV (only without admission control): preempt the latest-deadline request
            dl = dict(zip(inst.running, rs.next_deadline(st.sim.w, inst.running_array()).tolist()))
            return unstick(inst, lambda r: dl[r])
        if reqs:
            st.planner(inst).busy_until = now + self._time(inst, reqs, toks, sps)
        return Batch(req=np.asarray(reqs, np.int64), tokens=np.asarray(toks, np.int64),
                     spec=np.asarray(sps, np.int64) if any(sps) else None, preempt=tuple(preempt),
                     demote=tuple(demote))

    def _fill(self, inst: Instance, T: float, cap: int | None, due: np.ndarray, spec: np.ndarray,
              a_pre: np.ndarray, b_dec: np.ndarray, b_pre: np.ndarray, not_due: np.ndarray, free: int,
              reserve: int) -> tuple[list[int], list[int], list[int]]:
        """Greedy fill within the token budget. When the exact batch time exceeds ``T`` (the budget counts tokens,
        not the context the optional decodes read), the optional tail (best-effort work, decodes not yet due) is
        cut to the longest prefix within ``T``; if the guaranteed part alone is too long, the budget shrinks."""
        rs = self.state.sim.rs
        bs = inst.block_size
        budget = cap if cap is not None else self._budget(inst, T, due, spec)
        for _ in range(4):
            reqs, toks, sps = [], [], []
            left, kv = budget, free
            max_seqs = int(inst.engine.max_num_seqs)

            def add_decode(r: int, s: int, limit: int) -> None:
                nonlocal left, kv
                need = max(-(-(int(rs.num_computed[r]) + 1 + s) // bs) - int(rs.kv_blocks[r]), 0)
                if s and (need > kv - limit or left < 1 + s):
                    s = 0
                    need = max(-(-(int(rs.num_computed[r]) + 1) // bs) - int(rs.kv_blocks[r]), 0)
                if need > kv - limit or left < 1 or len(reqs) >= max_seqs:
                    return
                reqs.append(r), toks.append(1), sps.append(s)
                left -= 1 + s
                kv -= need

            def add_prefill(r: int, limit: int) -> None:
                nonlocal left, kv
                nc = int(rs.num_computed[r])
                rem = int(rs.num_tokens[r]) - nc
                fits = (kv - limit + int(rs.kv_blocks[r])) * bs - nc
                chunk = min(rem, left, fits)
                if chunk < 1 or len(reqs) >= max_seqs:
                    return
                reqs.append(r), toks.append(chunk), sps.append(0)
                left -= chunk
                kv -= max(-(-(nc + chunk) // bs) - int(rs.kv_blocks[r]), 0)

            for r, s in zip(due.tolist(), spec.tolist()):
                add_decode(r, int(s), 0)
            for r in a_pre.tolist():
                add_prefill(r, 0)
            core = len(reqs)
            for r in b_dec.tolist():
                add_decode(r, 0, reserve)
            for r in b_pre.tolist():
                add_prefill(r, reserve)
            for r in not_due.tolist():
                add_decode(r, 0, 0)
            if not math.isfinite(T) or not reqs or self._time(inst, reqs, toks, sps) <= T:
                return reqs, toks, sps
            if core < len(reqs) and self._time(inst, reqs[:core], toks[:core], sps[:core]) <= T:
                lo, hi = core, len(reqs) - 1  # bisect the longest prefix within T (time grows with the prefix)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self._time(inst, reqs[:mid], toks[:mid], sps[:mid]) <= T else (lo, mid - 1)
                return reqs[:lo], toks[:lo], sps[:lo]
            if budget <= len(due):
                return reqs, toks, sps
            budget = max(int(budget * 0.9), len(due))
        return reqs, toks, sps

    def _budget(self, inst: Instance, T: float, due: np.ndarray, spec: np.ndarray) -> int:
        """``time2bs(T)`` for this batch: decodes exact, the rest as one prefill chunk (vectorized grid)."""
        rs = self.state.sim.rs
        dtok = int(due.size + spec.sum())
        ctx = int((rs.num_computed[due] + 1 + spec).sum()) if due.size else 0
        steps = int(spec.max()) if spec.size else 0
        top = int(inst.engine.max_num_batched_tokens)
        x = np.arange(0, top + 1, self.state.config.grid_step, dtype=np.int64)
        f = BatchFeatures.build(prefill_tokens=x, prefill_seqs=(x > 0), prefill_attn=x * x, prefill_sq=x * x,
                                decode_seqs=due.size, decode_tokens=dtok, decode_ctx=ctx, kv_tokens=ctx + x,
                                spec_steps=steps)
        t = np.asarray(inst.engine.batch_time(f), np.float64)
        ok = np.flatnonzero(t <= T)
        return dtok + (int(x[ok[-1]]) if ok.size else 0)

    @staticmethod
    def _time(inst: Instance, reqs: list[int], toks: list[int], sps: list[int]) -> float:
        """Exact modeled time of the formed batch (the simulator's features of it)."""
        idx = np.asarray(reqs, np.int64)
        blocks = np.empty(idx.size, np.int64)
        *f, _ = kernels.batch_features(inst.sim.rs.I, idx, np.asarray(toks, np.int64), np.asarray(sps, np.int64),
                                       inst.block_size, blocks)
        return float(inst.time_one(BatchFeatures(*f)))


# ================================================================================ policies
def _policy(name: str, **overrides: Any) -> Callable[..., Policy]:
    def make(engine: Any = None, **params: Any) -> Policy:
        cfg = SLOsServeConfig(**(overrides | params))
        state = SLOsServeState(cfg)
        return Policy(name=name, scheduler=SLOsServeScheduler(state), router=SLOsServeRouter(state),
                      params={"scheduler": "SLOsServeScheduler", "router": "SLOsServeRouter"}
                      | dataclasses.asdict(cfg))
    return make


POLICIES: dict[str, Callable[..., Policy]] = {
    "slos-serve": _policy("slos-serve"),
    "slos-serve-no-spec": _policy("slos-serve-no-spec", max_sl=1),
    "slos-serve-no-dbs": _policy("slos-serve-no-dbs", dynamic_batch=False),
    "slos-serve-no-admission": _policy("slos-serve-no-admission", admission=False),
}

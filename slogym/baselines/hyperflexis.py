"""HyperFlexis (2025): multi-SLO-aware dispatching, priority-based SLO mapping and threshold scaling.

The extracted paper lost most symbols of its formulas and omits the pseudo code of Algorithms 1 and 3; this
module states what it reconstructed from the prose (each piece's docstring repeats it where it is used).

**Latency model (§3 Eq. 1-2, App. A).** Prefill time of a batch ``T_p = a + b * sum(l) + c * sum(l^2)`` (DistServe's
quadratic form) and one decode step ``T_d = d0 + d1 * B + d2 * sum(ctx)`` (``B`` the batch size: the "batching
effects" term; ``ctx`` each request's current length). App. A fits the coefficients by least squares on the squared
*relative* error over profiled batches (batch sizes 1..192 x input lengths 4..2020); slogym profiles the engine's
perf model on that grid (:meth:`LatencyModel.fit`).

**Token budget (§5.1 Eq. 5, App. B, Eq. 7).** A worker that dispatches a prefill batch of duration ``T_p`` stalls its
ongoing decodes; they recover the stall during the next ``k`` decode steps, each of which leaves ``TPOT - D`` of
slack (``D`` the estimated decode step of the ongoing requests; the "time-saving rate" is ``(TPOT - D) / TPOT``):
``k = T_p / (TPOT - D)``. The worker's next maturity is therefore ``T_p + k * D = T_p * TPOT / (TPOT - D)`` after the
dispatch, and in the worst case (App. B) a request arriving right after a dispatch waits that long, so
``T_p * TPOT / (TPOT - D) <= TTFT``. Dropping the quadratic term and the request's own prefill (App. B) and solving
with ``T_p = a + b * ntoken`` gives the reconstructed Eq. 5:
``ntoken = (TTFT * (TPOT - D) / TPOT - a) / b`` with the tightest TTFT and TPOT targets.

**Dispatcher (§5.1, Algorithm 1).** (1) The worker with the earliest maturity time is taken from a priority queue
(:class:`WorkerQueue`); (2) its budget is Eq. 5; (3) the request queue, ordered by TPOT SLO then TTFT SLO then
arrival, is scanned for requests that fit; (4) a request is admitted only if its probability of meeting its TTFT
(:func:`ttft_probability`) reaches ``admit_threshold``; (5) the batch is dispatched, the worker's maturity time is
recomputed from the predicted processing time and pushed back into the queue.

Deviation (central queue): slogym's simulator offers a deferred request again only when some request finishes, so
it could not be released at a worker's maturity time; the global queue is therefore kept as per-worker queues
bound at arrival. :class:`HyperFlexisDispatcher` binds each arriving request to the worker at the top of the
maturity queue, whose key is its *shadow* maturity (its next maturity plus the batches already bound to it, App. B's
interval each), and rejects it when its TTFT probability at that predicted start is below the threshold (this is
the decision Admission-v0 / Routing-v0 see). :class:`HyperFlexisScheduler` (the worker) holds its queue until its
maturity time, then runs steps 2-5; a queued request whose TTFT probability has fallen below the threshold by then
is not admitted and is demoted to best-effort (it runs only on budget no SLO request can use).

**Priority-based SLO mapping (§5.2, Eq. 6).** :class:`SLOMapper` (policies ``hyperflexis-pm``) derives TTFT and TPOT
targets from priorities over sliding windows of recent completions; see its docstring.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from slogym.baselines.common import (batch_of, decode_batch, make_room_for_decodes, split_colocated,
                                     split_running, unstick)
from slogym.core.batch import Batch, BatchFeatures
from slogym.core.errors import SchedulerError
from slogym.core.instance import Instance, InstanceState, Role
from slogym.core.policy import BEST_EFFORT, DEFER, REJECT, Policy, Router, Scaler, Scheduler
from slogym.core.state import Outcome, Status

if TYPE_CHECKING:
    from slogym.core.simulator import Simulator

INF = math.inf

#: App. A profiling grid: batch sizes and input lengths
PROFILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192)
PROFILE_LENGTHS = (4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 284, 512, 768, 1024, 1536, 2020)


# ============================================================================ latency model (Eq. 1-2, App. A)
@dataclass(frozen=True)
class LatencyModel:
    """Eq. 1 prefill ``a + b * sum(l) + c * sum(l^2)`` and Eq. 2 decode ``d0 + d1 * B + d2 * sum(ctx)`` (seconds).

    The symbols of Eq. 1-2 were lost in extraction; the forms follow the prose (quadratic prefill "as DistServe",
    decode linear in the current lengths plus a batch-size term for "batching effects").
    """

    a: float
    b: float
    c: float
    d0: float
    d1: float
    d2: float

    @classmethod
    def fit(cls, engine: Any, max_tokens: int = 16384) -> "LatencyModel":
        """Least squares on the relative error (App. A) over the App. A grid, timed by ``engine``'s perf model;
        prefill batches above ``max_tokens`` tokens are left out (the engine never runs them)."""
        B, L = (np.array(v, dtype=np.int64) for v in np.meshgrid(PROFILE_BATCH_SIZES, PROFILE_LENGTHS))
        B, L = B.ravel(), L.ravel()
        pre = B * L <= max_tokens
        bp, lp = B[pre], L[pre]
        t_pre = np.asarray(engine.batch_time(BatchFeatures.build(
            prefill_tokens=bp * lp, prefill_seqs=bp, prefill_attn=bp * lp * lp, prefill_sq=bp * lp * lp,
            kv_tokens=bp * lp)), dtype=np.float64)
        t_dec = np.asarray(engine.batch_time(BatchFeatures.build(
            decode_seqs=B, decode_tokens=B, decode_ctx=B * L, kv_tokens=B * (L + 1))), dtype=np.float64)
        a, b, c = _relative_lstsq(np.column_stack([np.ones(bp.size), bp * lp, bp * lp * lp]), t_pre)
        d0, d1, d2 = _relative_lstsq(np.column_stack([np.ones(B.size), B, B * L]), t_dec)
        return cls(a, max(b, 1e-12), c, d0, d1, d2)

    def prefill_time(self, tokens: float, sq: float | None = None) -> float:
        """Eq. 1 for a batch of ``tokens`` prompt tokens (``sq`` = sum of squared lengths; default one prompt)."""
        return self.a + self.b * tokens + self.c * (tokens * tokens if sq is None else sq)

    def decode_time(self, n: int, ctx: float) -> float:
        """Eq. 2: one decode step of ``n`` requests holding ``ctx`` tokens in total (0 when ``n == 0``)."""
        return self.d0 + self.d1 * n + self.d2 * ctx if n else 0.0


def _relative_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    w = 1.0 / y
    return np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]


# ============================================================================ Eq. 5 / App. B and admission
def token_budget(ttft: float, tpot: float, decode_cost: float, a: float, b: float) -> float:
    """Reconstructed Eq. 5: ``ntoken = (TTFT * (TPOT - D) / TPOT - a) / b`` (module doc), at least 0.

    ``tpot = inf`` (no ongoing decode, or none with a TPOT SLO) gives ``(TTFT - a) / b``; ``ttft = inf`` an
    unbounded budget; ``TPOT <= D`` (the decodes already use all their slack) a budget of 0.
    """
    rate = 1.0 if tpot == INF else max(tpot - decode_cost, 0.0) / tpot
    if ttft == INF:
        return INF if rate > 0 else 0.0
    return max((ttft * rate - a) / b, 0.0)


def maturity_interval(prefill_time: float, tpot: float, decode_cost: float) -> float:
    """App. B: time from a dispatch until the worker is mature again: the prefill plus the ``k`` decode steps that
    amortize its stall, ``k = ceil(T_p / (TPOT - D))`` (0 without ongoing TPOT-bound decodes). When ``TPOT <= D``
    the decodes cannot amortize anything; they get one step before the next dispatch (not in the paper)."""
    if tpot == INF or decode_cost <= 0.0:
        return prefill_time
    slack = tpot - decode_cost
    if slack <= 0.0:
        return prefill_time + decode_cost
    return prefill_time + math.ceil(prefill_time / slack) * decode_cost


def ttft_probability(waited: float, ttft: float, remaining: float, utilization: float, cv: float = 0.5) -> float:
    """§5.1 step 4: probability that a request meets its TTFT given its waiting time, TTFT target, the estimated
    time until its prefill completes (``remaining``: wait for the worker plus the prefill) and the worker's
    utilization ``u`` in [0, 1].

    The formula is not in the text; reconstructed as a normal prediction error whose spread grows with the
    prediction and with the worker's load: ``P = Phi((TTFT - waited - remaining) / (cv * (1 + u) * remaining))``.
    """
    if ttft == INF:
        return 1.0
    if remaining == INF:
        return 0.0
    slack = ttft - waited - remaining
    sigma = cv * (1.0 + utilization) * remaining
    if sigma <= 0.0:
        return 1.0 if slack >= 0.0 else 0.0
    return 0.5 * (1.0 + math.erf(slack / (sigma * math.sqrt(2.0))))


# ============================================================================ worker priority queue (§5.1 step 1)
class WorkerQueue:
    """The Worker-Priority Queue: workers ordered by maturity time (ties: lower index), lazily updated.

    ``update(w, t)`` re-inserts worker ``w`` with key ``t`` (older entries of ``w`` become stale);
    ``earliest(ok)`` returns the worker with the smallest key among those ``ok`` accepts.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._version: dict[int, int] = {}
        self.key: dict[int, float] = {}

    def update(self, w: int, t: float) -> None:
        v = self._version.get(w, 0) + 1
        self._version[w] = v
        self.key[w] = t
        heapq.heappush(self._heap, (t, w, v))

    def remove(self, w: int) -> None:
        self._version[w] = self._version.get(w, 0) + 1
        self.key.pop(w, None)

    def earliest(self, ok: Callable[[int], bool]) -> int | None:
        """Smallest-key worker with ``ok(w)``; stale entries are discarded, skipped valid ones kept."""
        skipped: list[tuple[float, int, int]] = []
        found = None
        while self._heap:
            t, w, v = self._heap[0]
            if v != self._version.get(w):
                heapq.heappop(self._heap)
                continue
            if ok(w):
                found = w
                break
            skipped.append(heapq.heappop(self._heap))
        for e in skipped:
            heapq.heappush(self._heap, e)
        return found


# ============================================================================ priority-based SLO mapping (§5.2)
class SLOMapper:
    """§5.2: TTFT/TPOT targets derived from priorities over sliding windows of recent completions.

    ``levels`` priority levels, paper convention ``P0`` = most important. ``ttft_bounds`` / ``tpot_bounds`` are
    ``(lower, upper)`` arrays per level. Steps (Fig. 2):

    1. a request's priority level ``p`` is the input;
    2. two windows of the last ``window`` completed requests keep (level, TTFT, mean TPOT, queueing delay);
    3. Eq. 6 (symbols lost, reconstructed from the prose): with the window's latencies sorted ascending, the index is
       ``base + offset``, ``base = sum_{q < p} n_q`` (completions of more important levels in the window) and
       ``offset = floor(offset_quantile * n_p)`` (the position inside the level's own slice; the paper's value is
       not given, the median by default), clipped to the window; the latency there is the provisional SLO;
    4. queue-spike correction (TTFT only): the chosen reference request's queueing delay minus that of the most
       recent completion of the same level is subtracted when positive;
    5. bounds: the upper bound always holds; the lower bound is the level's own while a more important request is
       pending, else relaxed to the next more important level's lower bound (lower levels may then finish sooner
       without overtaking more important ones). An empty window gives the upper bound.
    """

    def __init__(self, ttft_bounds: tuple[np.ndarray, np.ndarray], tpot_bounds: tuple[np.ndarray, np.ndarray],
                 window: int = 256, offset_quantile: float = 0.5) -> None:
        if window < 1 or not 0.0 <= offset_quantile <= 1.0:
            raise ValueError(f"window={window} must be >= 1, offset_quantile={offset_quantile} in [0, 1]")
        self.ttft_lo, self.ttft_hi = (np.asarray(x, dtype=np.float64) for x in ttft_bounds)
        self.tpot_lo, self.tpot_hi = (np.asarray(x, dtype=np.float64) for x in tpot_bounds)
        self.levels = int(self.ttft_lo.shape[0])
        for name, lo, hi in (("ttft", self.ttft_lo, self.ttft_hi), ("tpot", self.tpot_lo, self.tpot_hi)):
            if lo.shape != (self.levels,) or hi.shape != (self.levels,) or np.isnan(lo).any() or (lo > hi).any():
                raise ValueError(f"{name} bounds must be (lower, upper) arrays of {self.levels} levels with "
                                 f"lower <= upper; got {lo.tolist()}, {hi.tolist()}")
        self.window = window
        self.offset_quantile = offset_quantile
        self._ttft: deque[tuple[int, float, float]] = deque(maxlen=window)
        self._tpot: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, level: int, ttft: float, tpot: float, queue_delay: float) -> None:
        """A completed request of ``level`` enters the windows (NaN latencies are not recorded)."""
        if not math.isnan(ttft):
            self._ttft.append((level, ttft, queue_delay))
        if not math.isnan(tpot):
            self._tpot.append((level, tpot))

    def _index(self, levels: np.ndarray, p: int) -> int:
        base = int((levels < p).sum())
        offset = int(self.offset_quantile * int((levels == p).sum()))
        return min(base + offset, levels.size - 1)

    def _bounded(self, x: float, lo: np.ndarray, hi: np.ndarray, p: int, higher_pending: bool) -> float:
        low = lo[p] if higher_pending or p == 0 else lo[p - 1]
        return float(min(max(x, low), hi[p]))

    def map(self, level: int, higher_pending: bool) -> tuple[float, float]:
        """(TTFT, TPOT) targets for a new request of ``level`` (steps 3-5)."""
        if not 0 <= level < self.levels:
            raise ValueError(f"priority level {level} outside 0..{self.levels - 1}")
        ttft = self.ttft_hi[level]
        if self._ttft:
            win = np.array(self._ttft, dtype=np.float64)
            lv = win[:, 0].astype(np.int64)
            order = np.argsort(win[:, 1], kind="stable")
            ref = order[self._index(lv[order], level)]
            ttft = win[ref, 1]
            same = np.flatnonzero(lv == level)
            if same.size:  # step 4: the reference's extra queueing over the latest same-level completion
                ttft -= max(win[ref, 2] - win[same[-1], 2], 0.0)
        tpot = self.tpot_hi[level]
        if self._tpot:
            win = np.array(self._tpot, dtype=np.float64)
            order = np.argsort(win[:, 1], kind="stable")
            tpot = win[order[self._index(win[order, 0].astype(np.int64), level)], 1]
        return (self._bounded(ttft, self.ttft_lo, self.ttft_hi, level, higher_pending),
                self._bounded(tpot, self.tpot_lo, self.tpot_hi, level, higher_pending))


def mapper_for(sim: "Simulator", levels: np.ndarray, n_levels: int, spread: float, window: int,
               offset_quantile: float) -> SLOMapper:
    """The mapper of §7.3: per level, the workload's median TTFT/TPOT target is the upper bound and
    ``(1 - spread)`` times it the lower bound (the paper's range value was lost)."""
    w = sim.w
    hi_ttft, hi_tpot = np.empty(n_levels), np.empty(n_levels)
    for p in range(n_levels):
        sel = levels == p
        hi_ttft[p] = float(np.median(w.first_ttft[sel])) if sel.any() else INF
        hi_tpot[p] = float(np.median(w.min_tpot[sel])) if sel.any() else INF
    return SLOMapper(((1.0 - spread) * hi_ttft, hi_ttft), ((1.0 - spread) * hi_tpot, hi_tpot), window,
                     offset_quantile)


# ============================================================================ shared dispatcher state
class DispatcherState:
    """What the dispatcher, the workers' schedulers and the monitor share: the latency model, per-request SLO
    targets used for scheduling (the workload's, or the mapped ones), worker maturity times and the worker queue.

    Workers are the instances; their roles select the stage they serve (colocated, prefill, decode).
    """

    def __init__(self, admit_threshold: float, cv: float, monitor_interval: float, slo_mapping: bool,
                 spread: float, window: int, offset_quantile: float, reject: str) -> None:
        if not 0.0 <= admit_threshold <= 1.0:
            raise ValueError(f"admit_threshold={admit_threshold}; must be in [0, 1]")
        if not cv > 0 or not monitor_interval > 0 or not 0.0 <= spread < 1.0:
            raise ValueError(f"cv={cv} and monitor_interval={monitor_interval} must be > 0, spread={spread} in [0, 1)")
        if reject not in ("reject", "best_effort"):
            raise ValueError(f"reject={reject!r}; expected 'reject' or 'best_effort'")
        self.admit_threshold, self.cv, self.monitor_interval = admit_threshold, cv, monitor_interval
        self.slo_mapping, self.spread, self.window, self.offset_quantile = slo_mapping, spread, window, offset_quantile
        self.reject = reject
        self.sim: Simulator | None = None

    def reset(self, sim: "Simulator") -> None:
        self.sim = sim
        w = sim.w
        self.models: dict[str, LatencyModel] = {}
        self.ttft = w.first_ttft.astype(np.float64).copy()   # targets the scheduler works with
        self.tpot = w.min_tpot.astype(np.float64).copy()
        # paper levels: 0 = most important (workload priority: larger = more important)
        prios = np.unique(w.priority)
        self.level = (prios.size - 1 - np.searchsorted(prios, w.priority)).astype(np.int64)
        self.pending = np.zeros(max(prios.size, 1), np.int64)  # bound, not yet dispatched, per level
        self.mapper = (mapper_for(sim, self.level, prios.size, self.spread, self.window, self.offset_quantile)
                       if self.slo_mapping else None)
        finite = self.ttft[np.isfinite(self.ttft)]
        self.tightest_ttft = float(self.mapper.ttft_lo.min() if self.mapper else finite.min() if finite.size else INF)
        self.maturity = np.zeros(0)
        self.timer_at = np.zeros(0)
        self.workers = WorkerQueue()     # prefill-serving workers (colocated or prefill) by shadow maturity
        self.decoders = WorkerQueue()    # decode workers by the end of their next decode iteration
        self.tracked: list[int] = []
        self.mapped = np.zeros(len(w), bool)
        self.next_monitor = 0.0
        self.monitor(0.0)

    # ------------------------------------------------------------------ the model of one worker
    def model(self, inst: Instance) -> LatencyModel:
        m = self.models.get(inst.engine.name)
        if m is None:
            m = LatencyModel.fit(inst.engine, 2 * int(inst.engine.max_num_batched_tokens))
            self.models[inst.engine.name] = m
        return m

    def decode_cost(self, inst: Instance, dec: np.ndarray) -> float:
        """``D``: Eq. 2 for one step of the ongoing decodes ``dec``."""
        if not dec.size:
            return 0.0
        return self.model(inst).decode_time(int(dec.size), float((self.sim.rs.num_computed[dec] + 1).sum()))

    def outlook(self, inst: Instance, dec: np.ndarray) -> tuple[float, float, float]:
        """(Eq. 5 budget capped by the engine's batch limit, tightest ongoing TPOT, ``D``) of ``inst`` now."""
        m = self.model(inst)
        d = self.decode_cost(inst, dec)
        tpot = float(self.tpot[dec].min()) if dec.size else INF
        budget = min(token_budget(self.tightest_ttft, tpot, d, m.a, m.b), float(inst.engine.max_num_batched_tokens))
        return budget, tpot, d

    def decode_excess(self, inst: Instance, r: int) -> float:
        """Eq. 2 step time of decode worker ``inst`` with request ``r`` added to what it holds, minus the tightest
        TPOT among them (<= 0: the TPOT budget admits ``r``)."""
        rs = self.sim.rs
        held = np.asarray(inst.running + inst.waiting, dtype=np.int64)
        ctx = float((rs.num_computed[held] + 1).sum()) + float(rs.num_computed[r]) + 1.0
        tpot = min(float(self.tpot[held].min()) if held.size else INF, float(self.tpot[r]))
        return self.model(inst).decode_time(int(held.size) + 1, ctx) - tpot

    def utilization(self, inst: Instance) -> float:
        return max(inst.kv_utilization, len(inst.running) / float(inst.engine.max_num_seqs))

    def sort_key(self, r: int) -> tuple[bool, float, float, float]:
        """Request-queue order (§5.1 step 3): SLO requests before demoted ones, then TPOT, TTFT, arrival."""
        return (bool(self.sim.rs.be[r]), float(self.tpot[r]), float(self.ttft[r]), float(self.sim.w.arrival[r]))

    def ttft_target(self, r: int) -> float:
        """TTFT target of ``r``'s current prefill: the scheduling target of its first prefill (mapped under §5.2),
        a later prefill's own SLO (a tool result, measured from its return)."""
        sim = self.sim
        s = int(sim.rs.stage[r])
        return float(self.ttft[r]) if s == sim.w.stage_ptr[r] else float(sim.w.stage_ttft[s])

    def probability(self, r: int, inst: Instance, start: float, now: float, batch_tokens: int = 0) -> float:
        """TTFT probability of ``r`` if its prefill starts on ``inst`` at ``start`` in a batch of
        ``batch_tokens`` other prompt tokens."""
        rs = self.sim.rs
        l = int(rs.num_tokens[r] - rs.num_computed[r])
        remaining = max(start - now, 0.0) + self.model(inst).prefill_time(batch_tokens + l)
        return ttft_probability(now - float(rs.ready[r]), self.ttft_target(r), remaining, self.utilization(inst),
                                self.cv)

    # ------------------------------------------------------------------ shadow maturity and the monitor
    def shadow_maturity(self, inst: Instance, now: float, extra: float = 0.0) -> float:
        """When a request bound now would be dispatched: the worker's maturity plus one App. B interval per full
        budget of prompt tokens queued on it (``extra`` tokens added to the queue: a binding, or minus a dispatch)."""
        start = max(float(self.maturity[inst.id]), now)
        rs = self.sim.rs
        queued = extra
        if inst.waiting:
            wait = np.asarray(inst.waiting, dtype=np.int64)
            queued += float((rs.num_tokens[wait] - rs.num_computed[wait]).sum())
        if queued <= 0.0:
            return start
        dec, _ = split_running(inst)
        budget, tpot, d = self.outlook(inst, dec)
        n = len(inst.waiting) + (extra > 0.0)
        batch = max(budget, queued / max(n, 1))  # a prompt above the budget runs alone
        batches = math.floor(queued / batch)
        return start + batches * maturity_interval(self.model(inst).prefill_time(batch), tpot, d) if batches else start

    def refresh(self, inst: Instance, now: float) -> None:
        self.workers.update(inst.id, self.shadow_maturity(inst, now))

    def track_workers(self, now: float) -> None:
        """Per-worker state for instances the scaler added since the last call (they join the queues)."""
        sim = self.sim
        n0 = self.maturity.shape[0]
        if len(sim.instances) == n0:
            return
        self.maturity = np.concatenate((self.maturity, np.zeros(len(sim.instances) - n0)))
        self.timer_at = np.concatenate((self.timer_at, np.full(len(sim.instances) - n0, -INF)))
        for inst in sim.instances[n0:]:
            self.refresh(inst, now)
            self.decoders.update(inst.id, now)

    def monitor(self, now: float) -> None:
        """Periodic telemetry (§4): re-key every worker from its real state, recount pending requests per level,
        and feed completed requests to the SLO mapper's windows. Run from the dispatcher at arrivals at most every
        ``monitor_interval`` seconds (arrival times are the same whether or not the simulator fast-forwards)."""
        if now < self.next_monitor:
            return
        self.next_monitor = now + self.monitor_interval
        sim = self.sim
        self.track_workers(now)
        for inst in sim.instances:
            if inst.state == InstanceState.STOPPED:   # scaled in: out of both queues for good
                self.workers.remove(inst.id)
                self.decoders.remove(inst.id)
            else:
                self.refresh(inst, now)
        self.pending[:] = 0
        waiting = [r for inst in sim.instances for r in inst.waiting if np.isnan(sim.rs.first_scheduled[r])]
        np.add.at(self.pending, self.level[np.asarray(waiting, dtype=np.int64)], 1)
        if self.mapper is not None and self.tracked:
            self._observe_completions()

    def _observe_completions(self) -> None:
        rs, w = self.sim.rs, self.sim.w
        tr = np.asarray(self.tracked, dtype=np.int64)
        done = rs.status[tr] == Status.DONE
        for r in tr[done].tolist():
            if rs.outcome[r] in (Outcome.FINISHED, Outcome.BEST_EFFORT):
                n = int(rs.generated[r])
                tpot = (rs.last_token[r] - rs.first_token[r]) / (n - 1) if n > 1 else math.nan
                self.mapper.observe(int(self.level[r]), float(rs.first_token[r] - w.arrival[r]), float(tpot),
                                    float(rs.first_scheduled[r] - w.arrival[r]))
        self.tracked = tr[~done].tolist()

    def assign_slo(self, r: int) -> None:
        """§5.2: the mapped targets of an arriving request (pending more important requests make the bounds
        strict)."""
        p = int(self.level[r])
        self.ttft[r], self.tpot[r] = self.mapper.map(p, bool(self.pending[:p].any()))
        self.mapped[r] = True
        self.tracked.append(r)

    def ensure_timer(self, inst: Instance) -> None:
        """Wake ``inst`` at its maturity time (an idle worker with a queue waits for it)."""
        t = float(self.maturity[inst.id])
        if self.timer_at[inst.id] != t:
            self.timer_at[inst.id] = t
            self.sim.add_timer(t, _wake)


def _wake(sim: "Simulator", t: float) -> None:
    """Timer callback: nothing to change; the simulator offers idle instances work after every timer."""


# ============================================================================ the dispatcher and migrator (Router)
def _accepting(inst: Instance) -> bool:
    return inst.state == InstanceState.ACTIVE


def _serves_prefill(inst: Instance) -> bool:
    return inst.role != Role.DECODE and _accepting(inst)


class HyperFlexisDispatcher(Router):
    """§5.1 Dispatcher at arrival: bind the request to the earliest-maturing prefill-serving worker of the maturity
    queue, or reject it when its TTFT probability there is below ``admit_threshold`` (module doc, "Deviation").

    In P/D (§5.1 "PD-Disaggregated Architecture") it is the Dispatcher of the P-stage; :meth:`route_decode` is the
    Migrator of the D-stage.
    """

    pd_aware = True

    def __init__(self, state: DispatcherState) -> None:
        self.state = state

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        st = self.state
        st.track_workers(now)
        st.monitor(now)
        if st.mapper is not None and not st.mapped[req]:
            st.assign_slo(req)
        insts = sim.instances
        w = st.workers.earliest(lambda i: _serves_prefill(insts[i]))
        if w is None:
            raise SchedulerError(f"request {req}: no active worker serves prefills at t={now}")
        inst = insts[w]
        if st.probability(req, inst, st.workers.key[w], now) < st.admit_threshold:
            return REJECT if st.reject == "reject" else BEST_EFFORT
        st.pending[st.level[req]] += 1
        # shadow state: the bound request's tokens count toward this worker's next batches
        rs = sim.rs
        st.workers.update(w, st.shadow_maturity(inst, now, float(rs.num_tokens[req] - rs.num_computed[req])))
        return w

    def route_decode(self, req: int, sim: "Simulator", now: float) -> int:
        """The Migrator (§5.1): the decode worker maturing first (end of its next decode iteration) among those
        whose TPOT budget admits the request (Eq. 2 step time with it added within the tightest TPOT there);
        when none does, the one where the step time exceeds that TPOT the least."""
        st = self.state
        st.track_workers(now)
        insts = sim.instances
        ok = [i for i in range(len(insts)) if insts[i].role == Role.DECODE and _accepting(insts[i])]
        if not ok:
            return DEFER  # the simulator asks again when an instance becomes ready
        excess = {i: st.decode_excess(insts[i], req) for i in ok}
        fits = {i for i, e in excess.items() if e <= 0.0}
        w = st.decoders.earliest(lambda i: i in fits) if fits else None
        if w is None:
            w = min(ok, key=lambda i: (excess[i], i))
        st.decoders.update(w, max(st.decoders.key.get(w, now), now))
        return w

    def best_effort_instance(self, req: int, sim: "Simulator", now: float) -> int:
        insts = sim.instances
        ok = [i for i in range(len(insts)) if _serves_prefill(insts[i])]
        return min(ok, key=lambda i: (insts[i].n_resident, i))


class RoundRobinPDRouter(Router):
    """The paper's RR-PD baseline (§8.1.2): round-robin over the prefill workers at arrival and over the decode
    workers when a prefill completes (both over accepting workers of the stage)."""

    pd_aware = True

    def reset(self, sim: "Simulator") -> None:
        self._next = [0, 0]

    def _turn(self, sim: "Simulator", decode: bool, req: int, now: float) -> int:
        insts = sim.instances
        ok = [i for i in range(len(insts)) if _accepting(insts[i]) and (insts[i].role == Role.DECODE) == decode]
        if not ok:
            return DEFER
        i = ok[self._next[decode] % len(ok)]
        self._next[decode] += 1
        return i

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        return self._turn(sim, False, req, now)

    def route_decode(self, req: int, sim: "Simulator", now: float) -> int:
        return self._turn(sim, True, req, now)


# ============================================================================ the worker (Scheduler)
class HyperFlexisScheduler(Scheduler):
    """A worker under the dispatcher (§5.1).

    Colocated or prefill role: at its maturity time it dispatches the next prefill batch from its queue (Eq. 5
    budget, SLO order, TTFT-probability admission), otherwise it decodes every running request. Prefill batches are
    whole prompts, not mixed with decodes (vLLM-Ascend's static prefill, §5.1 "a prefill step in static batching is
    non-interruptible"). KV shortage preempts (recompute) the lowest-priority running request.

    Decode role (the D-stage under the Migrator): every decode iteration admits migrated requests from its queue in
    SLO order while the Eq. 2 step time stays within the tightest TPOT of the batch ("decisions at every iteration").

    ``pd=True`` (policies ``hyperflexis-pd*``) turns an all-colocated cluster into P/D at reset: the first
    ``ceil(prefill_fraction * n)`` instances become prefill workers, the rest decode workers (one instance stays
    colocated).
    """

    steady_through_finish = True

    def __init__(self, state: DispatcherState, max_num_seqs: int = 256, pd: bool = False,
                 prefill_fraction: float = 0.5) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}; must be >= 1")
        if not 0.0 < prefill_fraction < 1.0:
            raise ValueError(f"prefill_fraction={prefill_fraction}; must be in (0, 1)")
        self.state = state
        self.max_num_seqs = max_num_seqs
        self.pd = pd
        self.prefill_fraction = prefill_fraction

    def reset(self, sim: "Simulator") -> None:
        if self.pd:
            split_pd(sim, self.prefill_fraction)
        self.state.reset(sim)

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        st = self.state
        st.track_workers(now)
        if inst.role == Role.DECODE:
            return self._decode_iteration(inst, dec, pre, now)
        mature = now >= st.maturity[inst.id]
        if (inst.waiting or pre.size) and mature:
            batch = self._dispatch(inst, dec, pre, now)
            if batch is not None:
                return batch
        if inst.waiting and not mature:
            st.ensure_timer(inst)
        key = st.sort_key
        if not dec.size:
            return unstick(inst, key)
        keep, victims, _ = make_room_for_decodes(inst, dec, key)
        # steady only while the queue (if any) waits for the maturity timer: a mature worker whose queue did not
        # fit re-checks every iteration (its decode cost and the queue's TTFT probabilities move each step)
        return decode_batch(keep, victims, steady=not victims and not (inst.waiting and mature))

    def _dispatch(self, inst: Instance, dec: np.ndarray, pre: np.ndarray, now: float) -> Batch | None:
        """Algorithm 1 steps 2-5 on this worker; None when nothing can be dispatched now."""
        st, rs = self.state, inst.sim.rs
        budget, tpot, d = st.outlook(inst, dec)
        free = inst.free_blocks
        slots = self.max_num_seqs - dec.size
        reqs: list[int] = []
        toks: list[int] = []
        demote: list[int] = []
        used = 0
        for r in pre.tolist() + sorted(inst.waiting, key=st.sort_key):
            if len(reqs) >= slots:
                break
            if not rs.be[r] and st.probability(r, inst, now, now, used) < st.admit_threshold:
                demote.append(r)   # step 4: not admitted; it keeps a best-effort place in the queue
                continue
            l = int(rs.num_tokens[r] - rs.num_computed[r])
            blocks = inst.blocks_for_tokens(int(rs.num_computed[r]) + l) - int(rs.kv_blocks[r])
            if blocks > free or (used + l > budget and reqs):
                continue           # step 3: another request may still fit (the first one may exceed the
                                   # budget and then runs alone, as in vLLM, so that it is never starved)
            reqs.append(r)
            toks.append(l)
            used += l
            free -= blocks
        if not reqs:
            return Batch(demote=tuple(demote)) if demote else None
        tokens = np.asarray(toks, dtype=np.int64)
        t_p = st.model(inst).prefill_time(float(tokens.sum()), float((tokens * tokens).sum()))
        st.maturity[inst.id] = now + maturity_interval(t_p, tpot, d)
        first = [r for r in reqs if np.isnan(rs.first_scheduled[r])]
        np.subtract.at(st.pending, st.level[np.asarray(first, dtype=np.int64)], 1)
        np.maximum(st.pending, 0, out=st.pending)
        batch = batch_of(reqs, toks)
        batch.demote = tuple(demote)
        st.workers.update(inst.id, st.shadow_maturity(inst, now, -float(tokens.sum())))
        return batch

    def _decode_iteration(self, inst: Instance, dec: np.ndarray, pre: np.ndarray, now: float) -> Batch | None:
        """One D-stage iteration: the running decodes plus migrated requests admitted under the TPOT budget.

        A request preempted here lost its KV and can only resume on this worker: it recomputes its whole context
        in one chunk as soon as its KV fits (vLLM's recompute; the paper's migrator does not preempt, so this path
        only runs under KV pressure). Its cost is not in the TPOT check -- without it the request would starve.
        """
        st, rs = self.state, inst.sim.rs
        key = st.sort_key
        keep, victims, free = make_room_for_decodes(inst, dec, key) if dec.size else (dec, [], inst.free_blocks)
        reqs = keep.tolist()
        toks = [1] * len(reqs)
        model = st.model(inst)
        ctx = float((rs.num_computed[keep] + 1).sum())
        tpot = float(st.tpot[keep].min()) if keep.size else INF
        for r in pre.tolist() + sorted(inst.waiting, key=key) if not victims else ():
            if len(reqs) >= self.max_num_seqs:
                break
            left = int(rs.num_tokens[r] - rs.num_computed[r])
            need = int(inst.blocks_needed([r], left)[0])
            if need > free:
                continue
            if left == 1:  # a migrated request's first decode step: only within every member's TPOT
                t = min(tpot, float(st.tpot[r]))
                step = model.decode_time(len(reqs) + 1, ctx + float(rs.num_computed[r]) + 1)
                if reqs and step > t:
                    continue
                ctx += float(rs.num_computed[r]) + 1
                tpot = t
            reqs.append(r)
            toks.append(left)
            free -= need
        if not reqs:
            return unstick(inst, key) if not victims else batch_of([], [], victims)
        step = model.decode_time(len(reqs), ctx)
        st.decoders.update(inst.id, now + step)
        all_running = len(reqs) == keep.size and not inst.waiting and not pre.size
        # the Migrator reads each decode worker's next iteration end, recorded here: with a choice of workers that
        # record must be made every iteration, so no fast-forward past it (it would leave the record stale)
        alone = sum(i.role == Role.DECODE for i in inst.sim.instances) < 2
        return batch_of(reqs, toks, victims, steady=all_running and not victims and alone)


def split_pd(sim: "Simulator", prefill_fraction: float) -> None:
    """Make a colocated cluster P/D at reset, ``ceil(prefill_fraction x n)`` prefill instances (at least one of
    each role), through :func:`~slogym.baselines.common.split_colocated`: a cluster built with ``pd=``, a single
    instance, or an engine whose KV bytes per token are unknown stays as it is."""
    def split(n: int) -> tuple[int, int]:
        n_p = min(max(math.ceil(prefill_fraction * n), 1), n - 1)
        return n_p, n - n_p

    split_colocated(sim, split, "hyperflexis")


# ============================================================================ scaling (§6, Algorithm 3)
@dataclass(frozen=True)
class ScalingThresholds:
    """Algorithm 3's thresholds (the symbols were lost; values are ours): a stage scales out when any metric is
    above its upper threshold, and in when all stay below their lower thresholds for ``sustain`` intervals.

    utilization  mean over the stage's active workers of max(KV utilization, running / max_num_seqs) (busy time
                 is no measure: an LLM engine iterates whenever it holds a request)
    wait         longest wait of a queued request relative to its SLO (TTFT in the queue of a prefill-serving
                 worker, TPOT in a decode worker's queue)
    rate         requests entering the stage's queues over the interval / requests leaving them for a batch (the
                 input queue rate over the processing rate); 1 = balanced, so its lower threshold is "not growing"
    """

    util_up: float = 0.85
    util_down: float = 0.2
    wait_up: float = 0.5
    wait_down: float = 0.1
    rate_up: float = 1.3
    rate_down: float = 1.05
    sustain: int = 3


class HyperFlexisScaler(Scaler):
    """§6 threshold scaler (Algorithm 3), every ``interval`` seconds, acting only through the cluster API.

    Per stage (colocated; or prefill and decode), with the metrics of :class:`ScalingThresholds`: scale out by one
    worker when a metric is above its upper threshold (not while one of the stage is still starting), scale in
    by draining the least-loaded worker when all are below their lower ones for ``sustain`` intervals, within
    ``[min_per_stage, max_instances]``. In P/D, a stage that must grow while the other is calm takes a worker from
    it by ``switch_role`` (role reconfiguration instead of churn, §6). New workers start with the Table 2 cold
    start of ``cold_start``: ``"d2d"`` (Fast Scaling: weights from a running instance) by default, ``"disk"`` when no
    active worker exists to copy from, or ``"cpu_offload"`` / ``"disk"`` for the slower variants.

    :meth:`deltas` is the per-stage decision (+1 / 0 / -1) that Scaling-v0 can express; :meth:`decide` applies it.
    Deviation: the TLManager's P/D link setup is taken as free (links are pre-established, §6).
    """

    def __init__(self, interval: float = 1.0, max_instances: int = 8, min_per_stage: int = 1,
                 cold_start: str = "d2d", thresholds: ScalingThresholds = ScalingThresholds()) -> None:
        if not interval > 0 or max_instances < 1 or min_per_stage < 1:
            raise ValueError(f"interval={interval} must be > 0, max_instances={max_instances} and "
                             f"min_per_stage={min_per_stage} >= 1")
        if cold_start not in ("d2d", "cpu_offload", "disk"):
            raise ValueError(f"cold_start={cold_start!r}; expected 'd2d', 'cpu_offload' or 'disk'")
        self.interval, self.max_instances, self.min_per_stage = float(interval), max_instances, min_per_stage
        self.cold_start, self.thresholds = cold_start, thresholds

    def reset(self, sim: "Simulator") -> None:
        self.start(sim)

    def start(self, sim: "Simulator") -> None:
        """Fresh measurement state (also for use as an expert by an environment)."""
        roles = {inst.role for inst in sim.instances}
        self.stages = [Role.PREFILL, Role.DECODE] if Role.DECODE in roles else [Role.COLOCATED]
        self._calm = np.zeros(len(self.stages), np.int64)
        self._seen = {role: np.zeros(len(sim.w), bool) for role in self.stages}  # entered the stage's workers
        self._done = {role: 0 for role in self.stages}                         # left its queues (cumulative)

    def _members(self, sim: "Simulator", role: Role) -> list[Instance]:
        return [i for i in sim.instances if i.role == role and i.state != InstanceState.STOPPED]

    def metrics(self, sim: "Simulator", now: float) -> np.ndarray:
        """``(n_stages, 3)``: utilization, wait ratio, input / processing rate ratio since the last call."""
        rs, w = sim.rs, sim.w
        out = np.zeros((len(self.stages), 3))
        for k, role in enumerate(self.stages):
            members = self._members(sim, role)
            active = [i for i in members if i.state == InstanceState.ACTIVE]
            wait = np.asarray([r for i in members for r in i.waiting], dtype=np.int64)
            slo = w.min_tpot[wait] if role == Role.DECODE else w.first_ttft[wait]
            waited = now - (rs.ready[wait] if role != Role.DECODE else rs.last_token[wait])
            ratio = float(np.max(np.where(np.isfinite(slo), waited / np.maximum(slo, 1e-9), 0.0))) if wait.size else 0.0
            arrived, done = self._flow(sim, members, role)
            util = float(np.mean([max(i.kv_utilization, len(i.running) / i.engine.max_num_seqs) for i in active]))
            out[k] = (util if active else 1.0, ratio, arrived / max(done, 1.0) if arrived else 0.0)
        return out

    def _flow(self, sim: "Simulator", members: list[Instance], role: Role) -> tuple[float, float]:
        """Requests that entered the stage's queues, and requests that left them for a batch (the stage's
        processing), since the last call."""
        seen = self._seen[role]
        waiting = np.asarray([r for i in members for r in i.waiting], dtype=np.int64)
        ids = np.concatenate((waiting, np.asarray([r for i in members for r in i.running], dtype=np.int64)))
        new = ids[~seen[ids]]
        seen[new] = True
        processed = int(seen.sum()) - waiting.size
        done, self._done[role] = processed - self._done[role], processed
        return float(new.size), float(done)

    def deltas(self, sim: "Simulator", now: float) -> np.ndarray:
        """Per stage: +1 (scale out), -1 (scale in) or 0, from the thresholds (Algorithm 3)."""
        th = self.thresholds
        m = self.metrics(sim, now)
        up = (m[:, 0] > th.util_up) | (m[:, 1] > th.wait_up) | (m[:, 2] > th.rate_up)
        calm = (m[:, 0] < th.util_down) & (m[:, 1] < th.wait_down) & (m[:, 2] < th.rate_down)
        self._calm = np.where(calm, self._calm + 1, 0)
        down = (self._calm >= th.sustain) & ~up
        self._calm[down] = 0
        return np.where(up, 1, np.where(down, -1, 0)).astype(np.int64)

    def decide(self, sim: "Simulator", now: float) -> None:
        self.apply(sim, self.deltas(sim, now))

    def apply(self, sim: "Simulator", deltas: np.ndarray) -> None:
        """Carry out per-stage deltas: a +1 paired with a -1 of the other P/D stage is a role switch."""
        d = np.asarray(deltas, dtype=np.int64)
        if d.shape != (len(self.stages),) or np.abs(d).max(initial=0) > 1:
            raise ValueError(f"deltas {d.tolist()}: expected one of -1/0/+1 per stage {[s.name for s in self.stages]}")
        if len(self.stages) == 2 and sorted(d.tolist()) == [-1, 1]:
            self._switch(sim, self.stages[int(np.argmin(d))], self.stages[int(np.argmax(d))])
            return
        for role, x in zip(self.stages, d.tolist()):
            if x > 0:
                self._add(sim, role)
            elif x < 0:
                self._drain(sim, role)

    def _active(self, sim: "Simulator", role: Role) -> list[Instance]:
        return [i for i in sim.instances if i.role == role and i.state == InstanceState.ACTIVE]

    def _add(self, sim: "Simulator", role: Role) -> None:
        """+1 worker of ``role`` unless ``max_instances`` are alive or one is already on its way into the stage.
        A worker draining for a role switch (``switch_to``: it held requests, e.g. P/D hand-offs whose KV it keeps
        until the decode side takes them) is alive -- it is billed and comes back -- and one switching into
        ``role`` counts as starting there (else each tick of its drain added a new worker beyond the cap)."""
        alive = [i for i in sim.instances
                 if i.state in (InstanceState.STARTING, InstanceState.ACTIVE) or i.switch_to is not None]
        if len(alive) >= self.max_instances or any(
                (i.role == role and i.state == InstanceState.STARTING) or i.switch_to == role for i in alive):
            return
        source = any(i.state == InstanceState.ACTIVE for i in sim.instances)
        sim.add_instance(role=role, cold_start=self.cold_start if source else "disk")

    def _least_loaded(self, sim: "Simulator", role: Role) -> Instance | None:
        active = self._active(sim, role)
        if len(active) <= self.min_per_stage:
            return None
        return min(active, key=lambda i: (i.n_resident, -i.id))

    def _drain(self, sim: "Simulator", role: Role) -> None:
        victim = self._least_loaded(sim, role)
        if victim is not None:
            sim.drain_instance(victim.id)

    def _switch(self, sim: "Simulator", src: Role, dst: Role) -> None:
        victim = self._least_loaded(sim, src)
        if victim is not None:
            sim.switch_role(victim.id, dst)


# ============================================================================ policies
_STATE_DEFAULTS: dict[str, Any] = {"admit_threshold": 0.1, "cv": 0.5, "monitor_interval": 1.0, "spread": 0.5,
                                   "window": 256, "offset_quantile": 0.5, "reject": "reject"}
_SCALER_DEFAULTS: dict[str, Any] = {"scale_interval": 1.0, "max_instances": 8, "cold_start": "d2d"}


def _take(params: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    return {k: params.pop(k, v) for k, v in defaults.items()}


def _policy(name: str, slo_mapping: bool = False, pd: bool = False, scaling: bool = False) -> Callable[..., Policy]:
    def make(engine: Any = None, **params: Any) -> Policy:
        state_kw = _take(params, _STATE_DEFAULTS) | {"slo_mapping": slo_mapping}
        scale_kw = _take(params, _SCALER_DEFAULTS) if scaling else {}
        sched_kw = {"max_num_seqs": params.pop("max_num_seqs", int(engine.max_num_seqs) if engine else 256),
                    "prefill_fraction": params.pop("prefill_fraction", 0.5)}
        if params:
            raise TypeError(f"{name}: unknown parameters {sorted(params)}; known: "
                            f"{sorted([*_STATE_DEFAULTS, *sched_kw, *scale_kw])}")
        state = DispatcherState(**state_kw)
        sched = HyperFlexisScheduler(state, pd=pd, **sched_kw)
        scaler = None
        if scaling:
            scaler = HyperFlexisScaler(scale_kw["scale_interval"], scale_kw["max_instances"],
                                       cold_start=scale_kw["cold_start"])
        return Policy(name=name, scheduler=sched, router=HyperFlexisDispatcher(state), scaler=scaler,
                      params={"scheduler": "HyperFlexisScheduler", "router": "HyperFlexisDispatcher", "pd": pd,
                              "scaler": "HyperFlexisScaler" if scaling else None} | state_kw | sched_kw | scale_kw)

    make.__doc__ = f"Build the {name!r} policy: ``f(engine, **params)`` (admit_threshold, cv, ...)."
    return make


def _rr_pd(engine: Any = None, **params: Any) -> Policy:
    """RR-PD (§8.1.2): "request dispatching in both the Prefill and Decode stages follows a round-robin policy"
    (:class:`RoundRobinPDRouter`), with no SLO awareness; P/D split as ``hyperflexis-pd``.

    The paper names only the dispatching; each worker runs FCFS, the P/D FCFS worker that slogym shares with
    DistServe (:class:`~slogym.baselines.distserve.DistServeScheduler`): vLLM's FCFS scheduler on prefill workers,
    and on decode workers requests whose KV arrived join the running decode batch in FCFS order within
    ``max_num_seqs`` and free KV. (Until 2026-11-22 RR-PD ran plain vLLM on decode workers, whose prefill-first
    iteration admits migrated requests in separate one-token "prefill" batches that stall the running decodes --
    the path docs/baselines/distserve.md calls wrong for a decode instance; it cut RR-PD's attainment on
    hyperflexis-2task pd 2:2 at load 1.0 from 1.000 to 0.789.)"""
    from slogym.baselines.distserve import DistServeScheduler

    fraction = params.pop("prefill_fraction", 0.5)
    defaults = {} if engine is None else {"max_num_seqs": int(engine.max_num_seqs),
                                          "max_num_batched_tokens": int(engine.max_num_batched_tokens)}
    sched = _PDSplit(DistServeScheduler(**(defaults | params)), fraction)
    return Policy(name="rr-pd", scheduler=sched, router=RoundRobinPDRouter(),
                  params={"scheduler": "DistServeScheduler", "router": "RoundRobinPDRouter",
                          "prefill_fraction": fraction} | defaults | params)


class _PDSplit(Scheduler):
    """A scheduler that first makes the cluster P/D (:func:`split_pd`), then delegates every batch."""

    def __init__(self, inner: Scheduler, prefill_fraction: float) -> None:
        self.inner, self.prefill_fraction = inner, prefill_fraction
        self.steady_through_finish = inner.steady_through_finish

    def reset(self, sim: "Simulator") -> None:
        split_pd(sim, self.prefill_fraction)
        self.inner.reset(sim)

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        return self.inner.next_batch(inst, now)


POLICIES: dict[str, Callable[..., Policy]] = {
    "hyperflexis": _policy("hyperflexis"),
    "hyperflexis-pm": _policy("hyperflexis-pm", slo_mapping=True),
    "hyperflexis-scaling": _policy("hyperflexis-scaling", scaling=True),
    "hyperflexis-pd": _policy("hyperflexis-pd", pd=True),
    "hyperflexis-pd-scaling": _policy("hyperflexis-pd-scaling", pd=True, scaling=True),
    "rr-pd": _rr_pd,
}

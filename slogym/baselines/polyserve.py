"""PolyServe: efficient multi-SLO serving at scale (Zhu et al. 2025), co-located (CO) and disaggregated (PD)
variants and their baselines.

The extracted paper lost most formula symbols; what this module assumes is stated where it is used.

**Request binning (§4.2).** Requests are binned by their TPOT SLO into *tiers* (the workload's distinct finite TPOT
values, tightest first; §5.1 uses 20/30/50/100 ms). A request whose TPOT lies between two tiers goes to the tighter
one; best-effort requests (no SLO) form the loosest bin. Every instance carries a *label*: one tier, the
best-effort pool (``POOL``, idle servers), or the pending list (``PENDING``, §4.4). The labels are policy state
(mirrored into ``sim.set_pool`` when the cluster API provides it).

**Routing: highest-load but still SLO-attainable (§4.1, §4.3, §4.5-4.7).** For an arriving request of tier ``t`` the
router evaluates every candidate instance at once (NumPy arrays over instances, :class:`Fleet`) and places the
request on the *highest-load* one that passes the admission test, building the load gradient that lets the last
server of a tier empty out. Load = the profile-table time of the instance's current decode batch. Candidates, in
order, until one admits:

1. instances of tier ``t``;
2. *lazy promotion* (§4.4): instances of tighter tiers ``t-1, ..., 0`` (nearest first), only because tier ``t``
   is full -- a request never goes to an instance of a looser tier;
3. *scale-up* (§4.3): an instance of the pending list whose residents are all of tier ``>= t`` (the paper lets it
   "join the cluster serving the corresponding SLO as per the request inside"), or an idle instance of the
   best-effort pool; it is relabelled ``t``;
4. otherwise the request pends (``DEFER``: the cluster's global queue, retried when a request finishes). Once its
   TTFT can no longer be met even by an idle server (the prompt alone in one iteration, or an idle host refusing
   it in the admission) it is demoted to best effort (served last, judged by its SLO as before) rather than left
   pending forever (the paper does not say; Deviation). Best-effort work belongs to the
   best-effort pool (§4.3): it goes to a pool instance, else to the pending list, else to the loosest tier, and
   within that group to the highest-load instance, so the tier's last instance can still empty and return to
   the pool (:meth:`PolyServeRouter.best_effort_instance`); a demoted request's decode hand-off is routed as
   best effort too.

**Admission test (§4.5 profile-based batch formation, §4.6 wait time, §4.7 continuous chunked-prefill
prediction).** Iteration time is predicted from a *profile table* (batch size x KV-cache size -> time; built by
:func:`profile_table` from the engine preset, ``table`` perf family). The output length of every request is
predicted from the *average decode length* (:func:`remaining_curve`; by default the average of the requests that
generated as many tokens, see Deviations). The router simulates the future iterations of the instance with the
new request: every resident grows by one token per iteration until its predicted end; the largest KV size
reached (``kv_peak``, computed exactly and vectorized by :func:`future_kv_peak`) and the token batch size give
the predicted iteration time, which must stay within the host's TPOT (the host's TPOT is its tier's; lazy promotion
makes a looser request obey the tighter host). Deadline-based SLOs (DSLO, §2.3: the ``k``-th token is due at
``arrival + TTFT + k * TPOT``) absorb single iterations that exceed the TPOT. For TTFT (co-location, §4.7): the
chunk size the host can keep *for the whole prefill* is the token budget at ``kv_peak`` minus the decode batch,
shrunk so that the chunk's prefill attention over the past its last chunk attends fits too
(:func:`polyserve_kernels.co_chunk`, the rule batch formation applies); the first token is predicted at ``wait +
ceil((queued prefill tokens + prompt) / chunk)`` iterations (each timed with the chunk's attention over the
prompt's mean past), where ``wait`` is the rest of the host's current iteration (§4.6) and the queued prefill
tokens are those of requests with an SLO (the scheduler runs best-effort prompts after them), and must be before
the TTFT deadline. Otherwise the router looks at other, lower-load machines (as the paper says).

**Disaggregated (PD) prefill (§4.2, §4.6, §4.7).** Prefill instances are shared by all tiers and run their queue
in TTFT-deadline order with dynamic chunking (a remainder below twice the 1024-token budget finished at once). An
arrival goes to the highest-load (most queued prompt tokens) prefill instance that still achieves the TTFT (§4.7):
the router replays the instance's deadline-ordered queue with the new prompt in it
(:func:`polyserve_kernels.prefill_admits`), timing each iteration with a prefill profile that keeps prefill
attention over the past KV (:func:`prefill_profile_table`; the paper neglects it below 10K tokens), from the end
of the iteration in flight (§4.6 wait time). The new prompt must end by its *prefill deadline* -- the TTFT
deadline less the part of the KV transfer the second token's TPOT cannot absorb, so the second token (due TTFT +
TPOT, §4.6) stays reachable (:meth:`Fleet.prefill_deadline`) -- and no prompt predicted on time without it may
turn late with it (it overtakes those due later). The decode side is the tiered
router above with decode admission (next token after transfer, wait and one step before its DSLO deadline). A
hand-off that no decode instance admits pends (§4.2-4.3; its KV stays on the prefill instance, and the simulator
offers it again at every finish) while its next token can still be on time; meanwhile no looser hand-off is
promoted onto its tier (§4.2's per-tier queues, §4.4: promotion only because the own tier is full). Once its next
token is lost it is demoted (``route_decode`` returns ``BEST_EFFORT``; the simulator marks it best effort), so its
former tier no longer counts in any tier rule, and routed as best effort. Deviation: on a decode side of fewer
instances than tiers (no cluster per tier) a hand-off never pends; it goes to its tier's least-loaded instance
(:meth:`PolyServeRouter.route_decode`). The PD variants keep the roles of a cluster built with
``Simulator(pd=(P, D))``; a co-located cluster of ``n >= 2`` instances they split themselves at reset, as DistServe
does, into :func:`pd_split`'s P:D (the paper gives no split; the reproduction's rule: by the prefill share of the
work, one decode instance per tier where ``n >= 2 x tiers``), so a PD variant always disaggregates (:class:`PolyCore`).

**Batch formation on an instance (§2.4, §4.5).** Decode-first chunked prefill (Sarathi's loop, reused from
:mod:`slogym.baselines.common`): every running decode runs; the rest of a *token budget* is filled with prefill
chunks in TTFT-deadline order (demoted / best-effort requests last). PolyServe's budget is profile-based: the
largest token batch whose predicted time at the current KV size stays within the instance's operating TPOT (its
label's TPOT, or the tightest resident's if tighter), the head prompt's chunk paying for its attention over its past
(:meth:`Fleet.chunk_budget`; PolyServe only). CO-Chunk instead uses a static budget.

**Auto-scaling on a fixed fleet (§4.3-4.4).** Deviation: the paper moves servers between tiers and a best-effort
pool that runs the same model ("scaling happens instantly"). slogym realises this on a fixed set of instances by
re-labelling idle instances -- no cold start is needed or modelled, and no best-effort work is aborted (an instance
joins a tier only when it is empty or holds only looser/best-effort requests). :class:`PolyServeScaler` checks the
*last* instance of every tier each ``interval``: empty -> back to the pool; holding no request of its own tier
(only promoted ones) -> the pending list; a pending instance that empties -> the pool. Cost (§3.3, §5.4) is
the instance-seconds spent outside the pool (:meth:`Fleet.instance_seconds`). In ``slogym/Scaling-v0`` (one pool
of started / drained instances per tier, the env's router) the same rule is :meth:`PolyServeScaler.deltas`: +1
for a tier whose requests pend, -1 for a tier with an empty instance; the fleet's rows then grow with the added
instances (:meth:`Fleet.grow`).

**Baselines (§5.1).** CO-Random: uniformly random instance. CO-Minimal: the instance with the lowest predicted
cycle (iteration) time. Both admit everything and form batches with the same profile budget at the tightest
resident TPOT, from the paper's (batch size, KV size) table alone (PolyServe's chunks also pay for their prefill
attention; giving the baselines that too lowered their attainment, so they keep the paper's budget). CO-Chunk:
CO-Minimal routing with a static token budget (the paper sweeps it and keeps the best;
``scripts/reproduce/polyserve.py`` does the sweep).

Deviations: co-located iteration times count the prefill chunk's attention over its past, which §4.5's table omits
below 10K tokens (§3.5 lists it; slogym's traces pass 10K): a (chunk x past) prefill profile
(:func:`prefill_profile_table`) adds it to the table's time, read alike by batch formation and admission; the
remaining output of a request that generated ``g`` tokens is by default the mean remaining output of the requests
that got that far (``remaining="residual"``; the paper's ``avg - g``, which predicts every request past the average
to end at its next step, is ``remaining="average"``); the future-growth simulation starts every resident from its
full known length (prompt tokens not yet prefilled counted as resident KV) -- conservative; the per-instance state
the router reads is refreshed at every batch formation and on every placement, so it is at most one iteration old;
the pending retry order is the simulator's (FCFS over the global queue). Reconstructed for PD prefill admission (the
paper states the deadline order, "the highest-load server that can still achieve TTFT" and "the additional cycle" of
prompts already scheduled, not how a prompt that jumps the queue is treated): the veto that no prompt predicted on
time may turn late with the newcomer; the *prefill deadline* (§4.6 speaks of the second token for decode admission,
not of a prefill deadline); and the replay assumes KV never limits a prefill batch (KV stays held until the transfer
out ends, so under KV pressure the prediction is optimistic; the scheduler itself stops when KV is full). The PD
baselines share :class:`Fleet`, so their cycle-time rows also count hand-offs still in transfer.

Simulation speed (no effect on decisions): the per-iteration and per-arrival loops are compiled
(:mod:`slogym.baselines.polyserve_kernels`, value for value the NumPy rules above). Batches of decodes alone are
``steady`` (fast-forwarded by the simulator) only once no request can be routed again (:meth:`Fleet.settled`:
the drain at the end of a run), because the router reads the rows a batch formation refreshes; before that
every iteration is formed by the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from slogym.baselines import polyserve_kernels as pk
from slogym.baselines.common import (batch_of, decode_batch, fill_prefill_chunks, make_room_for_decodes,
                                     split_running, unstick)
from slogym.baselines.common import split_colocated
from slogym.baselines.polyserve_kernels import dynamic_chunk
from slogym.core.batch import Batch, BatchFeatures
from slogym.core.instance import Instance, InstanceState, Role
from slogym.core.policy import BEST_EFFORT, DEFER, Policy, Router, Scaler, Scheduler
from slogym.core.state import Status
from slogym.engines.perf_models import TablePerf

if TYPE_CHECKING:
    from slogym.core.request import Workload
    from slogym.core.simulator import Simulator

INF = float("inf")
TRANSFER = int(Status.TRANSFER)
MAX_TIERS = 8
BUDGET_POINTS = 257


# ============================================================================ profile table (§4.5)
@dataclass(frozen=True)
class ProfileTable:
    """PolyServe's profile map (token batch size x KV-cache tokens -> iteration time), with its inverse.

    ``perf`` is the ``table`` perf family (bilinear interpolation) used for forward predictions; ``tokens``,
    ``kv`` and ``times`` are its grid, kept for :meth:`token_budget` (the inverse along the token axis).
    """

    perf: TablePerf
    tokens: np.ndarray
    kv: np.ndarray
    times: np.ndarray
    curves: dict[float, Any] = field(default_factory=dict, compare=False, repr=False)

    def time(self, tokens: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """Predicted iteration time of batches of ``tokens`` tokens reading ``kv`` KV tokens (vectorized).

        The ``table`` family's bilinear interpolation (flat below the grid, the edge cell's slope above it),
        written out on the grid arrays: the router calls it on every arrival, and this avoids the generic
        feature plumbing (agrees with ``perf.batch_time`` to rounding; ``tests/test_polyserve.py`` checks it)."""
        t = np.asarray(tokens, np.float64)
        k = np.asarray(kv, np.float64)
        tg, kg, tt = self.tokens, self.kv, self.times
        i = np.minimum(np.maximum(np.searchsorted(tg, t, side="right") - 1, 0), tg.size - 2)
        j = np.minimum(np.maximum(np.searchsorted(kg, k, side="right") - 1, 0), kg.size - 2)
        wi = np.maximum((t - tg[i]) / (tg[i + 1] - tg[i]), 0.0)
        wj = np.maximum((k - kg[j]) / (kg[j + 1] - kg[j]), 0.0)
        lo = tt[i, j] + (tt[i, j + 1] - tt[i, j]) * wj
        hi = tt[i + 1, j] + (tt[i + 1, j + 1] - tt[i + 1, j]) * wj
        return np.where(t > 0, lo + (hi - lo) * wi, 0.0)

    def time_one(self, tokens: int, kv: int) -> float:
        """:meth:`time` of one batch (compiled: the scheduler calls it every iteration)."""
        return pk.table_time(self.tokens, self.kv, self.times, float(tokens), float(kv))

    def _budget_exact(self, kv: np.ndarray, tpot: float) -> np.ndarray:
        """Inverse of the bilinear table along the token axis at KV sizes ``kv`` (0 when not even one token fits;
        the grid's largest value when everything fits)."""
        kg, tg = self.kv, self.tokens
        j = np.clip(np.searchsorted(kg, kv, side="right") - 1, 0, kg.size - 2)
        w = np.maximum((kv - kg[j]) / (kg[j + 1] - kg[j]), 0.0)
        col = self.times[:, j] + (self.times[:, j + 1] - self.times[:, j]) * w  # (n_tokens_grid, n)
        k = (col <= tpot).sum(axis=0)                                          # times rise with tokens
        lo = np.clip(k - 1, 0, tg.size - 2)
        c0 = col[lo, np.arange(kv.size)]
        c1 = col[lo + 1, np.arange(kv.size)]
        frac = np.clip((tpot - c0) / np.maximum(c1 - c0, 1e-12), 0.0, 1.0)
        inner = tg[lo] + frac * (tg[lo + 1] - tg[lo])
        return np.where(k == 0, 0.0, np.where(k >= tg.size, tg[-1], inner))

    def budget_curve(self, tpot: float) -> tuple[np.ndarray, np.ndarray]:
        """The exact inverse at ``tpot`` tabulated on a fine KV grid (``BUDGET_POINTS``; computed once per TPOT)."""
        curve = self.curves.get(tpot)
        if curve is None:
            grid = np.linspace(self.kv[0], self.kv[-1], BUDGET_POINTS)
            curve = self.curves[tpot] = (grid, self._budget_exact(grid, tpot))
        return curve

    def token_budget(self, kv: np.ndarray, tpot: float) -> np.ndarray:
        """Largest token batch whose predicted time at KV size ``kv`` stays within ``tpot`` (vectorized over
        ``kv``): :meth:`budget_curve` interpolated, which keeps the per-iteration call cheap."""
        grid, budget = self.budget_curve(tpot)
        return np.floor(np.interp(np.asarray(kv, np.float64), grid, budget)).astype(np.int64)

    def token_budget_one(self, kv: int, tpot: float) -> int:
        """:meth:`token_budget` of one instance (compiled)."""
        grid, budget = self.budget_curve(tpot)
        return pk.token_budget(grid, budget, float(kv))


def _token_grid(engine: Any) -> np.ndarray:
    """Token batch sizes a profiling run samples: 1..2x ``max_num_batched_tokens``, powers of two and midpoints."""
    top = 2 * int(engine.max_num_batched_tokens)
    pts = {1}
    p = 2
    while p <= top:
        pts.update((p, p + p // 2))
        p *= 2
    return np.array(sorted(x for x in pts if x <= top), np.int64)


def _profiled(tokens: np.ndarray, kv: np.ndarray, times: np.ndarray) -> ProfileTable:
    """A :class:`ProfileTable` of profiled ``times`` on the ``tokens`` x ``kv`` grid (§4.5)."""
    times = np.maximum.accumulate(times, axis=0)  # monotone in tokens, as the inverse needs
    return ProfileTable(TablePerf(tokens.astype(float), kv.astype(float), times), tokens.astype(np.float64),
                        kv.astype(np.float64), times)


def profile_table(engine: Any, kv_points: int = 33) -> ProfileTable:
    """Profile ``engine`` (anything with ``batch_time``, ``kv_capacity_tokens``, ``max_num_seqs``,
    ``max_num_batched_tokens``) into a PolyServe table.

    The "profiling run" evaluates the engine's own perf model on a grid: token batch sizes 1..2x
    ``max_num_batched_tokens`` (powers of two and midpoints) x KV sizes 0..capacity (``kv_points`` even steps).
    A token batch of ``T`` tokens is profiled as ``min(T, max_num_seqs)`` decodes reading all ``kv`` KV tokens
    plus the rest as one prefill chunk without past (PolyServe neglects prefill attention, §4.5).
    """
    tokens = _token_grid(engine)
    kv = np.unique(np.linspace(0, int(engine.kv_capacity_tokens), kv_points).astype(np.int64))
    T, K = np.meshgrid(tokens, kv, indexing="ij")
    dec = np.minimum(T, int(engine.max_num_seqs))
    pre = T - dec
    f = BatchFeatures.build(prefill_tokens=pre.ravel(), prefill_seqs=(pre > 0).ravel().astype(np.int64),
                            prefill_attn=(pre * pre).ravel(), prefill_sq=(pre * pre).ravel(),
                            decode_seqs=dec.ravel(), decode_tokens=dec.ravel(), decode_ctx=K.ravel(),
                            kv_tokens=(K + pre).ravel())
    return _profiled(tokens, kv, np.asarray(engine.batch_time(f), np.float64).reshape(T.shape))


def prefill_profile_table(engine: Any) -> ProfileTable:
    """Profile ``engine``'s prefill-only iterations (a disaggregated prefill instance) into a table of
    (chunk tokens x past KV the chunk attends -> iteration time), read by PD-PolyServe's TTFT prediction.

    §4.5 names prefill attention, "which depends on the prefill length", as a part of the iteration time and
    neglects it only because "for common workloads with sequence lengths less than 10K" it is small beside the
    rest. A prefill instance has no decode attention for the (batch size, KV size) map to carry, and the traces
    slogym replays exceed 10K tokens (Azure conv prompts reach 14K; on llama3-8b-h200 a 1024-token chunk after
    13K of past takes 1.7x one without), so the prefill instance's table keeps the term: a token batch of ``T``
    tokens is profiled as one chunk after ``p`` past tokens (``prefill_attn = T (p + T)``), ``p`` on powers of
    two up to the KV capacity. Deviation: the paper's map has no past-KV axis for prefill (its simplification);
    a batch of several chunks is read at their token-weighted mean past, which over-counts the pairs inside the
    chunks (conservative)."""
    tokens = _token_grid(engine)
    cap = int(engine.kv_capacity_tokens)
    past = np.unique(np.array([0, *(1 << np.arange(8, max(cap.bit_length(), 9))).tolist(), cap], np.int64))
    past = past[past <= cap]
    T, P = np.meshgrid(tokens, past, indexing="ij")
    zero = np.zeros(T.size, np.int64)
    f = BatchFeatures.build(prefill_tokens=T.ravel(), prefill_seqs=np.ones(T.size, np.int64),
                            prefill_attn=(T * (P + T)).ravel(), prefill_sq=(T * T).ravel(), decode_seqs=zero,
                            decode_tokens=zero, decode_ctx=zero, kv_tokens=(P + T).ravel())
    return _profiled(tokens, past, np.asarray(engine.batch_time(f), np.float64).reshape(T.shape))


@lru_cache(maxsize=16)
def _cached_table(engine: Any, prefill: bool) -> ProfileTable:
    return prefill_profile_table(engine) if prefill else profile_table(engine)


def table_for(engine: Any, prefill: bool = False) -> ProfileTable:
    """The profile table of ``engine`` (its prefill-instance table with ``prefill``), cached per engine object."""
    try:
        return _cached_table(engine, prefill)
    except TypeError:  # unhashable engine object
        return prefill_profile_table(engine) if prefill else profile_table(engine)


# ============================================================================ future KV growth (§4.5)
def future_kv_peak(rem: np.ndarray, csum: np.ndarray, n: np.ndarray, c0: int, r0: int) -> np.ndarray:
    """Largest KV size each instance reaches when a request of context ``c0`` and predicted remaining length
    ``r0`` joins it, simulating the future iterations (§4.5: "simulates future iterations and computes the
    maximum KV cache size as requests grow in length, and exits when finished").

    Row ``i`` describes instance ``i``'s ``n[i]`` residents sorted by predicted remaining tokens, descending:
    ``rem[i, :n[i]]`` and the prefix sums of their contexts ``csum[i, :n[i]]``. After ``k`` more iterations a
    resident with remaining ``r`` and context ``c`` holds ``c + k`` tokens while ``r > k``. The KV size rises
    between finishes and drops at them, so its maximum is reached at ``k = r - 1`` for some resident (or the new
    request): at ``k = rem[m] - 1`` the first ``m + 1`` residents are alive (prefix sum + ``(m+1) * k``; a tie
    group evaluated at its last member), plus the new request when ``r0 >= rem[m]``. Exact for the model; with
    the prefix / suffix maxima of :func:`polyserve_kernels.row_maxima` (kept in each fleet row) it takes
    O(log n) per instance (:func:`polyserve_kernels.future_kv_peak_one`).
    """
    rem, csum = np.ascontiguousarray(rem, np.int64), np.ascontiguousarray(csum, np.int64)
    pb, sa = np.empty_like(rem), np.empty_like(rem)
    out = np.empty(rem.shape[0], np.int64)
    for i, k in enumerate(np.asarray(n).tolist()):
        pk.row_maxima(rem, csum, pb, sa, i, k)
        out[i] = pk.future_kv_peak_one(rem, csum, pb, sa, i, k, c0, r0)
    return out


# ============================================================================ per-instance state
class Fleet:
    """Per-instance arrays the router decides on (vectorized over instances), refreshed by the scheduler at each
    batch formation and by the router at each placement.

    label      tier index, ``POOL`` (= n_tiers + 1: best-effort pool, idle), ``PENDING`` (= n_tiers + 2), or
               ``PREFILL`` (= n_tiers + 3: a prefill instance of a disaggregated cluster, shared by all tiers)
    n_res      resident requests (running + waiting);  kv_now  their known length sum (KV at the next step)
    q_pre      prompt tokens still to prefill after the iteration in flight
    q_slo      those of residents with an SLO: the queue a new prompt waits for in the CO TTFT prediction (§4.7;
               ``PolyScheduler._deadline_order`` runs demoted / best-effort prompts after every SLO prompt)
    busy_until predicted end of the iteration in flight (profile table; §4.6 wait time)
    res_tight  the tightest tier among the residents (``n_tiers``: best effort; ``n_tiers + 1``: none)
    rem, csum  residents sorted by predicted remaining tokens (desc) and prefix sums of their lengths
    pb, sa     their future-KV maxima (:func:`polyserve_kernels.row_maxima`)
    ptable     the prefill profile (:func:`prefill_profile_table`): PD prefill instances' iteration time, and the
               co-located chunk's attention over its past (:meth:`chunk_budget`, :meth:`chunk_attention`)
    step_max   the profiled time of the largest decode batch at full KV memory (:meth:`prefill_deadline`)
    curves     token-budget curves (:meth:`ProfileTable.budget_curve`) of the tiers' TPOTs, then of no TPOT (row
               ``n_tiers``): a label's host TPOT reads row ``min(label, n_tiers)``
    """

    def __init__(self, sim: "Simulator", table: ProfileTable, tiers: np.ndarray, resid: np.ndarray,
                 max_num_seqs: int = 1 << 30) -> None:
        n = len(sim.instances)
        w = sim.w
        self.sim, self.table, self.tiers = sim, table, tiers
        self.resid = np.ascontiguousarray(resid, np.int64)  # predicted remaining output by tokens generated
        self.n_tiers = tiers.size
        self.POOL, self.PENDING, self.PREFILL = self.n_tiers + 1, self.n_tiers + 2, self.n_tiers + 3
        # TPOT each label imposes: tiers, best effort (none), pool (none), pending (its residents decide), prefill
        self.label_tpot = np.concatenate((tiers, [INF, INF, INF, INF]))
        self.curve_tpots = [*tiers.tolist(), INF]
        self.grid = table.budget_curve(INF)[0]
        self.curves = np.array([table.budget_curve(x)[1] for x in self.curve_tpots])
        self.row_tpot = np.array(self.curve_tpots)
        self.rtier = request_tiers(w.min_tpot, w.best_effort, tiers)
        self.rtpot = np.minimum(w.min_tpot, INF)
        # per tier t: the rank of each label among t's hosts (own tier, then tighter ones nearest first; the pool
        # first for best effort), NO_HOST for labels that may not host tier t (§4.4: never a looser tier)
        self.host_rank = np.full((self.n_tiers + 1, self.n_tiers + 4), pk.NO_HOST, np.int64)
        for t in range(self.n_tiers + 1):
            hosts = [*range(min(t, self.n_tiers - 1), -1, -1)] if t < self.n_tiers else \
                [self.POOL, *range(self.n_tiers - 1, -1, -1)]
            self.host_rank[t, hosts] = np.arange(len(hosts))
        self.idle_label = np.zeros(self.n_tiers + 4, bool)  # labels an instance may scale up from (§4.3)
        self.idle_label[[self.POOL, self.PENDING]] = True
        role = np.array([int(i.role) for i in sim.instances])
        self.prefill = np.flatnonzero(role == Role.PREFILL)     # roles are fixed for the run (a fixed fleet)
        self.decode = np.flatnonzero(role == Role.DECODE)
        self.label = np.where(role == Role.PREFILL, self.PREFILL, self.POOL).astype(np.int64)
        # the prefill profile (chunk tokens x past KV; :func:`prefill_profile_table`) of the entry instances
        self.ptable = table_for(sim.instances[int(self.prefill[0]) if self.prefill.size else 0].engine,
                                prefill=True)
        self.max_num_seqs = max_num_seqs
        self.max_seqs = np.array([self._seqs(i) for i in sim.instances])
        self.cap = np.array([i.total_blocks * i.block_size for i in sim.instances], np.int64)
        # the longest decode step the profile allows on a decode instance (largest batch at full KV memory)
        self.step_max = max((table.time_one(min(int(self.max_seqs[j]), int(self.cap[j])), int(self.cap[j]))
                             for j in self.decode.tolist()), default=INF)
        self.n_res = np.zeros(n, np.int64)
        self.kv_now = np.zeros(n, np.int64)
        self.q_pre = np.zeros(n, np.int64)
        self.q_slo = np.zeros(n, np.int64)
        self.busy_until = np.zeros(n)
        self.checked = np.zeros(n, bool)
        self.res_tight = np.full(n, self.n_tiers + 1, np.int64)
        self.engines = list({id(i.engine): i.engine for i in sim.instances}.values())
        self.engine_of = np.array([[id(e) for e in self.engines].index(id(i.engine)) for i in sim.instances])
        self.no_xfer = np.zeros(len(self.engines))
        self.width = 64
        self.rem = np.zeros((n, self.width), np.int64)
        self.csum = np.zeros((n, self.width), np.int64)
        self.pb = np.zeros((n, self.width), np.int64)
        self.sa = np.zeros((n, self.width), np.int64)
        # the router's per-instance memo of co-located admission (polyserve_kernels._co_admits_memo): inputs, result
        self.admit_key = np.full((n, 7), -1, np.int64)
        self.admit_val = np.full((n, 3), np.nan)
        self.joined: list[list[int]] = [[] for _ in range(self.n_tiers + 1)]
        self.incoming: list[list[int]] = [[] for _ in range(n)]  # KV transfers under way, per decode instance
        self.use_since = np.full(n, np.nan)
        self.used_seconds = np.zeros(n)
        self.routed = np.zeros(len(w), bool)
        self.n_routed = 0
        self._settled = False

    # ---------------------------------------------------------------- refresh
    def grow(self) -> None:
        """Rows for instances added to the cluster since the fleet was built (``sim.add_instance``: Scaling-v0
        starts and stops instances under PolyServe's scheduler). A new instance starts in the pool, empty, as a
        co-located one; PolyServe itself never adds instances (its fleet is fixed, the module docstring)."""
        insts = self.sim.instances
        n, old = len(insts), self.label.size
        if n <= old:
            return
        new = insts[old:]
        if any(i.role != Role.COLOCATED for i in new):
            raise ValueError(f"instances {[i.id for i in new]} added with roles {[i.role.name for i in new]}: "
                             f"PolyServe's fleet grows only by co-located instances")
        k = n - old

        def pad(a: np.ndarray, fill: Any) -> np.ndarray:
            return np.concatenate((a, np.full((k, *a.shape[1:]), fill, a.dtype)))

        for e in (i.engine for i in new):
            if all(e is not x for x in self.engines):
                self.engines.append(e)
                self.no_xfer = np.zeros(len(self.engines))
        self.label = pad(self.label, self.POOL)
        self.max_seqs = np.concatenate((self.max_seqs, [self._seqs(i) for i in new])).astype(self.max_seqs.dtype)
        self.cap = np.concatenate((self.cap, [i.total_blocks * i.block_size for i in new])).astype(np.int64)
        self.engine_of = np.concatenate((self.engine_of, [[id(e) for e in self.engines].index(id(i.engine))
                                                          for i in new])).astype(self.engine_of.dtype)
        for name in ("n_res", "kv_now", "q_pre", "q_slo", "busy_until", "used_seconds", "rem", "csum", "pb", "sa"):
            setattr(self, name, pad(getattr(self, name), 0))
        self.checked = pad(self.checked, False)
        self.admit_key, self.admit_val = pad(self.admit_key, -1), pad(self.admit_val, np.nan)
        self.res_tight = pad(self.res_tight, self.n_tiers + 1)
        self.use_since = pad(self.use_since, np.nan)
        self.incoming += [[] for _ in new]

    def _seqs(self, inst: Instance) -> int:
        """The batch limit the scheduler applies on ``inst``: the policy's max_num_seqs within the engine's."""
        return min(int(getattr(inst.engine, "max_num_seqs", 1 << 30)), self.max_num_seqs)

    def read(self, inst: Instance) -> float:
        """Refresh instance ``inst``'s row from its residents (one compiled pass,
        :func:`polyserve_kernels.observe_row`: each resident's predicted remaining output is the average decode
        length minus its tokens generated so far, at least 1, §4.5; ``q_pre`` still counts the chunks of the batch
        being formed). Returns the tightest TPOT among its residents with an SLO (``inf`` if none)."""
        if inst.id >= self.label.size:
            self.grow()
        rs = self.sim.rs
        res = inst.running_array()  # cached: batch formation has just split it
        if inst.waiting:
            res = np.concatenate((res, np.array(inst.waiting, np.int64)))
        if self.incoming[inst.id] and self.in_transfer(inst.id):
            res = np.concatenate((res, np.array(self.incoming[inst.id], np.int64)))
        self._fit(res.size)
        return pk.observe_row(rs.I, res, self.rtier, self.rtpot, rs.be, self.resid, self.rem, self.csum,
                              self.pb, self.sa, self.n_res, self.kv_now, self.q_pre, self.q_slo, self.res_tight,
                              inst.id, self.n_tiers + 1)

    def in_transfer(self, j: int) -> int:
        """Requests whose KV is on its way to decode instance ``j`` (routed there, not yet arrived): residents
        of ``j`` for its admission (§4.5 counts every request the instance will serve), which its own lists show
        only once the transfer ends. Prunes the arrived ones; returns how many remain."""
        status = self.sim.rs.status
        inc = self.incoming[j]
        inc[:] = [r for r in inc if status[r] == TRANSFER]
        return len(inc)

    def formed(self, j: int, now: float, busy: float, reqs: list[int], toks: list[int]) -> None:
        """Instance ``j`` started an iteration predicted to take ``busy`` seconds, prefilling chunks ``toks`` of
        requests ``reqs``."""
        self.busy_until[j] = now + busy
        self.checked[j] = False
        if toks:  # integer sums: the same as taking the chunks off one by one
            be = self.sim.rs.be
            self.q_pre[j] -= sum(toks)
            self.q_slo[j] -= sum(c for r, c in zip(reqs, toks) if not be[r])

    def observe(self, inst: Instance, now: float, busy: float | None = 0.0, reqs: list[int] | None = None,
                toks: list[int] | None = None) -> None:
        """Refresh instance ``inst``'s row from its residents (at batch formation with the predicted iteration
        time ``busy`` of the chunks ``toks`` of ``reqs``; with ``busy=None`` when re-read between formations,
        keeping the predicted end)."""
        self.read(inst)
        if busy is not None:
            self.formed(inst.id, now, busy, reqs or [], toks or [])

    def place(self, j: int, r: int, ctx: int, prompt: int) -> None:
        """Request ``r`` (``ctx`` tokens long, ``prompt`` of them still to prefill) joins instance ``j``: insert it
        into the row at once so the next arrival inside the same iteration sees it."""
        n = int(self.n_res[j])
        self._fit(n + 1)
        pk.place_row(self.rem, self.csum, self.pb, self.sa, j, n, self.remaining(r), ctx)
        self.n_res[j] = n + 1
        self.kv_now[j] += ctx
        self.q_pre[j] += prompt
        if not self.sim.rs.be[r]:
            self.q_slo[j] += prompt
        self.res_tight[j] = min(int(self.res_tight[j]), self.tier_of(r))

    def tier_of(self, r: int) -> int:
        """Request ``r``'s tier now: its TPOT's (§4.2), or best effort (``n_tiers``) once demoted."""
        return self.n_tiers if self.sim.rs.be[r] else int(self.rtier[r])

    def remaining(self, r: int) -> int:
        """Predicted remaining output of request ``r`` (§4.5; :func:`remaining_curve`)."""
        return int(self.resid[min(int(self.sim.rs.generated[r]), self.resid.size - 1)])

    def _fit(self, n: int) -> None:
        """Widen the rows to hold ``n`` residents."""
        if n > self.width:
            grow = max(n, 2 * self.width) - self.width
            self.rem, self.csum, self.pb, self.sa = (np.pad(a, ((0, 0), (0, grow)))
                                                     for a in (self.rem, self.csum, self.pb, self.sa))
            self.width += grow

    def refresh_stale(self, now: float) -> None:
        """Instances whose predicted iteration ended with residents left and no new batch formed since: their
        residents may have finished (an instance that empties is not scheduled again). Re-read those."""
        for j in pk.stale(self.busy_until, self.n_res, self.checked, now).tolist():
            self.read(self.sim.instances[j])
            self.checked[j] = True  # once per formed batch: an iteration may outlast its prediction

    def resync(self, now: float) -> bool:
        """Re-read every instance whose resident count changed since its row was written (finishes are seen
        only at the next batch formation; a pending request retried at a finish must see it). True if any."""
        self.grow()
        actual = np.array([len(i.running) + len(i.waiting) + (self.in_transfer(i.id) if self.incoming[i.id] else 0)
                           for i in self.sim.instances], np.int64)
        diff = np.flatnonzero(actual != self.n_res)
        for j in diff.tolist():
            self.read(self.sim.instances[j])
        return bool(diff.size)

    def prefill_deadline(self, idx: np.ndarray, engine: Any) -> np.ndarray:
        """Time by which prefill instance prompts ``idx`` must end (best effort: ``inf``) so that their second
        token stays reachable: it is due one TPOT after the TTFT deadline (§4.6: "regulated by TTFT + TPOT") and
        comes after the KV transfer, the decode host's wait and one decode step. The step is at most the TPOT
        (decode admission, §4.5) and at most :attr:`step_max`, the profiled time of the largest decode batch;
        the wait is taken as none (§4.6: the hand-off goes to a server that "finishes the current cycle very
        soon"). So the prefill must end by the TTFT deadline less ``max(transfer + min(TPOT, step_max) - TPOT,
        0)``."""
        rs, w = self.sim.rs, self.sim.w
        transfer = getattr(self.sim, "transfer", None)
        xfer = transfer.seconds(rs.num_tokens[idx], engine) if transfer is not None else 0.0
        tpot = self.rtpot[idx]
        hand_off = np.maximum(xfer - np.maximum(tpot - self.step_max, 0.0), 0.0)
        return np.where(rs.be[idx], INF, rs.ready[idx] + w.stage_ttft[rs.stage[idx]] - hand_off)

    def prefill_queue(self, inst: Instance, r: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Prefill instance ``inst``'s prompts (with request ``r`` joining its waiting list) in its scheduler's
        order (TTFT deadline, best effort last: ``PolyScheduler._deadline_order``): tokens still to prefill after
        the iteration in flight, tokens in the KV by then, the prefill deadlines (:meth:`prefill_deadline`), and
        the position of ``r`` (-1 without)."""
        rs, w = self.sim.rs, self.sim.w
        cands = inst.running + inst.waiting
        c = np.array(cands if r is None else [*cands, r], np.int64)
        order = pk.deadline_order(c, rs.ready, rs.stage, w.stage_ttft, rs.be, w.arrival) if c.size > 1 else c
        past = rs.num_computed[order].astype(np.int64)
        if inst.inflight is not None:  # chunks in flight are in the KV when the next iteration starts
            idx, tok, _ = inst.inflight
            flying = dict(zip(idx.tolist(), np.asarray(tok).tolist()))
            past += np.array([flying.get(x, 0) for x in order.tolist()], np.int64)
        left = np.maximum(rs.num_tokens[order] - past, 0).astype(np.int64)
        deadline = self.prefill_deadline(order, inst.engine)
        return left, past, deadline, -1 if r is None else int(np.flatnonzero(order == r)[0])

    def note_routed(self, r: int) -> None:
        if not self.routed[r]:
            self.routed[r] = True
            self.n_routed += 1

    def settled(self) -> bool:
        """No request can be routed again: every request was routed once (arrived, released), none waits in the
        cluster's global queue, and no prefill instance holds a request still to hand off to a decode instance
        (resident, or parked: a pending hand-off). From then on nothing reads the rows, so batches may be
        fast-forwarded (monotone: cached once true)."""
        if not self._settled and self.n_routed == self.routed.size and not self.sim.global_queue:
            self._settled = not any(self.sim.instances[p].n_resident or self.sim.instances[p].n_parked
                                    for p in self.prefill.tolist())
        return self._settled

    # ---------------------------------------------------------------- labels and cost
    def relabel(self, j: int, label: int, now: float) -> None:
        """Move instance ``j`` to a tier, the pool or the pending list (§4.3-4.4)."""
        old = int(self.label[j])
        if old == label:
            return
        if old < self.n_tiers and j in self.joined[old]:
            self.joined[old].remove(j)
        if label < self.n_tiers:
            self.joined[label].append(j)
        if old == self.POOL:
            self.use_since[j] = now
        elif label == self.POOL and not np.isnan(self.use_since[j]):
            self.used_seconds[j] += now - self.use_since[j]
            self.use_since[j] = np.nan
        self.label[j] = label
        set_pool = getattr(self.sim, "set_pool", None)
        if set_pool is not None:
            set_pool(j, label)

    def instance_seconds(self, end: float) -> float:
        """Instance-seconds spent outside the best-effort pool up to ``end`` (PolyServe's cost, §5.4)."""
        live = np.where(np.isnan(self.use_since), 0.0, end - np.nan_to_num(self.use_since))
        return float(self.used_seconds.sum() + live.sum())

    def operating_tpot(self, j: int, tightest: float) -> float:
        """TPOT instance ``j`` must hold: its label's, or ``tightest`` (its tightest resident's, from
        :meth:`read`) when tighter (demoted requests have no SLO left to hold)."""
        return min(float(self.label_tpot[self.label[j]]), tightest)

    def curve_rows(self, tpot: np.ndarray) -> np.ndarray:
        """Row of :attr:`curves` for each host TPOT (tabulating a TPOT that is no tier's on first use)."""
        rows = np.zeros(tpot.size, np.int64)
        for u in np.unique(tpot).tolist():
            if u not in self.curve_tpots:
                self.curve_tpots.append(u)
                self.curves = np.vstack((self.curves, self.table.budget_curve(u)[1]))
            rows[tpot == u] = self.curve_tpots.index(u)
        return rows

    def chunk_budget(self, dec: int, kv: int, tpot: float, past: int) -> int:
        """Prefill tokens a co-located batch of ``dec`` decodes at KV size ``kv`` may add within ``tpot`` when its
        chunk attends ``past`` tokens: the table's token budget less the decodes (§4.5), shrunk so the chunk's
        prefill attention over its past fits too (:func:`polyserve_kernels.co_chunk`, which the router's
        admission reads as well). Deviation: §4.5's table leaves prefill attention out ("sequence lengths less
        than 10K"); §3.5 counts it in the co-located iteration time, and slogym's traces pass 10K."""
        t, p = self.table, self.ptable
        grid, curve = t.budget_curve(tpot)
        return pk.co_budget(grid, curve, t.tokens, t.kv, t.times, p.tokens, p.kv, p.times, dec, float(kv), tpot,
                            float(past))

    def chunk_attention(self, reqs: list[int], toks: list[int]) -> float:
        """Predicted time the prefill chunks ``toks`` of requests ``reqs`` spend attending their past KV (the part
        of a co-located iteration the (batch size, KV size) table leaves out; :func:`polyserve_kernels.attn_extra`)."""
        p = self.ptable
        past = self.sim.rs.num_computed[np.array(reqs, np.int64)]
        return pk.chunks_attention(p.tokens, p.kv, p.times, np.array(toks, np.int64), past)

    def cycle_time(self, idx: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Predicted time of an iteration of everything outstanding on each instance: its residents' decode
        steps plus its queued prompt tokens, at its KV size (Minimal's cycle time)."""
        n = self.n_res[idx]
        return np.where(n > 0, self.table.time(n + self.q_pre[idx], self.kv_now[idx]), 0.0)


def request_tiers(min_tpot: np.ndarray, best_effort: np.ndarray, tiers: np.ndarray) -> np.ndarray:
    """Tier index per request (§4.2): the loosest tier whose TPOT is <= the request's (so a request between two
    tiers is served at the tighter one), 0 when tighter than every tier, ``len(tiers)`` for best effort and for
    requests without a TPOT SLO."""
    idx = np.maximum(np.searchsorted(tiers, min_tpot, side="right") - 1, 0)
    loose = best_effort | ~np.isfinite(min_tpot)
    return np.where(loose, tiers.size, idx).astype(np.int64)


def workload_tiers(min_tpot: np.ndarray, best_effort: np.ndarray) -> np.ndarray:
    """The workload's distinct finite TPOT SLOs (at most ``MAX_TIERS``: beyond, their quantiles)."""
    vals = np.unique(min_tpot[np.isfinite(min_tpot) & ~best_effort])
    if vals.size > MAX_TIERS:
        vals = np.unique(np.quantile(vals, np.linspace(0, 1, MAX_TIERS), method="lower"))
    return vals.astype(np.float64)


REMAINING = ("residual", "average")


def remaining_curve(outputs: np.ndarray, avg_decode_len: float | None = None, mode: str = "residual") -> np.ndarray:
    """Predicted remaining output tokens of a request by the tokens it generated so far (index ``g``; the last
    entry holds beyond the end), at least 1 (§4.5: "predicting the output length using the average decode
    length").

    ``average`` (the paper): ``avg - g`` (``avg`` = ``avg_decode_len``, default the mean of ``outputs``, the
    provider's history), so a request past the average is predicted to end at its next step. ``residual``
    (Deviation): the average decode length *of the requests that generated ``g`` tokens*, ``mean(L - g | L >
    g)`` over ``outputs`` (``avg_decode_len`` scales it to that mean) -- equal to the paper's prediction at ``g =
    0``; for a long-running request it stays the expected rest instead of 1 token, which keeps §4.5's future KV
    peak from under-predicting instances packed with requests past the average."""
    if mode not in REMAINING:
        raise ValueError(f"remaining={mode!r}; must be one of {REMAINING}")
    out = np.asarray(outputs, np.float64)
    avg = float(avg_decode_len or (out.mean() if out.size else 1.0))
    if mode == "average" or not out.size:
        return np.maximum(int(max(avg, 1.0)) - np.arange(int(max(avg, 1.0)) + 1), 1).astype(np.int64)
    lens = np.sort(out)
    g = np.arange(int(lens[-1]) + 1, dtype=np.float64)
    first = np.searchsorted(lens, g, side="right")              # outputs <= g end before generating g + 1
    tail = np.concatenate((np.cumsum(lens[::-1])[::-1], [0.0]))  # sum of outputs from each sorted position on
    alive = lens.size - first
    mean_rest = np.where(alive > 0, tail[first] / np.maximum(alive, 1) - g, 1.0)
    return np.maximum(np.round(mean_rest * avg / out.mean()), 1).astype(np.int64)


def pd_split(w: "Workload", engine: Any, n_inst: int, n_tiers: int) -> tuple[int, int]:
    """Prefill/decode instances of a disaggregated fleet of ``n_inst`` (the paper gives no split; the
    reproduction's rule, ``scripts/reproduce/polyserve.py``): prefill instances in proportion to the prefill share
    of the work, prefill at 1024-token chunks (``t(1024) / 1024`` per token) against decode at a 128-request batch
    (``t(128, 128 ctx) / 128`` per token, ``ctx = P + O/2``), from ``engine``'s profile table. At least one decode
    instance per TPOT tier where the fleet has room for it (``n_inst >= 2 x n_tiers``): PD-PolyServe partitions
    the decode servers into one cluster per tier (§4.2), which fewer decode instances cannot hold (Azure code's
    work share alone gives 19:1 at 20 instances; it gets 16:4). Both sides keep at least one instance."""
    if n_inst < 2:
        raise ValueError(f"n_inst={n_inst}: a prefill/decode split needs at least 2 instances")
    table = table_for(engine)
    p, o = float(w.input_tokens.mean()), float(w.output_tokens.mean())
    c_p = table.time_one(1024, 0) / 1024
    c_d = table.time_one(128, int(128 * (p + o / 2))) / 128
    n_p = int(round(n_inst * p * c_p / (p * c_p + o * c_d)))
    min_dec = n_tiers if n_tiers >= 1 and n_inst >= 2 * n_tiers else 1
    n_p = min(max(n_p, 1), n_inst - min_dec)
    return n_p, n_inst - n_p


class PolyCore:
    """State shared by a PolyServe policy's router, scheduler and scaler for one run.

    ``disaggregate`` (the PD variants): at reset a co-located cluster of ``n >= 2`` instances is split into
    :func:`pd_split`'s prefill and decode instances (:func:`~slogym.baselines.common.split_colocated`, as
    DistServe does); a cluster built with ``Simulator(pd=...)`` keeps its roles, and one instance, or an engine
    without a KV size, stays co-located (the variant then runs as its CO counterpart)."""

    def __init__(self, tiers: tuple[float, ...] | None = None, avg_decode_len: float | None = None,
                 prefill_budget: int = 1024, max_num_seqs: int = 1 << 30, remaining: str = "residual",
                 disaggregate: bool = False, name: str = "polyserve") -> None:
        if avg_decode_len is not None and not avg_decode_len >= 1:
            raise ValueError(f"avg_decode_len={avg_decode_len!r}; must be >= 1 token")
        if remaining not in REMAINING:
            raise ValueError(f"remaining={remaining!r}; must be one of {REMAINING}")
        self.remaining = remaining
        if prefill_budget < 1:
            raise ValueError(f"prefill_budget={prefill_budget!r}; must be >= 1 token")
        self.prefill_budget = prefill_budget
        self.max_num_seqs = max_num_seqs  # the scheduler's; the router's predictions form batches within it
        if tiers is not None and (not len(tiers) or any(not (t > 0) for t in tiers)):
            raise ValueError(f"tiers={tiers!r}; must be positive TPOTs in seconds")
        self.tiers = tiers
        self.avg_decode_len = avg_decode_len
        self.disaggregate, self.name = disaggregate, name
        self.sim: "Simulator | None" = None

    def reset(self, sim: "Simulator") -> None:
        w = sim.w
        tiers = np.array(sorted(self.tiers), np.float64) if self.tiers else workload_tiers(w.min_tpot,
                                                                                           w.best_effort)
        if self.disaggregate:  # before the fleet reads the roles
            split_colocated(sim, lambda n: pd_split(w, sim.instances[0].engine, n, tiers.size), self.name)
        resid = remaining_curve(w.output_tokens, self.avg_decode_len, self.remaining)
        self.fleet = Fleet(sim, table_for(sim.instances[0].engine), tiers, resid, self.max_num_seqs)
        self.sim = sim

    def ensure(self, sim: "Simulator") -> "Fleet":
        if self.sim is not sim:
            self.reset(sim)
        return self.fleet


# ============================================================================ batch formation
class PolyScheduler(Scheduler):
    """Decode-first chunked prefill with a profile-based token budget (§4.5), or a static one (CO-Chunk).

    ``token_budget=None``: the budget is the largest token batch whose profile-table time at the instance's current
    KV size stays within its operating TPOT (at least ``min_chunk`` tokens beyond the decodes, so prefills always
    progress). Prefill chunks go to candidates in TTFT-deadline order, demoted / best-effort ones last.

    ``polyserve`` (PolyServe itself; off for the §5.1 baselines, whose batch formation stays the paper's table
    alone): co-located, the chunk also pays for the head prompt's prefill attention over its past
    (:meth:`Fleet.chunk_budget`, the rule the router's admission predicts with) and the predicted iteration time
    counts it (:meth:`Fleet.chunk_attention`); on a PD prefill instance, dynamic chunking and the prefill profile.

    A batch of decodes alone (nothing prefilling or waiting, no preemption) is ``steady`` once the fleet is
    :meth:`Fleet.settled`; a finish leaves the rule unchanged (``steady_through_finish``).
    """

    steady_through_finish = True

    def __init__(self, core: PolyCore, token_budget: int | None = None, min_chunk: int = 32,
                 max_num_seqs: int = 256, polyserve: bool = True) -> None:
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget={token_budget!r}; must be >= 1 (or None for the profile budget)")
        if min_chunk < 1 or max_num_seqs < 1:
            raise ValueError(f"min_chunk={min_chunk!r} and max_num_seqs={max_num_seqs!r} must be >= 1")
        self.core, self.token_budget, self.min_chunk, self.max_num_seqs = core, token_budget, min_chunk, max_num_seqs
        self.polyserve = polyserve

    def reset(self, sim: "Simulator") -> None:
        self.core.ensure(sim)

    def _deadline_order(self, inst: Instance, cands: list[int] | np.ndarray) -> np.ndarray:
        """Prefill candidates by TTFT deadline, demoted / best-effort ones last (ties: arrival, then queue order)."""
        c = np.asarray(cands, np.int64)
        if c.size < 2:
            return c
        rs, w = inst.sim.rs, inst.sim.w
        return pk.deadline_order(c, rs.ready, rs.stage, w.stage_ttft, rs.be, w.arrival)

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        fleet = self.core.fleet
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            fleet.observe(inst, now)
            return None
        if inst.role == Role.PREFILL:  # everything here is prefilling (a last token of 1 included)
            return self._prefill_batch(inst, now, inst.running)
        rs, w = inst.sim.rs, inst.sim.w

        def victim_key(r: int) -> float:  # latest next deadline first; demoted / best-effort before all
            return INF if rs.be[r] else float(rs.next_deadline(w, np.array([r]))[0])

        victims: list[int] = []
        free = inst.free_blocks
        if dec.size:
            dec, victims, free = make_room_for_decodes(inst, dec, victim_key)
            if victims:
                pre = np.array([r for r in pre.tolist() if r not in victims], dtype=np.int64)
        kv_now = (inst.total_blocks - inst.free_blocks) * inst.block_size
        tightest = fleet.read(inst)
        waiting = [r for r in inst.waiting if r not in victims] if victims else inst.waiting
        reqs: list[int] = []
        toks: list[int] = []
        if pre.size or waiting:  # the budget only shapes prefill chunks
            cands = self._deadline_order(inst, np.concatenate((pre, np.array(waiting, np.int64))) if waiting else pre)
            if self.token_budget is None:  # PolyServe: the head prompt's chunk attends its past (§3.5)
                tpot = fleet.operating_tpot(inst.id, tightest)
                past = int(rs.num_computed[cands[0]]) if self.polyserve else 0
                room = max(fleet.chunk_budget(dec.size, kv_now, tpot, past), self.min_chunk)
            else:
                room = self.token_budget - dec.size
            reqs, toks, _, _ = fill_prefill_chunks(inst, cands, room, free, self.max_num_seqs - dec.size)
        chunked = sum(toks)
        n_tok = dec.size + chunked
        busy = fleet.table.time_one(n_tok, kv_now + n_tok)
        if self.polyserve and chunked:
            busy += fleet.chunk_attention(reqs, toks)
        fleet.formed(inst.id, now, busy, reqs, toks)
        if not reqs:
            if not dec.size and not victims:  # the victim is the last prompt in the order chunks are given
                order = self._deadline_order(inst, inst.running).tolist()  # (else it restarts ahead, forever)
                return unstick(inst, {r: k for k, r in enumerate(order)}.__getitem__)
            # decodes alone repeat; fast-forwarding them skips the row refreshes, so only once nothing reads them
            steady = not (victims or pre.size or waiting) and fleet.settled()
            return decode_batch(dec, victims, steady=steady)
        return batch_of(np.concatenate((dec, reqs)), np.concatenate((np.ones(dec.size, np.int64), toks)), victims)

    def _prefill_batch(self, inst: Instance, now: float, pre: list[int]) -> Batch | None:
        """A prefill instance of a disaggregated cluster (§4.2, §4.7): prompts in TTFT-deadline order with dynamic
        chunking of the ``prefill_budget`` (a remainder below twice the budget is finished at once; the PD
        baselines chunk plainly, ``polyserve=False``)."""
        budget = self.token_budget or self.core.prefill_budget
        free = inst.free_blocks
        reqs: list[int] = []
        toks: list[int] = []
        for r in self._deadline_order(inst, pre + inst.waiting).tolist():
            if budget <= 0 or len(reqs) >= self.max_num_seqs:
                break
            rem = int(inst.remaining([r])[0])
            want, left = dynamic_chunk(rem, budget) if self.polyserve else (min(rem, budget), budget - min(rem, budget))
            got, chunk, used, _ = fill_prefill_chunks(inst, [r], want, free, 1)
            if not got:
                break  # KV is full: the transfers out will free it
            reqs.append(r)
            toks.append(chunk[0])
            free -= used
            budget = left if chunk[0] == want else 0
        n_tok = sum(toks)
        fleet = self.core.fleet
        if self.polyserve and n_tok:  # PolyServe: the prefill profile at the chunks' mean past (§4.5, §4.7)
            past = inst.sim.rs.num_computed[np.array(reqs, np.int64)]
            busy = fleet.ptable.time_one(n_tok, float(np.dot(past, toks)) / n_tok)
        else:  # the PD baselines' cycle time reads the (batch size, KV size) table (§5.1)
            kv_now = (inst.total_blocks - inst.free_blocks) * inst.block_size
            busy = fleet.table.time_one(n_tok, kv_now + n_tok)
        fleet.observe(inst, now, busy, reqs, toks)
        if not reqs:
            return None
        return batch_of(reqs, toks)


# ============================================================================ routing
@dataclass
class Verdict:
    """Admission of one request on candidate instances (arrays over the candidates)."""

    ok: np.ndarray
    load: np.ndarray
    kv_peak: np.ndarray
    first_token: np.ndarray


class _FleetRouter(Router):
    """Base of the routers reading a :class:`Fleet` (PolyServe, Random, Minimal). On a disaggregated cluster
    arrivals go to PREFILL instances and :meth:`route_decode` picks the DECODE instance; on a co-located one every
    instance takes arrivals. The fleet is fixed for the run (PolyServe re-labels instances, never adds/drains)."""

    pd_aware = True

    def __init__(self, core: PolyCore) -> None:
        self.core = core
        self.decisions = 0

    def reset(self, sim: "Simulator") -> None:
        self.core.reset(sim)
        self.decisions = 0

    def _count(self, req: int) -> None:
        """A routing decision for ``req`` (counted, and its first one noted for :meth:`Fleet.settled`)."""
        self.decisions += 1
        self.core.fleet.note_routed(req)

    def _entry(self) -> np.ndarray:
        fleet = self.core.fleet
        return fleet.prefill if fleet.prefill.size else np.arange(fleet.label.size)

    def _commit(self, r: int, j: int, sim: "Simulator") -> int:
        """Request ``r`` goes to instance ``j``: into ``j``'s row at once (and, for a decode hand-off, into
        ``j``'s transfers under way, :meth:`Fleet.in_transfer`)."""
        rs, fleet = sim.rs, self.core.fleet
        left = int(rs.num_tokens[r] - rs.num_computed[r])
        fleet.place(j, r, int(rs.num_tokens[r]), left if left > 1 else 0)
        if rs.status[r] == TRANSFER:
            fleet.incoming[j].append(r)
        return j


class RandomRouter(_FleetRouter):
    """CO-Random / PD-Random (§5.1): a uniformly random instance (seeded by the run's seed); on a disaggregated
    cluster a random prefill instance, then a random decode instance."""

    def reset(self, sim: "Simulator") -> None:
        super().reset(sim)
        self._rng = np.random.default_rng(sim.seed + 7919)

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        self._count(req)
        entry = self._entry()
        return self._commit(req, int(entry[self._rng.integers(entry.size)]), sim)

    def route_decode(self, req: int, sim: "Simulator", now: float) -> int:
        dec = self.core.fleet.decode
        return self._commit(req, int(dec[self._rng.integers(dec.size)]), sim)


class MinimalRouter(_FleetRouter):
    """CO-Minimal / PD-Minimal (§5.1): the instance with the lowest predicted cycle time (ties: lowest index);
    on a disaggregated cluster among the prefill instances, then among the decode instances."""

    def _lowest(self, j: np.ndarray, now: float) -> int:
        fleet = self.core.fleet
        fleet.refresh_stale(now)
        return int(j[np.argmin(fleet.cycle_time(j))])

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        self._count(req)
        return self._commit(req, self._lowest(self._entry(), now), sim)

    def route_decode(self, req: int, sim: "Simulator", now: float) -> int:
        return self._commit(req, self._lowest(self.core.fleet.decode, now), sim)


class PolyServeRouter(_FleetRouter):
    """PolyServe's tiered router (§4.1-4.7; see the module docstring for the full rule)."""

    def reset(self, sim: "Simulator") -> None:
        super().reset(sim)
        self.pending: dict[int, int] = {}  # decode hand-offs pending (request -> tier), §4.2's per-tier queues
        self.pending_tier = np.zeros(self.core.fleet.n_tiers + 1, np.int64)

    def _unpend(self, r: int) -> None:
        t = self.pending.pop(r, None)
        if t is not None:
            self.pending_tier[t] -= 1

    def _hosts(self, t: int, decode: bool) -> np.ndarray:
        """Host ranks of tier ``t``'s candidates (:attr:`Fleet.host_rank`), less, for a decode hand-off, the
        tighter tiers with hand-offs of their own pending: §4.2 keeps a queue per TPOT tier, and lazy promotion
        (§4.4) takes a tighter cluster only because the request's own is full -- a tighter tier whose own
        requests pend is full too, and the capacity it frees is theirs."""
        ranks = self.core.fleet.host_rank[t]
        if not decode or not self.pending_tier[:t].any():
            return ranks
        status = self.core.sim.rs.status
        for r in [r for r in self.pending if status[r] != TRANSFER]:  # left the wait otherwise (dropped)
            self._unpend(r)
        blocked = np.flatnonzero(self.pending_tier[:t])
        if not blocked.size:
            return ranks
        ranks = ranks.copy()
        ranks[blocked] = pk.NO_HOST
        return ranks

    def admission(self, j: np.ndarray, r: int, now: float, host_tpot: float | np.ndarray) -> Verdict:
        """Co-located admission of request ``r`` on instances ``j`` whose operating TPOT would be ``host_tpot``
        (one value, or one per instance).

        TPOT: profile time of the decode batch (residents + 1) at the predicted peak KV <= host TPOT (§4.5).
        TTFT: continuous chunked-prefill prediction (§4.7, co-location) with the wait time (§4.6): the chunk that
        fits beside that decode batch at the peak KV, for the whole prefill, must finish the queued prefill tokens
        and this prompt before the TTFT deadline. KV: the peak must fit in the instance's KV memory.
        """
        return self._verdicts(j, r, now, host_tpot, decode=False)

    def decode_admission(self, j: np.ndarray, r: int, now: float, host_tpot: float | np.ndarray) -> Verdict:
        """Disaggregated decode admission of prefilled request ``r`` on decode instances ``j`` (§4.5-4.6): the
        decode batch at the predicted peak KV within the host TPOT, the peak within KV memory, and -- wait-time
        aware -- its next token (the second) before its deadline after the KV transfer, the rest of the host's
        current iteration and one decode step. ``first_token`` holds that predicted next-token time."""
        return self._verdicts(j, r, now, host_tpot, decode=True)

    def _verdicts(self, j: np.ndarray, r: int, now: float, host_tpot: float | np.ndarray, decode: bool) -> Verdict:
        """:meth:`admission` / :meth:`decode_admission`, one compiled pass over the candidates
        (:func:`polyserve_kernels.verdicts`; the future KV peak of each is :func:`future_kv_peak`'s)."""
        fleet, table = self.core.fleet, self.core.fleet.table
        tpot = np.full(j.size, host_tpot, np.float64) if np.ndim(host_tpot) == 0 else np.asarray(host_tpot, np.float64)
        m = j.size
        ok, load, peak, first = np.empty(m, bool), np.empty(m), np.empty(m, np.int64), np.empty(m)
        ctx, prompt, r0, deadline, xfer_of = self._request(r, decode)
        xfer = float(xfer_of[fleet.engine_of[j[0]]]) if m else 0.0
        pk.verdicts(decode, j, fleet.curve_rows(tpot), tpot, fleet.grid, fleet.curves, fleet.rem, fleet.csum,
                    fleet.pb, fleet.sa, fleet.n_res, fleet.q_slo, fleet.kv_now, fleet.busy_until, fleet.cap,
                    fleet.max_seqs, table.tokens, table.kv, table.times, fleet.ptable.tokens, fleet.ptable.kv,
                    fleet.ptable.times, ctx, prompt, r0, now, deadline, xfer, ok, load, peak, first)
        return Verdict(ok, load, peak, first)

    def _request(self, r: int, decode: bool) -> tuple[int, int, int, float, np.ndarray]:
        """What admission needs of request ``r``: its context (co-located: its known length; decode: its KV plus
        the next token), prompt tokens still to prefill, predicted remaining output (average decode length minus
        tokens generated, at least 1; §4.5), the deadline of its next output (co-located: the TTFT deadline;
        decode: its next token's, DSLO) and, for a decode hand-off, the KV transfer time per engine."""
        fleet, sim = self.core.fleet, self.core.sim
        rs, w = sim.rs, sim.w
        r0 = fleet.remaining(r)
        if not decode:
            return (int(rs.num_tokens[r]), int(rs.num_tokens[r] - rs.num_computed[r]), r0,
                    float(rs.ready[r] + w.stage_ttft[rs.stage[r]]), fleet.no_xfer)
        transfer = getattr(sim, "transfer", None)
        nc = int(rs.num_computed[r])
        xfer = np.array([transfer.seconds(nc, e) for e in fleet.engines]) if transfer else fleet.no_xfer
        deadline = INF if rs.be[r] else float(rs.next_deadline(w, np.array([r]))[0])  # best effort: none
        return nc + 1, 0, r0, deadline, xfer

    def prefill_admission(self, j: np.ndarray, r: int, now: float) -> Verdict:
        """Disaggregated prefill admission of request ``r`` on prefill instances ``j`` (§4.2, §4.6, §4.7).

        The prefill queue runs in TTFT-deadline order (§4.2: "prioritizing the request with the nearest
        deadline") with dynamic chunking (§4.7), so the prediction replays it: from the end of the iteration in
        flight (the wait time, §4.6) the iterations the scheduler will form -- ``r`` at its deadline's place,
        behind the "requests [already] scheduled" due earlier (§4.7) -- timed by the prefill profile
        (:func:`prefill_profile_table`), give every queued prompt's first token
        (:func:`polyserve_kernels.prefill_admits`). Admitted when ``r`` finishes by its prefill deadline (the
        TTFT deadline less the hand-off, :meth:`Fleet.prefill_deadline`) and no prompt predicted on time without
        ``r`` turns late with it: a later, tighter request overtakes those admitted before it, and the server
        must "still achieve TTFT" (§4.7) for them too. The load (for the load gradient) is the queued prompt
        tokens."""
        fleet = self.core.fleet
        ok, first = np.empty(j.size, bool), np.empty(j.size)
        pt = fleet.ptable
        for m, i in enumerate(j.tolist()):
            inst = self.core.sim.instances[i]
            left, past, deadline, pos = fleet.prefill_queue(inst, r)
            t0 = max(float(fleet.busy_until[i]), now) if inst.inflight is not None else now
            ok[m], first[m] = pk.prefill_admits(left, past, deadline, pos, self.core.prefill_budget,
                                                int(fleet.max_seqs[i]), t0, pt.tokens, pt.kv, pt.times)
        return Verdict(ok, fleet.q_pre[j].astype(np.float64), np.zeros(j.size, np.int64), first)

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        self._count(req)
        fleet = self.core.fleet
        fleet.refresh_stale(now)
        place = self._place_prefill if fleet.prefill.size else self._place
        i = place(req, sim, now)
        if i == DEFER and fleet.resync(now):
            i = place(req, sim, now)
        return i if i != DEFER else self._pend(req, sim, now)

    def route_decode(self, req: int, sim: "Simulator", now: float) -> int:
        """The decode instance of a prefilled request (§4.2: its tier's decode cluster, with lazy promotion and
        scale-up as for arrivals). When nothing admits it the hand-off pends (``DEFER``; §4.2-4.3: a request
        waits rather than break its tier's TPOT on a full instance, "requests start pending"), its KV held on
        the prefill instance; the simulator offers it again whenever a request finishes. It pends while its
        next token can still be on time (:meth:`_decode_late`) and something may still finish
        (:meth:`_may_finish`). A request whose next token is lost is demoted (``BEST_EFFORT``: the simulator marks
        it best effort and asks again), so its former tier no longer steers the tier logic (its rows' tightest
        tier, the scaler's own-tier check, the per-tier pending queues, batch order and preemption). A demoted
        request is routed as best effort (the pool first, then the loosest tier, each tier instance only if its
        TPOT still holds with it),
        and when nothing admits it goes to the least-loaded decode instance of the pool or pending list, else of
        the loosest tier, never onto its tier's instances (§4.3: best-effort work belongs to the best-effort
        pool). An in-time request that may not pend goes to the least-loaded decode instance of its tier or a
        tighter one, else to the least-loaded one, relabelled to its tier (labels only ever tighten, so no request
        sits on a looser instance): when nothing may ever finish (nothing else resident, nothing in transfer),
        when no decode instance hosts its tier or may scale up to it (:meth:`_has_cluster`), and on a decode side
        of fewer instances than tiers. Deviation: there §4.2's partition of the decode servers into one cluster
        per tier does not exist; the instances are shared across tiers, and a hand-off that waited until its
        next token is lost would still load the same instances (on Azure code's 19:1 split, one decode instance,
        pending took PD-PolyServe from 0.892 to 0.116 attainment at 100 % load), so it never waits there."""
        fleet = self.core.fleet
        fleet.refresh_stale(now)
        self._unpend(req)
        if self._decode_late(req, sim, now):
            return BEST_EFFORT
        i = self._place(req, sim, now, decode=True)
        if i == DEFER and fleet.resync(now):
            i = self._place(req, sim, now, decode=True)
        if i != DEFER:
            return i
        t = fleet.tier_of(req)
        if self._may_pend(t, sim):
            self.pending[req] = t
            self.pending_tier[t] += 1
            return DEFER
        dec = fleet.decode
        if t == fleet.n_tiers:
            group = np.minimum(fleet.label[dec], fleet.n_tiers + 1)  # the pool, then the loosest label present
            j = dec[group == group.max()]
            return self._commit(req, int(j[np.argmin(fleet.cycle_time(j))]), sim)
        own = dec[fleet.label[dec] <= t]
        j = own if own.size else dec
        i = int(j[np.argmin(fleet.cycle_time(j))])
        if fleet.label[i] > t:
            fleet.relabel(i, t, now)
        return self._commit(req, i, sim)

    def _decode_late(self, req: int, sim: "Simulator", now: float) -> bool:
        """Prefilled request ``req``'s next token misses its deadline even on an idle decode instance (the KV
        transfer and one step of it alone, profile table): its SLO is lost, so it no longer pends for its tier
        (the decode-side counterpart of :meth:`_pend`'s demotion). Always false for best-effort requests."""
        rs = sim.rs
        if rs.be[req]:
            return False
        ctx, _, _, deadline, xfer = self._request(req, decode=True)
        fleet = self.core.fleet
        j = int(fleet.decode[0])
        return now + float(xfer[fleet.engine_of[j]]) + fleet.table.time_one(1, ctx) > deadline

    def _may_pend(self, t: int, sim: "Simulator") -> bool:
        """A hand-off of tier ``t`` (``n_tiers``: best effort, never) may wait: the decode side holds a cluster
        per tier, something may still finish (:meth:`_may_finish`) and some decode instance may host tier ``t``
        (:meth:`_has_cluster`)."""
        fleet = self.core.fleet
        return (t < fleet.n_tiers and fleet.decode.size >= fleet.n_tiers and self._may_finish(sim)
                and self._has_cluster(t))

    def _has_cluster(self, t: int) -> bool:
        """Some decode instance hosts tier ``t`` (its own or a tighter tier) or may scale up to it (the pool, or
        the pending list holding only tier >= ``t`` requests): a hand-off of tier ``t`` may find a host by
        waiting. Without one (a decode side of one instance labelled looser, say) it would wait for nothing."""
        fleet = self.core.fleet
        lab = fleet.label[fleet.decode]
        return bool(((fleet.host_rank[t][lab] < pk.NO_HOST)
                     | (fleet.idle_label[lab] & (fleet.res_tight[fleet.decode] >= t))).any())

    @staticmethod
    def _may_finish(sim: "Simulator") -> bool:
        """A request may still finish and so offer a pending hand-off again: one is running or waiting on an
        instance, or on its way to a decode instance (its KV in transfer)."""
        return any(inst.running or inst.waiting or inst.n_incoming for inst in sim.instances)

    def _place_prefill(self, req: int, sim: "Simulator", now: float) -> int:
        """Disaggregated arrival (§4.2, §4.7): the highest-load prefill instance that still meets the TTFT."""
        j = self.core.fleet.prefill
        v = self.prefill_admission(j, req, now)
        if not v.ok.any():
            return DEFER
        return self._commit(req, int(j[np.argmax(np.where(v.ok, v.load, -1.0))]), sim)

    def _place(self, req: int, sim: "Simulator", now: float, decode: bool = False) -> int:
        """Steps 1-3 of the routing rule over tiered instances (co-located, or the decode instances of a
        disaggregated cluster): an instance index, or DEFER. Candidates: the instances of the request's tier
        (1), of tighter tiers (2, lazy promotion, nearest first; never a looser one), and for scale-up (3) a
        pending instance holding only tier >= t requests or an idle pool instance. Among those that admit
        (:meth:`admission` / :meth:`decode_admission`) the nearest tier wins, scale-up last, and within it the
        highest load (the load gradient): one compiled pass over the instances (:func:`polyserve_kernels.place`).
        A demoted decode hand-off is routed as best effort (its tier ``n_tiers``, no deadline).
        """
        fleet, table = self.core.fleet, self.core.fleet.table
        t = fleet.tier_of(req)
        ctx, prompt, r0, deadline, xfer_of = self._request(req, decode)
        i, up = pk.place(t, fleet.n_tiers, fleet.label, self._hosts(t, decode), fleet.idle_label, fleet.res_tight,
                         decode, fleet.engine_of, xfer_of, fleet.grid, fleet.curves, fleet.row_tpot, fleet.rem,
                         fleet.csum, fleet.pb, fleet.sa, fleet.n_res, fleet.q_slo, fleet.kv_now, fleet.busy_until,
                         fleet.cap, fleet.max_seqs, table.tokens, table.kv, table.times, fleet.ptable.tokens,
                         fleet.ptable.kv, fleet.ptable.times, fleet.admit_key, fleet.admit_val, ctx, prompt, r0, now,
                         deadline)
        if i < 0:
            return DEFER
        if up:
            fleet.relabel(i, t, now)
        return self._commit(req, i, sim)

    def _pend(self, req: int, sim: "Simulator", now: float) -> int:
        """Step 4: pend, unless even an idle server could no longer meet the TTFT (then: best effort; on a
        disaggregated cluster the idle prefill is predicted by :func:`polyserve_kernels.prefill_finish`;
        co-located, by the prompt alone in one iteration, and by the admission itself where an idle host
        refused it, :meth:`_refused_by_idle_host`). A
        request pends while it meets the TTFT but not its prefill deadline (:meth:`Fleet.prefill_deadline`)
        anywhere: the load may fall, and pending costs the others nothing."""
        fleet = self.core.fleet
        t, label = int(fleet.rtier[req]), fleet.label
        rs, w = sim.rs, sim.w
        prompt = int(rs.num_tokens[req] - rs.num_computed[req])
        if fleet.prefill.size:  # an idle prefill instance: the prompt alone, dynamically chunked
            pt, first = fleet.ptable, np.full(1, -1.0)
            pk.prefill_finish(np.array([prompt], np.int64), rs.num_computed[req:req + 1].astype(np.int64),
                              self.core.prefill_budget, 1, now, pt.tokens, pt.kv, pt.times, first)
            end = float(first[0])
        else:
            end = now + fleet.table.time_one(prompt, prompt)
        if end > rs.ready[req] + w.stage_ttft[rs.stage[req]] or self._refused_by_idle_host(req, now):
            return BEST_EFFORT
        if any(inst.n_resident for inst in sim.instances):
            return DEFER  # a finish will offer it again
        # an empty cluster will never retry it: its prediction (average length) is beyond one idle server; try
        # anyway on the first idle entry instance of its tier or the pool
        # (every instance is empty, so relabelling any of them to the request's tier is safe)
        if fleet.prefill.size:
            return self._commit(req, int(fleet.prefill[0]), sim)
        own, pool = np.flatnonzero(label == t), np.flatnonzero(label == fleet.POOL)
        i = int(own[0]) if own.size else int(pool[0]) if pool.size else 0
        if t < fleet.n_tiers:
            fleet.relabel(i, t, now)
        return self._commit(req, i, sim)

    def _refused_by_idle_host(self, req: int, now: float) -> bool:
        """Co-located: an idle instance that may host request ``req`` at its own tier (its tier's, the pool's or
        the pending list's; empty, no iteration in flight) did not admit it in :meth:`_place` -- the TTFT
        prediction of §4.7 fails even on an idle server, so waiting cannot help (the load only adds to it). The
        prompt alone in one iteration (the check before it in :meth:`_pend`) is faster than PolyServe's
        TPOT-bounded chunks of the tier, so without this check such a request pended until its TTFT was lost."""
        fleet = self.core.fleet
        t = int(fleet.rtier[req])
        if fleet.prefill.size or t >= fleet.n_tiers or self.core.sim.rs.be[req]:
            return False
        lab = fleet.label
        idle = (fleet.n_res == 0) & ((lab == t) | fleet.idle_label[lab]) & (fleet.busy_until <= now)
        return bool(idle.any())

    def best_effort_instance(self, req: int, sim: "Simulator", now: float) -> int:
        """Demoted requests go to the least-loaded prefill instance (disaggregated); co-located, to the pool, else
        the pending list, else the loosest tier (best-effort work belongs to the best-effort pool, §4.3), and
        within that group to the highest-load instance (§4.3's load gradient: the last, least-loaded instance of
        a tier must be left to empty, or it never returns to the pool for a tier that needs it; ties: lowest
        index)."""
        fleet = self.core.fleet
        if fleet.prefill.size:
            return self._commit(req, int(fleet.prefill[np.argmin(fleet.q_pre[fleet.prefill])]), sim)
        group = np.minimum(fleet.label, fleet.n_tiers)  # pool and pending list: n_tiers, ahead of every tier
        pool = np.flatnonzero(fleet.label == fleet.POOL)
        cands = pool if pool.size else np.flatnonzero(group == group.max())
        load = np.where(fleet.n_res[cands] > 0, fleet.table.time(fleet.n_res[cands], fleet.kv_now[cands]), 0.0)
        return self._commit(req, int(cands[np.argmax(load)]), sim)


# ============================================================================ auto-scaling (§4.3-4.4)
class PolyServeScaler(Scaler):
    """Every ``interval`` s: the last instance of each tier goes back to the pool when empty, to the pending list
    when it holds no request of its own tier (§4.4); pending instances that emptied go to the pool.

    :meth:`deltas` is the same rule as instance deltas per tier pool, for ``slogym/Scaling-v0`` with
    ``pools="tiers"`` (``expert_action("policy")``), where instances are started and drained instead of
    relabelled within a fixed fleet."""

    def __init__(self, core: PolyCore, interval: float = 0.1, min_chunk: int = 32) -> None:
        if not interval > 0:
            raise ValueError(f"interval={interval!r}; must be > 0 seconds")
        if min_chunk < 1:
            raise ValueError(f"min_chunk={min_chunk!r}; must be >= 1")
        self.core, self.interval, self.min_chunk = core, interval, min_chunk

    def reset(self, sim: "Simulator") -> None:
        self.core.ensure(sim)

    def decide(self, sim: "Simulator", now: float) -> None:
        fleet = self.core.fleet
        for t in range(fleet.n_tiers):
            if not fleet.joined[t]:
                continue
            j = fleet.joined[t][-1]
            inst = sim.instances[j]
            res = np.array(inst.running + inst.waiting, np.int64)
            if not inst.n_resident:
                fleet.relabel(j, fleet.POOL, now)
            elif not ((fleet.rtier[res] == t) & ~sim.rs.be[res]).any():  # a demoted one no longer counts
                fleet.relabel(j, fleet.PENDING, now)
        for j in np.flatnonzero(fleet.label == fleet.PENDING).tolist():
            if not sim.instances[j].n_resident:
                fleet.relabel(j, fleet.POOL, now)

    # ---------------------------------------------------------------- Scaling-v0 (tier pools)
    def deltas(self, sim: "Simulator", now: float) -> np.ndarray:
        """§4.3-4.4 as one instance delta per pool of ``slogym/Scaling-v0``'s ``pools="tiers"`` layout (pool ``p``
        = the instances labelled ``p`` = the workload's tier ``p``; the env's router keeps every request in its
        tier's pool).

        * +1 when requests of the tier *pend* (:meth:`pending`; §4.3: "when requests start pending for one SLO
          tier and the idle pool is not empty, PolyServe will assign the serving instance to the SLO"; the env's
          ``max_instances`` bound stands for the idle pool running dry);
        * -1 when an active instance of the pool holds no request (§4.3: "periodically check the requests in the
          last serving instance. If no requests are running on the server, the server will be returned to the
          best-effort pool"; the env takes back an instance still starting first, else drains the least-loaded
          active one, i.e. an empty one, which stops at once);
        * 0 when both hold (PolyServe would admit the pending requests on the empty instance) or neither.

        §4.4's pending list (a last instance holding only looser, promoted requests) has no counterpart: the env
        never promotes, so every resident of a tier pool is of its tier and "no request of the current tier"
        means empty. Deviations: the env's cold start delays a scale-up that the paper makes instant ("scaling
        happens instantly"): requests go on pending meanwhile, and the tier asks for one more instance at every
        check while they do (the rule as stated; the paper needs no rule for scale-ups under way); the idle pool
        is per tier (``max_instances``), not shared; the env routes by least outstanding tokens, not PolyServe's
        load gradient (§4.3), so a tier's instances empty, and scale down, only when its load leaves one idle
        between arrivals."""
        w = sim.w
        members: list[list[Instance]] = [[] for _ in w.tier_names]
        for inst in sim.instances:
            if inst.state != InstanceState.STOPPED and 0 <= inst.pool < len(members):
                members[inst.pool].append(inst)
        out = np.zeros(len(members), np.int64)
        for p, insts in enumerate(members):
            active = [i for i in insts if i.state == InstanceState.ACTIVE]
            empty = any(not (i.n_resident or i.n_incoming or i.n_parked) for i in active)
            pends = any(self.pending(i, now) for i in active)
            if pends != empty:  # both: the empty instance is where PolyServe would admit the pending requests
                out[p] = 1 if pends else -1
        return out

    def pending(self, inst: Instance, now: float) -> bool:
        """Requests placed on ``inst`` *pend* in PolyServe's sense: PolyServe's router would not have admitted
        them there (§4.1: "the highest-load but still SLO-attainable server"; the env's router places every
        request at once, so the requests PolyServe would keep pending in its router sit on the instances).
        Either test of the admission (§4.5-4.7) fails on the instance as it is:

        * TPOT (§4.5): its residents' token batch at their predicted future KV peak (each grows until its
          predicted end, the average decode length: :func:`future_kv_peak`, on the expert's own fleet rows,
          :meth:`Fleet.read`) takes longer than its operating TPOT (the tightest resident's), or the peak
          exceeds its KV memory, or the residents exceed its batch limit;
        * TTFT (§4.7): a request waiting for its first chunk can no longer meet its TTFT there: the chunk that
          fits beside the instance's decodes at its KV size within its TPOT (§4.5's profile budget, as
          :class:`PolyScheduler` forms batches, at least ``min_chunk``), every iteration of that chunk's profiled
          time, must prefill the prompt tokens queued ahead of it in TTFT-deadline order and its own before its
          TTFT deadline. A request whose TTFT not even an idle server meets any more is lost, not pending
          (PolyServe's router demotes it, :meth:`PolyServeRouter._pend`); best-effort requests never pend.

        Deviation: no wait for the iteration in flight (§4.6) is added to the TTFT prediction."""
        return self._over_tpot(inst) or self._late_ttft(inst, now)

    def _over_tpot(self, inst: Instance) -> bool:
        fleet = self.core.ensure(inst.sim)
        tpot = fleet.read(inst)
        j, n = inst.id, int(fleet.n_res[inst.id])
        if not n or tpot == INF:
            return False
        peak = pk.future_kv_peak_one(fleet.rem, fleet.csum, fleet.pb, fleet.sa, j, n, 0, 1)
        return bool(peak > fleet.cap[j] or n > fleet.max_seqs[j] or fleet.table.time_one(n, peak) > tpot)

    def _late_ttft(self, inst: Instance, now: float) -> bool:
        sim = inst.sim
        rs, w = sim.rs, sim.w
        slo = [r for r in inst.waiting if not rs.be[r]]
        if not slo:
            return False
        dec, pre = split_running(inst)
        queue = np.concatenate((pre, np.array(inst.waiting, np.int64)))
        order = pk.deadline_order(queue, rs.ready, rs.stage, w.stage_ttft, rs.be, w.arrival) if queue.size > 1 \
            else queue
        res = np.concatenate((inst.running_array(), queue[pre.size:]))
        tpot = float(np.min(w.min_tpot[res]))
        kv = (inst.total_blocks - inst.free_blocks) * inst.block_size
        table = table_for(inst.engine)
        chunk = max(table.token_budget_one(kv, tpot) - dec.size, self.min_chunk)
        step = table.time_one(dec.size + chunk, kv + chunk)
        left = (rs.num_tokens[order] - rs.num_computed[order]).astype(np.int64)
        first = now + np.ceil(np.cumsum(left) / chunk) * step
        deadline = rs.ready[order] + w.stage_ttft[rs.stage[order]]
        alone = now + table.time(left, rs.num_tokens[order])  # the prompt alone on an idle server
        waiting = np.isin(order, np.array(slo, np.int64))
        return bool((waiting & (first > deadline) & (alone <= deadline)).any())


# ============================================================================ registry
def _max_seqs(engine: Any, params: dict[str, Any]) -> int:
    return int(params.pop("max_num_seqs", getattr(engine, "max_num_seqs", 256) if engine is not None else 256))


def _make(name: str, router: Callable[[PolyCore], Router], static: bool = False,
          polyserve: bool = False, pd: bool = False) -> Callable[..., Policy]:
    """Factory of a policy; ``polyserve`` adds the tier scaler and PolyServe's batch formation (dynamic chunking,
    prefill attention); ``pd`` (the PD variants) splits a co-located cluster at reset (:class:`PolyCore`)."""
    def make(engine: Any = None, **params: Any) -> Policy:
        p = dict(params)
        seqs = _max_seqs(engine, p)
        core = PolyCore(p.pop("tiers", None), p.pop("avg_decode_len", None), int(p.pop("prefill_budget", 1024)),
                        seqs, str(p.pop("remaining", "residual")), disaggregate=pd, name=name)
        budget = int(p.pop("token_budget", 512)) if static else None
        min_chunk = int(p.pop("min_chunk", 32))
        sched = PolyScheduler(core, budget, min_chunk, seqs, polyserve=polyserve)
        sc = PolyServeScaler(core, float(p.pop("interval", 0.1)), min_chunk) if polyserve else None
        if p:
            raise ValueError(f"{name}: unknown parameters {sorted(p)}")
        info = {"scheduler": "PolyScheduler", "router": router.__name__, "token_budget": budget,
                "max_num_seqs": seqs, "tiers": core.tiers, "avg_decode_len": core.avg_decode_len,
                "prefill_budget": core.prefill_budget, "remaining": core.remaining}
        return Policy(name=name, scheduler=sched, router=router(core), scaler=sc, params=info)

    return make


POLICIES: dict[str, Callable[..., Policy]] = {
    "polyserve-co": _make("polyserve-co", PolyServeRouter, polyserve=True),
    "polyserve-co-random": _make("polyserve-co-random", RandomRouter),
    "polyserve-co-minimal": _make("polyserve-co-minimal", MinimalRouter),
    "polyserve-co-chunk": _make("polyserve-co-chunk", MinimalRouter, static=True),
    # the same mechanisms, instance roles decide: on Simulator(pd=(P, D)) as given; a co-located cluster of
    # n >= 2 instances is split at reset into pd_split's P:D (the reproduction's rule), as DistServe splits one
    "polyserve-pd": _make("polyserve-pd", PolyServeRouter, polyserve=True, pd=True),
    "polyserve-pd-random": _make("polyserve-pd-random", RandomRouter, pd=True),
    "polyserve-pd-minimal": _make("polyserve-pd-minimal", MinimalRouter, pd=True),
}

"""SLO-aware scheduling by simulated annealing (Huang et al. 2025, "SLO-Aware Scheduling for LLM Inferences").

The extracted paper lost its symbols; this module states the reconstruction it implements.

**Plan model (§3.1, Eq. 2-13).** A plan for ``N`` waiting requests is a priority sequence split into batches whose
sizes are at most the maximum batch size ``B_max`` (Eq. 10-12: each position belongs to one batch). Batches run one
after another (the paper submits each planned batch to vLLM as a group): request ``j`` of batch ``k`` executes in
``e_j(B_k)`` (Eq. 17, below), a batch lasts as long as its longest member, and ``j`` waits for all earlier batches:
``w_j = sum_{k'<k} max_{i in k'} e_i`` (Eq. 4, 8-9, 11). Its latency is ``w_j + e_j`` plus what it already waited
and the predicted remaining time of the running batch. ``s_j = 1`` (Eq. 5-7) when an e2e request finishes within its
e2e SLO, or a TTFT/TPOT request gets its first token within its TTFT (``w_j`` + prefill time) and its mean decode
time per token is within its TPOT. The objective (Eq. 2, 13) is ``G = sum_j s_j / sum_j latency_j`` -- SLO
attainment divided by average latency. Only which batch each request is in matters to ``G`` (order inside a batch
and empty batches do not), so a plan is stored as a batch index per request, ``g`` (priority = batch index, ties
by arrival): an exact, compact encoding of "permutation + batch-size sequence".

**Latency predictor (§4.2, Eq. 14-17).** ``e_j(B) = T_prefill(B, L_j) + T_decode(B, L_j, O_j)`` with ``B`` copies of
request ``j`` as the batch. Instead of refitting Eq. 14-15, the engine's own perf model is queried through
:class:`~slogym.core.batch.BatchFeatures` (for the ``qwen2.5-7b-v100-tp2`` preset this *is* Eq. 14-15 with Table 2's
coefficients), so the plan and the simulator agree on iteration times. Eq. 16 sums the per-token decode time over
the ``O_j - 1`` decode iterations with contexts ``L_j .. L_j + O_j - 2``; it is evaluated as the count times the mean
of the first and last iteration's time -- exact for any model linear in the context (Eq. 15), an approximation for
others. All ``B_max x N`` prefill and decode values come from one vectorized perf-model call per plan.

**Output lengths (§4.2, §5.1, §5.3).** :class:`~slogym.workloads.gaussian.GaussianLengthPredictor`: per-app Gaussian
updated online from completed requests, one random draw per request (kept for the request's lifetime so plans are
consistent). ``predictor="oracle"`` uses the true length; with ``length_error=e`` it is the true length times
``1 + u``, ``u`` uniform in ``[-e, e]`` and drawn once per request -- the paper's §5.3 study, which replaces the
Gaussian by "actual output lengths with variations of 2.5%, 5%, and 10%" (Fig. 9). Reconstructed: the text does not
say how the variation is distributed; a uniform relative error bounded by the stated percentage is assumed.
Before the run the Gaussian is warmed by replaying (app name, output length) pairs of earlier completed requests
through the online update (:meth:`~slogym.workloads.gaussian.GaussianLengthPredictor.warm`). Our reading of the
paper, which never says "warm" in so many words: the Gaussian is fitted on profiling data before the measured
requests arrive. §5.3: "the SLO-aware scheduler utilizes profiling data from tasks to dynamically update the mean
and the standard deviation of tasks' actual outputs", and its Fig. 9 runs are set up "rather than relying on
profiling data to predict output lengths"; §4.2: users may "specify a typical output range or distribution for
each task type", else "the request profiler is equipped with the capability to gather and model the output range
and distribution"; §5.1 "Workflows" runs profiling rounds after deploying the instance (stated there for the
latency fit only); and a predictor with no data would plan a pool of 4-40 waiting requests (Fig. 7) at one prior
length, i.e. with no output information at all. The default history (``history=None``) is the profiling slice
:func:`~slogym.workloads.profiling.default_history` -- the slice Tempo trains its forest on: ``history_requests``
requests of a fresh draw of the simulated scenario, seeded by ``seed`` (disjoint from the served requests; for a
workload that names no scenario, its first ``history_requests`` requests, which are also served). The paper gives
no profiling size; 1500 is Tempo's slice size. ``history=()`` runs cold (every app at the ``prior_len`` prior with
std 0 until its first completion): the ablation, and this module's default until 2026-11-22.

**Search (§4.3, Algorithm 1).** Two start solutions: arrival order with every batch at ``B_max``, and the
order of increasing predicted e2e latency (also at ``B_max``); if the second meets every SLO it is returned at once
(its latency sum is the lower bound) -- only when ``B_max = 1``: with batches, smaller batches can lower the latency
sum, so the paper's stopping rule is not optimal there and the search continues (deviation). Otherwise annealing
starts from the better one with three moves on a request: *squeeze* into the previous batch (if it is not in the
first and that batch has room), *delay* into the next batch (if it has room; from the last batch this opens a new
one), *swap* two requests' batches (= their positions in the priority sequence). These moves connect every plan
of the exhaustive space (``tests/test_sa.py`` checks it by breadth-first search). Hyper-parameters (§5.1
"Implementations" lists "to 500, to 20, to 100, and to 0.95" with the symbols lost): ``T0 = 100`` (Fig. 8 raises
the initial temperature "from 100 to 200"), decay ``alpha = 0.95``, ``T_min = 20`` (the only value below ``T0``),
hence ``L = 500`` moves per temperature level (``iters``): 32 levels, 16,000 evaluated moves.

Deviations, all documented in ``docs/baselines/sa.md``:

* Parallel moves (population annealing, Hukushima & Iba 2003): the ``L`` moves of a level are made by ``L`` plans
  in parallel, one Metropolis move each, instead of one after another by a single plan; between levels the
  population is resampled by each plan's Boltzmann-weight change, so it concentrates where a single chain cooling
  to the next temperature would be. Same budget (``L`` x levels evaluated moves). The best plan ever seen is
  returned (checked at every accepted move). The loop is compiled (:mod:`slogym.baselines.sa_kernels`, Numba),
  draws its random numbers from its own generator seeded by the scheduler's, and at ``B_max = 1`` scores a swap
  incrementally (only the positions between the two swapped ones change); :meth:`PlanProblem.score` and
  :func:`_propose` are its vectorized NumPy references (and score the exhaustive search).
* Population cap: at most ``max_entries // N`` plans per level (:class:`AnnealConfig`), so replans of hundreds of
  queued requests in overloaded simulations stay cheap; ``L = 500`` holds up to N = 16.
* Temperature units: ``G`` has units of 1/s, so the paper's temperatures only make sense on a normalized scale; the
  Metropolis test accepts a worse proposal with probability ``exp(100 * dG / (G_ref * T))`` -- the change in percent
  of the start solution's ``G`` (``G_ref``), divided by ``T``.
* Instance assignment (§4.4, Eq. 20) is the :class:`MemoryRoundRobinRouter`; Eq. 20's token count
  ``eta * M_rem / m_tok`` is read directly from the instance's free KV blocks (``m_tok`` is the preset's).

**In the simulator (§4.4 "Request Scheduling", §5.1 "Workflows").** The plan covers the instance's waiting requests
and is recomputed whenever a waiting request is not in it (an arrival, a return from preemption); finishes only feed
the length predictor. Each iteration is vLLM-style prefill-first: if requests wait, the earliest planned batch that
still has waiting members is admitted as one whole-prompt prefill batch (never mixed with the next planned batch --
the paper separates batches by 0.1 ms so vLLM does not merge them), capped by the free slots ``B_max - running``
and by KV memory; otherwise every running request decodes one token (KV shortage preempts the latest-planned
running request by recompute, as vLLM preempts its lowest-priority one).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from slogym.baselines.common import (batch_of, fill_prefill_chunks, make_room_for_decodes, positive_count,
                                     split_running, unstick)
from slogym.baselines.sa_kernels import anneal_population, score_plans
from slogym.core.batch import Batch, BatchFeatures
from slogym.core.instance import Instance
from slogym.core.policy import Policy, Router, Scheduler
from slogym.engines.arrays import BatchTimeEvaluator
from slogym.core.state import Status
from slogym.workloads.gaussian import GaussianLengthPredictor, history_of
from slogym.workloads.profiling import default_history

if TYPE_CHECKING:
    from slogym.core.request import Workload
    from slogym.core.simulator import Simulator


# ============================================================================ the planning problem (Eq. 2-17)
SMALL_N = 32
"""Up to this many requests, prefix sums over a plan's batches are a BLAS product with a triangular matrix."""

@dataclass
class PlanProblem:
    """Predicted times and SLO budgets of ``N`` requests, for batch sizes ``1..B_max``.

    exec_time   (B_max, N) e2e execution time ``e_j(B)`` without waiting (Eq. 17)
    first_time  (B_max, N) time to the first token ``T_prefill(B, L_j)`` (Eq. 18)
    tpot_ok     (B_max, N) mean decode time per token within the TPOT SLO (Eq. 19 vs the SLO)
    e2e_budget  (N,) e2e SLO minus the time already spent (inf without one)
    ttft_budget (N,) TTFT SLO minus the time already spent (inf without one, or once the first token is out)
    offset      (N,) latency already accrued before the plan starts (waited so far + running batch's rest)
    arrival     (N,) tie-break for the order inside a batch and the arrival-order start solution
    """

    exec_time: np.ndarray
    first_time: np.ndarray
    tpot_ok: np.ndarray
    e2e_budget: np.ndarray
    ttft_budget: np.ndarray
    offset: np.ndarray
    arrival: np.ndarray

    @property
    def n(self) -> int:
        return int(self.exec_time.shape[1])

    @property
    def max_batch(self) -> int:
        return int(self.exec_time.shape[0])

    def __post_init__(self) -> None:
        # Eq. 5-9 as one deadline per (batch size, request): j meets its SLOs iff it waits at most ``latest_start``
        # (wait + e <= e2e budget and wait + first <= TTFT budget; -inf when its TPOT cannot be met at that size)
        with np.errstate(invalid="ignore"):
            slack = np.minimum(self.e2e_budget - self.exec_time, self.ttft_budget - self.first_time)
        self.latest_start = np.where(self.tpot_ok, slack, -np.inf)
        self._offset_sum = float(self.offset.sum())
        self._layout: dict[int, tuple[np.ndarray, ...]] = {}
        self._ones = np.ones(self.n)

    def _index(self, k: int) -> tuple[np.ndarray, ...]:
        """Arrays for scoring ``k`` plans at once (cached: the search scores the same ``k`` every level): row offsets,
        per-entry time and deadline (``B_max = 1``) or request column, flat time and latest-start tables."""
        if k not in self._layout:
            n = self.n
            base = np.arange(0, k * n, n)[:, None]
            if self.max_batch == 1:   # batch size 1 throughout: each request's time and deadline are fixed
                self._layout[k] = (base, np.tile(self.exec_time[0], k),
                                   np.tile(self.latest_start[0] + self.exec_time[0], k))
            else:
                self._layout[k] = (base, np.tile(np.arange(n), k), self.exec_time.ravel(), self.latest_start.ravel())
        return self._layout[k]

    def _prefix(self, dur: np.ndarray, strict: bool) -> np.ndarray:
        """Row-wise (exclusive if ``strict``) cumulative sums of ``dur`` (K, N): a product with a triangular matrix
        for small ``N`` (BLAS beats NumPy's per-row accumulate there), ``cumsum`` otherwise."""
        if self.n > SMALL_N:
            total = dur.cumsum(axis=1)
            return total - dur if strict else total
        return dur @ self._triangle[int(strict)]

    @cached_property
    def _triangle(self) -> list[np.ndarray]:
        """Inclusive and strict upper-triangular ones (N, N) for :meth:`_prefix` (built on first use: the compiled
        search does not need them)."""
        return [np.triu(np.ones((self.n, self.n)), s) for s in (0, 1)]

    def score(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """SLOs met (K,), latency sum (K,) and batch sizes (K, N) (``None`` at ``B_max = 1``) of ``K`` plans ``g``
        (K, N): batch index per request in ``0..N-1``, at most ``B_max`` requests per batch (at ``B_max = 1``, a
        permutation). Eq. 4, 8-12 vectorized over the plans; row sums are matrix-vector products (BLAS)."""
        k, n = g.shape
        index, ones = self._index(k), self._ones
        flat = (g + index[0]).ravel()                                 # batch ids made unique across plans
        if self.max_batch == 1:  # one request per batch: completion times are a prefix sum, deadline = latest start + e
            dur = np.empty(k * n)
            dur[flat] = index[1]
            done = self._prefix(dur.reshape(k, n), strict=False)
            met = (done.ravel()[flat] <= index[2]).reshape(k, n) @ ones
            return met, done @ ones + self._offset_sum, None
        count = np.bincount(flat, minlength=k * n)
        entry = (count[flat] - 1) * n + index[1]                      # (batch size - 1, request) of each entry
        e = index[2][entry]
        dur = np.zeros(k * n)
        np.maximum.at(dur, flat, e)                                    # a batch lasts as long as its longest member
        wait = self._prefix(dur.reshape(k, n), strict=True).ravel()[flat]   # Eq. 11: the earlier batches
        met = (wait <= index[3][entry]).reshape(k, n) @ ones
        return met, (wait + e).reshape(k, n) @ ones + self._offset_sum, count.reshape(k, n)

    def objective(self, g: np.ndarray) -> np.ndarray:
        """``G = sum s_j / sum latency_j`` (Eq. 2: attainment / average latency) of each plan in ``g`` (K, N)."""
        met, lat, _ = self.score(g)
        return met / lat

    def fill(self, order: np.ndarray) -> np.ndarray:
        """Plan (K=1) running ``order`` in batches of ``B_max`` (the paper's start solutions)."""
        g = np.empty(self.n, np.int64)
        g[order] = np.arange(self.n) // self.max_batch
        return g[None]

    def priority(self, g: np.ndarray) -> np.ndarray:
        """Request positions in execution order: by batch, then by arrival."""
        return np.lexsort((self.arrival, g))


def build_problem(engine: Any, max_batch: int, input_len: np.ndarray, output_len: np.ndarray,
                  e2e_budget: np.ndarray, ttft_budget: np.ndarray, tpot: np.ndarray, offset: np.ndarray,
                  arrival: np.ndarray) -> PlanProblem:
    """Tables of :class:`PlanProblem` from the engine's perf model (vectorized evaluator: NumPy, or CuPy on a GPU).

    ``input_len`` tokens to prefill, ``output_len`` tokens to generate (the prefill emits the first).
    """
    n = input_len.shape[0]
    b = np.repeat(np.arange(1, max_batch + 1, dtype=np.int64), n)   # (batch size, request) flattened
    L = np.tile(np.asarray(input_len, np.int64), max_batch)
    steps = np.tile(np.maximum(np.asarray(output_len, np.int64), 1) - 1, max_batch)
    t = BatchTimeEvaluator(engine)(_iteration_features(b, L, steps, prefill=True))
    prefill, decode = t[: b.size].reshape(max_batch, n), _eq16(t[b.size:], steps).reshape(max_batch, n)
    steps = steps.reshape(max_batch, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot_ok = (steps == 0) | (decode / np.maximum(steps, 1) <= tpot)
    return PlanProblem(prefill + decode, prefill, tpot_ok, e2e_budget.astype(np.float64),
                       ttft_budget.astype(np.float64), offset.astype(np.float64), arrival.astype(np.float64))


_FIELD = {f: i for i, f in enumerate(BatchFeatures._fields)}


def _iteration_features(b: np.ndarray, ctx: np.ndarray, steps: np.ndarray, prefill: bool) -> BatchFeatures:
    """Features of every iteration the plan tables need, for one perf-model call (flat int64 arrays of one shape):
    if ``prefill``, the whole-prompt prefill of ``b`` copies of a ``ctx``-token prompt (Eq. 14); then the first and
    the last of ``steps`` decode iterations of ``b`` requests from context ``ctx`` on (Eq. 15), for :func:`_eq16`.
    Written into one zeroed table (no per-part build and concatenation)."""
    k = b.size
    first, last = b * ctx, b * (ctx + np.maximum(steps - 1, 0))
    f = np.zeros((len(_FIELD), (3 if prefill else 2) * k), np.int64)
    if prefill:
        f[_FIELD["prefill_tokens"], :k] = f[_FIELD["kv_tokens"], :k] = first
        f[_FIELD["prefill_seqs"], :k] = b
        f[_FIELD["prefill_attn"], :k] = f[_FIELD["prefill_sq"], :k] = first * ctx
    dec = slice(k if prefill else 0, None)
    f[_FIELD["decode_seqs"], dec] = f[_FIELD["decode_tokens"], dec] = np.tile(b, 2)
    f[_FIELD["decode_ctx"], dec] = np.concatenate([first, last])
    f[_FIELD["kv_tokens"], dec] = f[_FIELD["decode_ctx"], dec] + f[_FIELD["decode_seqs"], dec]
    return BatchFeatures(*f)


def _eq16(t: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Eq. 16 from the times ``t`` of the first and the last decode iteration (concatenated, as
    :func:`_iteration_features` orders them): the count times their mean (exact for Eq. 15's linear form)."""
    return steps * (t[: steps.size] + t[steps.size:]) / 2


def decode_time(engine: Any, b: np.ndarray, ctx: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Eq. 16: ``steps`` decode iterations of ``b`` requests from context ``ctx`` on (arrays of one shape)."""
    shape = np.shape(b)
    b, ctx, steps = (np.ravel(np.asarray(x, np.int64)) for x in (b, ctx, steps))
    return _eq16(BatchTimeEvaluator(engine)(_iteration_features(b, ctx, steps, prefill=False)), steps).reshape(shape)


# ============================================================================ searches (§4.3)
@dataclass(frozen=True)
class AnnealConfig:
    """Algorithm 1's hyper-parameters (§5.1: ``L = 500`` moves per temperature level, ``T_min = 20``, ``T0 = 100``,
    decay ``alpha = 0.95``; reconstruction in the module docstring). ``iters`` is ``L``, the population size.

    Deviation: ``max_entries`` caps the population at ``max_entries // N`` plans (at least 16) so one level scores
    at most ~``max_entries`` request slots: a replan of hundreds of queued requests in an overloaded simulation
    stays in the tens of milliseconds (``None`` lifts the cap; with the default, ``L = 500`` holds up to N = 16).
    """

    t0: float = 100.0
    t_min: float = 20.0
    alpha: float = 0.95
    iters: int = 500
    max_entries: int | None = 8192

    def __post_init__(self) -> None:
        if not (self.t0 > self.t_min > 0 and 0 < self.alpha < 1 and self.iters >= 1
                and (self.max_entries is None or self.max_entries >= 1)):
            raise ValueError(f"invalid annealing config {self}: need t0 > t_min > 0, 0 < alpha < 1, iters >= 1, "
                             "max_entries >= 1 or None")

    def population(self, n: int) -> int:
        """Plans annealed in parallel for ``n`` requests: ``L``, capped by ``max_entries``."""
        return self.iters if self.max_entries is None else min(self.iters, max(16, self.max_entries // max(n, 1)))

    def temperatures(self) -> list[float]:
        """``T0, alpha T0, ...`` down to the last level not below ``T_min`` (32 levels with the defaults)."""
        temps = [self.t0]
        while temps[-1] * self.alpha >= self.t_min:
            temps.append(temps[-1] * self.alpha)
        return temps

    @cached_property
    def temps(self) -> np.ndarray:
        """:meth:`temperatures` as the array the compiled search reads (computed once per config)."""
        return np.array(self.temperatures())


def _propose(cur: np.ndarray, size: np.ndarray | None, bmax: int, kind: np.ndarray, r: np.ndarray,
             r2: np.ndarray) -> np.ndarray:
    """One move per plan in ``cur`` (K, N) (§4.3), vectorized: the reference the compiled search's moves are tested
    against (``sa_kernels.propose``). ``kind`` 0 = squeeze request ``r`` into the previous batch (not
    from the first, and only if that batch has room), 1 = delay it into the next batch (if that has room), 2 = swap
    ``r`` and ``r2``. ``size`` (K, N) is each plan's batch sizes (``None`` at ``B_max = 1``: every batch is full,
    so only swaps move). An infeasible move leaves its plan unchanged."""
    k, n = cur.shape
    base = np.arange(0, k * n, n)
    at_r, at_r2 = base + r, base + r2   # flat positions: 1-D indexing is the cheapest
    flat = cur.ravel()
    gr = flat[at_r]
    swap = kind == 2
    step = np.zeros(k, np.int64)
    if size is not None:   # gr - 1 = -1 (first batch) is masked by gr > 0, gr + 1 = n by the clip and gr < n - 1
        room = size.ravel() < bmax
        step -= (kind == 0) & (gr > 0) & room[base + gr - 1]
        step += (kind == 1) & (gr < n - 1) & room[base + np.minimum(gr + 1, n - 1)]
    out = cur.copy()
    moved = out.reshape(-1)
    moved[at_r] = np.where(swap, flat[at_r2], gr + step)
    moved[at_r2[swap]] = gr[swap]
    return out


def anneal(p: PlanProblem, rng: np.random.Generator, cfg: AnnealConfig = AnnealConfig()) -> tuple[np.ndarray, float]:
    """Simulated-annealing plan search (§4.3, Algorithm 1) with the ``L`` moves of a temperature level made by a
    population of ``L`` plans in parallel (population annealing; deviation in the module docstring).

    Starts from the better of the two start solutions; at each level every plan makes one random move, accepted by
    the Metropolis rule (always if ``G`` does not drop, else with probability ``exp(dG / T)``, ``dG`` in percent
    of the start's ``G``); between levels the population is resampled in proportion to each plan's Boltzmann
    factor change ``exp((1/T' - 1/T) G)`` so it concentrates where a single chain at ``T'`` would spend its time.
    Returns the best plan ``g`` (N,) ever seen and its ``G``. The start solutions are scored and the levels run
    by compiled calls (:mod:`slogym.baselines.sa_kernels`); the search's random numbers come from its own generator,
    seeded by one draw of ``rng``, so ``rng`` alone fixes the result.
    """
    n = p.n
    starts = np.concatenate([p.fill(np.lexsort((np.arange(n), p.arrival))),
                             p.fill(np.argsort(p.exec_time[-1], kind="stable"))])
    met, lat = score_plans(starts, p.exec_time, p.latest_start)
    lat += p._offset_sum
    g_start = met / lat
    if met[1] == n and p.max_batch == 1:   # shortest-first meets every SLO: optimal (§4.3; see module doc)
        return starts[1], float(g_start[1])
    if n == 1:   # a single request has a single plan: nothing to search
        return starts[0], float(g_start[0])
    j = int(np.argmax(g_start))
    scale = 100.0 / max(float(g_start[j]), 1.0 / float(lat[j]))   # dG in percent of the start's G
    # the search draws its random numbers itself, from one seed drawn here: ``rng`` alone fixes the result
    best, g_best = anneal_population(starts[j], p.exec_time, p.latest_start, p._offset_sum, cfg.temps,
                                     scale, cfg.population(n), int(rng.integers(1 << 63)))
    return best, float(g_best)


def _compositions(n: int, bmax: int) -> Iterator[list[int]]:
    """Batch-size sequences summing to ``n`` with every size in ``1..bmax``."""
    if n == 0:
        yield []
        return
    for first in range(1, min(n, bmax) + 1):
        for rest in _compositions(n - first, bmax):
            yield [first, *rest]


def exhaustive(p: PlanProblem, chunk: int = 1 << 15) -> tuple[np.ndarray, float]:
    """The strawman of §4.3: every permutation x every batch-size sequence, evaluated in vectorized chunks.
    Returns the first plan of maximal ``G`` and that ``G``. Cost O(N! * #sequences): keep ``N <= 8``."""
    n = p.n
    best, g_best = p.fill(np.arange(n))[0], -1.0
    perms = itertools.permutations(range(n))
    batch_of_pos = [np.repeat(np.arange(len(c)), c) for c in _compositions(n, p.max_batch)]
    while True:
        block = np.array(list(itertools.islice(perms, chunk)), dtype=np.int64).reshape(-1, n)
        if not block.size:
            return best, g_best
        for pos_batch in batch_of_pos:
            g = np.empty_like(block)
            np.put_along_axis(g, block, np.broadcast_to(pos_batch, block.shape), axis=1)
            val = p.objective(g)
            i = int(np.argmax(val))
            if val[i] > g_best:
                best, g_best = g[i], float(val[i])


# ============================================================================ the slogym Scheduler and Router
class SAScheduler(Scheduler):
    """Plans the waiting requests by annealing (or exhaustively) and runs the plan vLLM-style (module doc).

    max_batch_size  ``B_max``: the paper's maximum batch size (running requests cap)
    search          ``"anneal"`` or ``"exhaustive"`` (falls back to annealing above ``exhaustive_max`` requests)
    predictor       ``"gaussian"`` (online per-app Gaussian, prior ``prior_len``) or ``"oracle"`` (true lengths)
    length_error    with ``"oracle"``: relative error bound ``e`` of §5.3's "actual output lengths with variations"
                    (each request's true length times ``1 + U(-e, e)``, drawn once); 0 = exact lengths
    history         (app name, output length) pairs of completed requests that warm the Gaussian before the run
                    (module doc, "Output lengths"); ``None`` (default): the profiling slice of the simulated
                    workload (:func:`~slogym.workloads.profiling.default_history`); ``()``: a cold predictor
    history_requests  size of the default profiling slice (user-level arrivals of the scenario's fresh draw)
    t0, t_min, alpha, iters, max_entries   :class:`AnnealConfig` (the paper's ``T0``, ``T_min``, decay, ``L``)
    """

    steady_through_finish = True

    def __init__(self, max_batch_size: int = 4, max_num_batched_tokens: int = 8192, search: str = "anneal",
                 predictor: str = "gaussian", prior_len: float = 128.0, seed: int = 0, t0: float = 100.0,
                 t_min: float = 20.0, alpha: float = 0.95, iters: int = 500, max_entries: int | None = 8192,
                 exhaustive_max: int = 7, history: Sequence[tuple[str, int]] | None = None,
                 history_requests: int = 1500, length_error: float = 0.0) -> None:
        if not 0 <= length_error < 1 or (length_error > 0 and predictor != "oracle"):
            raise ValueError(f"length_error={length_error}; must be in [0, 1), and > 0 only with predictor='oracle' "
                             f"(got predictor={predictor!r})")
        self.history = None if history is None else tuple((str(app), int(length)) for app, length in history)
        bad = [h for h in self.history or () if h[1] < 1]
        if bad:
            raise ValueError(f"history entries {bad[:3]} have output lengths < 1; every length must be >= 1")
        self.history_requests = positive_count("history_requests", history_requests)
        if search not in ("anneal", "exhaustive") or predictor not in ("gaussian", "oracle"):
            raise ValueError(f"search={search!r} (anneal|exhaustive), predictor={predictor!r} (gaussian|oracle)")
        self.max_batch_size = positive_count("max_batch_size", max_batch_size)
        self.max_num_batched_tokens = positive_count("max_num_batched_tokens", max_num_batched_tokens)
        self.search = search
        self.predictor = predictor
        self.prior_len = prior_len
        self.length_error = length_error
        self.seed = seed
        self.t0, self.t_min, self.alpha, self.iters, self.max_entries = t0, t_min, alpha, iters, max_entries
        self._config = AnnealConfig(t0, t_min, alpha, iters, max_entries)
        self.exhaustive_max = exhaustive_max

    def reset(self, sim: "Simulator") -> None:
        self._sim = sim
        self._rng = np.random.default_rng(self.seed)
        self.lengths = GaussianLengthPredictor(len(sim.w.app_names), self.prior_len, self.seed)
        history = self.profile(sim.w)
        if history:
            self.lengths.warm(self._app_codes(history, sim.w.app_names), [length for _, length in history])
        self._pred = np.full(len(sim.w), -1, np.int64)   # predicted total output length, drawn once per request
        self._error_rng = np.random.default_rng([self.seed, 53])   # §5.3 variations: apart from the search's stream
        self._rank: dict[int, int] = {}                  # planned priority (lower runs first) of planned requests
        self._group: dict[int, int] = {}                 # planned batch of each waiting request
        self._live: set[int] = set()                     # requests seen and not yet observed as done

    def profile(self, w: "Workload") -> tuple[tuple[str, int], ...]:
        """The (app name, output length) history the Gaussian is warmed with before serving ``w``: ``history``
        if given, else the profiling slice of ``w`` (module doc, "Output lengths"; ~3 ms CPU for 1500 requests,
        not cached)."""
        if self.history is not None:
            return self.history
        return history_of(default_history(w, self.history_requests, self.seed))

    @staticmethod
    def _app_codes(history: Sequence[tuple[str, int]], app_names: list[str]) -> list[int]:
        """The simulated workload's code of each history entry's app."""
        code = {name: i for i, name in enumerate(app_names)}
        unknown = sorted({app for app, _ in history if app not in code})
        if unknown:
            raise ValueError(f"history apps {unknown} are not in the workload's apps {app_names}")
        return [code[app] for app, _ in history]

    # ----------------------------------------------------------------------------------------------- prediction
    def predicted_output(self, reqs: np.ndarray) -> np.ndarray:
        """Predicted total output length of each request (sampled once; the truth in oracle mode, varied by up to
        ``length_error`` of it)."""
        w = self._sim.w
        new = reqs[self._pred[reqs] < 0]
        if new.size:
            if self.predictor == "gaussian":
                self._pred[new] = self.lengths.sample(w.app[new])
            elif self.length_error > 0:
                u = self._error_rng.uniform(-self.length_error, self.length_error, new.size)
                self._pred[new] = np.maximum(np.rint(w.output_tokens[new] * (1 + u)), 1)
            else:
                self._pred[new] = w.output_tokens[new]
        return self._pred[reqs]

    def _observe_finishes(self) -> None:
        if not self._live:
            return
        rs, w = self._sim.rs, self._sim.w
        live = np.fromiter(self._live, np.int64, len(self._live))
        for r in np.sort(live[rs.status[live] == Status.DONE]).tolist():
            self.lengths.observe(int(w.app[r]), int(rs.generated[r]))
            self._live.discard(r)

    def problem(self, inst: Instance, reqs: np.ndarray, now: float) -> PlanProblem:
        """The planning problem of ``reqs`` (waiting on ``inst``) at time ``now``."""
        sim = self._sim
        rs, w = sim.rs, sim.w
        remaining_out = np.maximum(self.predicted_output(reqs) - rs.generated[reqs], 1)
        run = inst.running_array()
        base = 0.0
        if run.size:   # the running batch's predicted rest delays the plan (the paper's batches run in sequence)
            steps = np.maximum(self.predicted_output(run) - rs.generated[run], 0)
            base = float(decode_time(inst.engine, np.full(run.size, run.size), rs.num_tokens[run], steps).max())
        waited = now - w.arrival[reqs]
        started = ~np.isnan(rs.first_token[reqs])
        ttft = np.where(started, np.inf, w.first_ttft[reqs])
        return build_problem(inst.engine, self.max_batch_size, rs.num_tokens[reqs], remaining_out,
                             w.ttlt[reqs] - waited - base, ttft - waited - base, w.min_tpot[reqs],
                             waited + base, w.arrival[reqs])

    def _replan(self, inst: Instance, now: float) -> None:
        reqs = np.array(inst.waiting, dtype=np.int64)
        self._live.update(inst.waiting)
        p = self.problem(inst, reqs, now)
        if self.search == "exhaustive" and p.n <= self.exhaustive_max:
            g, _ = exhaustive(p)
        else:
            g, _ = anneal(p, self._rng, self._config)
        order = p.priority(g)
        self._rank = {int(reqs[j]): i for i, j in enumerate(order)}
        self._group = {int(r): int(x) for r, x in zip(reqs, g)}

    # ----------------------------------------------------------------------------------------------- batches
    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        self._observe_finishes()
        rank = lambda r: self._rank.get(r, len(self._rank) + r)  # noqa: E731 - unplanned run last
        if inst.waiting:
            if any(r not in self._group for r in inst.waiting):
                self._replan(inst, now)
            head = min(self._group[r] for r in inst.waiting)
            cands = sorted((r for r in inst.waiting if self._group[r] == head), key=rank)
            slots = self.max_batch_size - len(inst.running)
            if slots > 0:
                reqs, toks, _, _ = fill_prefill_chunks(inst, pre.tolist() + cands, self.max_num_batched_tokens,
                                                       inst.free_blocks, slots, chunked=False)
                if reqs:
                    for r in reqs:
                        self._group.pop(r, None)
                    return batch_of(reqs, toks)
        if not dec.size:
            return unstick(inst, rank)
        keep, victims, _ = make_room_for_decodes(inst, dec, rank)
        return batch_of(keep, np.ones(keep.size, np.int64), victims, steady=not victims)


class MemoryRoundRobinRouter(Router):
    """§4.4 instance assignment: each request goes to the instance with the most remaining (virtual) memory;
    when even that one cannot hold it, every instance's remaining memory is reset (a fresh round).

    Remaining memory is counted in tokens, Eq. 20: ``n = eta * M_rem / m_tok`` with ``M_rem / m_tok`` the
    instance's free KV tokens at the start of a round (``eta = 0.9``, vLLM's memory utilization, §5.1). A request
    needs its prompt plus its predicted output (the scheduler's predictor mean, or ``prior_len`` without one).
    """

    def __init__(self, scheduler: SAScheduler | None = None, eta: float = 0.9, prior_len: float = 128.0) -> None:
        if not 0 < eta <= 1:
            raise ValueError(f"eta={eta}; must be in (0, 1]")
        self.scheduler, self.eta, self.prior_len = scheduler, eta, prior_len

    def reset(self, sim: "Simulator") -> None:
        self._rem = np.zeros(len(sim.instances))

    def _fresh_round(self, sim: "Simulator") -> None:
        self._rem = np.array([self.eta * i.free_blocks * i.block_size for i in sim.instances], dtype=np.float64)

    def route(self, req: int, sim: "Simulator", now: float) -> int:
        if self._rem.shape[0] != len(sim.instances):
            self._fresh_round(sim)
        app = int(sim.w.app[req])
        out = float(self.scheduler.lengths.mean(app)) if self.scheduler is not None else self.prior_len
        need = float(sim.w.input_tokens[req]) + out
        i = int(np.argmax(self._rem))
        if self._rem[i] < need:
            self._fresh_round(sim)
            i = int(np.argmax(self._rem))
        self._rem[i] -= need
        return i


# ============================================================================ policies
def _policy(name: str, search: str) -> Callable[..., Policy]:
    def make(engine: Any = None, **params: Any) -> Policy:
        eta = params.pop("eta", 0.9)
        defaults: dict[str, Any] = {} if engine is None else {
            "max_batch_size": int(engine.max_num_seqs), "max_num_batched_tokens": int(engine.max_num_batched_tokens)}
        sched = SAScheduler(**(defaults | {"search": search} | params))
        router = MemoryRoundRobinRouter(sched, eta, sched.prior_len)
        full = {"scheduler": "SAScheduler", "router": "MemoryRoundRobinRouter", "eta": eta} | {
            k: v for k, v in vars(sched).items() if not k.startswith("_")}
        return Policy(name=name, scheduler=sched, router=router, params=full)

    make.__doc__ = f"Build the {name!r} policy: ``f(engine, **SAScheduler params, eta=0.9)``."
    return make


POLICIES: dict[str, Callable[..., Policy]] = {
    "sa": _policy("sa", "anneal"),
    "sa-exhaustive": _policy("sa-exhaustive", "exhaustive"),
}

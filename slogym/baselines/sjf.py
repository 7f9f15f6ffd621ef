"""Size-based priority schedulers on the shared token-budget loop: SJF on predicted output length, and LAS.

:class:`PriorityScheduler` is the loop: every resident request (running or waiting) gets a priority
``(level, key)``. Decodes go first, as in Sarathi-Serve and vLLM's priority scheduler: running decodes take one
token each in priority order, then prefill chunks (running, then waiting requests, in priority order) fill the
token budget within the sequence limit and KV memory. Priority resolves contention:

* running decodes that cannot all grow preempt (by recompute) the lowest-priority running requests first
  (vLLM's rule with the priority order instead of arrival order);
* with ``preemptive``, a fresh request (nothing computed yet) that lacks KV for its next chunk or a place in the
  batch evicts running requests of a strictly *worse level*, worst first, each at most once, when that makes
  enough room. Comparing levels rather than exact keys, and these two guards, keep recompute-based
  preemption from thrashing on priorities that move with attained service.

Concrete orders (lower sorts first):

* :class:`SJFScheduler` -- shortest job first: level = predicted total output length, key = arrival (FCFS among
  equal predictions); non-preemptive by default. Predictions come from an
  :class:`~slogym.workloads.predictors.EmpiricalLengthPredictor` (per-app median by default) fitted on a history
  workload, or on the first ``history_fraction`` of the run's own workload when none is given; ``oracle=True``
  uses the true output length (Tempo's "precise information").
* :class:`LASScheduler` -- least attained service per request: key = tokens computed for the request so far
  (``rs.computed_total``: prefill + decode tokens, a recompute after preemption included), level = its
  geometric service class (:func:`service_level`).

Batches are marked steady only when nothing waits, nothing is prefilling and every running request takes one
decode token: the batch is then every running request whatever the order, and only a KV shortage (an event the
simulator sees) could change it, so a priority that moves as service accrues does not break the promise.
Steady batches list requests in ``inst.running`` order so that stepping and fast-forward launch identical batches.
The best-effort flag is ignored (these orders know no tiers).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable

import numpy as np

from slogym.baselines.common import (BatchBuilder, TokenBudgetScheduler, batch_of, decode_batch, make_room_for_decodes,
                                     split_running, unstick)
from slogym.baselines.routers import RoundRobinRouter
from slogym.core.batch import Batch
from slogym.core.instance import Instance
from slogym.core.policy import Policy, Router, Scheduler
from slogym.core.request import Workload
from slogym.workloads.predictors import EmpiricalLengthPredictor


def service_level(service: np.ndarray, quantum: int, multiplier: float, n_levels: int) -> np.ndarray:
    """Geometric service class: 0 below ``quantum`` tokens, then one class per factor ``multiplier``,
    the last class unbounded (``n_levels`` classes in all)."""
    bounds = quantum * multiplier ** np.arange(n_levels - 1, dtype=np.float64)
    return np.searchsorted(bounds, service, side="right").astype(np.int64)


class PriorityScheduler(TokenBudgetScheduler):
    """Token-budget loop ordered by :meth:`priorities`; see the module docstring."""

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256, preemptive: bool = True) -> None:
        super().__init__(token_budget, max_num_seqs)
        self.preemptive = preemptive

    @abstractmethod
    def priorities(self, inst: Instance, reqs: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """``(level, key)`` of each request; lower sorts first, ties by request index."""

    def observe(self, inst: Instance, scheduled: set[int], now: float) -> None:
        """Hook called with the requests of the batch just formed (for schedulers that track time)."""

    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        running = inst.running_array()
        resident = np.concatenate([running, np.asarray(inst.waiting, dtype=np.int64)])
        level, key = self.priorities(inst, resident, now)
        order = np.lexsort((resident, key, level))
        ranked = resident[order].tolist()
        rank = dict(zip(ranked, range(len(ranked))))
        level_of = dict(zip(resident.tolist(), level.tolist()))
        victims: list[int] = []
        free = inst.free_blocks
        if dec.size:
            dec, victims, free = make_room_for_decodes(inst, dec, rank.__getitem__)
        is_dec = set(dec.tolist())
        decodes = [r for r in ranked if r in is_dec]
        if self.preemptive:
            rest = [r for r in ranked if r not in is_dec and r not in victims]
            victims += self._evictions(inst, decodes, rest, free, level_of, rank, set(victims))
        gone = set(victims)
        b = BatchBuilder(inst, self.token_budget, inst.free_blocks + int(inst.sim.rs.kv_blocks[victims].sum()),
                         self.max_num_seqs)
        # a candidate that does not fit waits; a later, smaller one may still run
        b.take_all(np.array([r for r in decodes + [r for r in ranked if r not in is_dec] if r not in gone],
                            dtype=np.int64))
        if not b.reqs and not victims:
            return unstick(inst, rank.__getitem__)
        self.observe(inst, set(b.reqs), now)
        if not victims and not inst.waiting and not pre.size and len(b.reqs) == running.size:
            return decode_batch(running, steady=True)
        return batch_of(b.reqs, b.toks, victims)

    def _evictions(self, inst: Instance, dec: list[int], rest: list[int], free: int, level_of: dict[int, Any],
                   rank: dict[int, int], gone: set[int]) -> list[int]:
        """Running requests to preempt so that prefills of a better level (running or waiting, in priority order)
        get KV for their next chunk and a place in the batch (vLLM's priority preemption, per iteration).

        ``dec`` are the surviving decodes, whose next-token blocks are already reserved out of ``free``. Victims are
        running requests of a strictly worse level that were never preempted, worst first, taken only for a fresh
        request (nothing computed yet) and only if together they make enough room; the first fresh request that
        cannot be made room for ends the search. ``gone`` are requests already preempted; returns the new victims."""
        rs = inst.sim.rs
        budget = self.token_budget - len(dec)
        slots = self.max_num_seqs - len(dec)
        reserved = dict(zip(dec, inst.blocks_needed(dec, 1).tolist())) if dec else {}
        new: list[int] = []
        for r in rest:
            if budget <= 0:
                break
            chunk = min(int(inst.remaining([r])[0]), budget)
            need = int(inst.blocks_needed([r], chunk)[0])
            room, seats, pool = free, slots, []
            if (need > room or seats < 1) and not rs.computed_total[r]:  # only a fresh request evicts
                worse = (v for v in inst.running if v not in gone and level_of[v] > level_of[r] and not rs.n_preempt[v])
                for v in sorted(worse, key=rank.__getitem__, reverse=True):
                    if need <= room and seats >= 1:
                        break
                    pool.append(v)
                    room += int(rs.kv_blocks[v]) + reserved.get(v, 0)
                    seats += v in reserved
            if need > room or seats < 1:
                if rs.computed_total[r]:
                    continue  # it waits; the builder may still fit a later one
                break
            new += pool
            gone.update(pool)
            free, slots, budget = room - need, seats - 1, budget - chunk
        return new


class SJFScheduler(PriorityScheduler):
    """Shortest (predicted) job first."""

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256, preemptive: bool = False,
                 oracle: bool = False, history: Workload | None = None, history_fraction: float = 0.2,
                 quantile: float = 0.5) -> None:
        super().__init__(token_budget, max_num_seqs, preemptive)
        if not 0.0 < history_fraction <= 1.0:
            raise ValueError(f"history_fraction={history_fraction}; must be in (0, 1]")
        self.oracle, self.history, self.history_fraction, self.quantile = oracle, history, history_fraction, quantile

    def reset(self, sim: Any) -> None:
        w = sim.w
        if self.oracle:
            self._pred = w.output_tokens.astype(np.float64)
            return
        hist = self.history if self.history is not None else w.subset(
            np.arange(max(1, int(len(w) * self.history_fraction))))
        table = EmpiricalLengthPredictor(hist, (self.quantile,)).table[:, 0]
        overall = float(np.quantile(hist.output_tokens, self.quantile))
        code = {name: i for i, name in enumerate(hist.app_names)}
        per_app = np.array([table[code[a]] if a in code else overall for a in w.app_names])
        self._pred = per_app[w.app]

    def priorities(self, inst: Instance, reqs: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        return self._pred[reqs], inst.sim.w.arrival[reqs]


class LASScheduler(PriorityScheduler):
    """Least attained service (tokens computed) per request."""

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256, preemptive: bool = True,
                 quantum: int = 1024, multiplier: float = 2.0, n_levels: int = 10) -> None:
        super().__init__(token_budget, max_num_seqs, preemptive)
        if quantum < 1 or multiplier <= 1.0 or n_levels < 1:
            raise ValueError(f"quantum={quantum} >= 1, multiplier={multiplier} > 1, n_levels={n_levels} >= 1 needed")
        self.quantum, self.multiplier, self.n_levels = quantum, multiplier, n_levels

    def priorities(self, inst: Instance, reqs: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        service = inst.sim.rs.computed_total[reqs]
        return service_level(service, self.quantum, self.multiplier, self.n_levels), service


def policy_factory(name: str, scheduler: Callable[..., Scheduler], **fixed: Any) -> Callable[..., Policy]:
    """A ``(engine=None, router=None, **params) -> Policy`` builder; ``max_num_seqs`` defaults to the engine's."""

    def build(engine: Any = None, router: Router | None = None, **params: Any) -> Policy:
        kw = ({} if engine is None else {"max_num_seqs": int(engine.max_num_seqs)}) | fixed | params
        sched = scheduler(**kw)
        return Policy(name=name, scheduler=sched, router=router or RoundRobinRouter(),
                      params={"scheduler": type(sched).__name__} | kw)

    return build


POLICIES: dict[str, Callable[..., Policy]] = {
    "sjf": policy_factory("sjf", SJFScheduler),
    "sjf-oracle": policy_factory("sjf-oracle", SJFScheduler, oracle=True),
    "las": policy_factory("las", LASScheduler),
}

"""Building blocks shared by the iteration-level schedulers (one token-budget loop, one preemption rule)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from slogym.core import kernels
from slogym.core.batch import Batch
from slogym.core.instance import Instance, Role
from slogym.core.policy import Scheduler
from slogym.core.state import I_KV, I_NC, I_NT

if TYPE_CHECKING:
    from slogym.core.simulator import Simulator

_EMPTY = np.zeros(0, dtype=np.int64)


def split_running(inst: Instance) -> tuple[np.ndarray, np.ndarray]:
    """Running requests split into (decode-ready, still prefilling), each in running order."""
    run = inst.running_array()
    if not run.size:
        return _EMPTY, _EMPTY
    return kernels.decode_split(inst.sim.rs.I, run)


def make_room_for_decodes(inst: Instance, dec: np.ndarray, victim_key: Callable[[int], Any] | np.ndarray,
                          ) -> tuple[np.ndarray, list[int], int]:
    """Preempt (recompute) running requests, largest ``victim_key`` first, until every remaining decode
    in ``dec`` can grow by one token (vLLM's rule). Returns the surviving decodes, the victims, and the KV
    blocks still free once the survivors' growth is reserved.

    ``victim_key`` is a function of a request, or an array of the keys of ``inst.running`` in its order (the
    same victims, without a Python call per running request: the path of schedulers that preempt often)."""
    rs = inst.sim.rs
    dec = np.asarray(dec, dtype=np.int64)
    total = kernels.decode_kv_growth(rs.I, dec, inst.block_size)
    if total <= inst.free_blocks:
        return dec, [], inst.free_blocks - total
    need = inst.blocks_needed(dec, 1)
    if isinstance(victim_key, np.ndarray):
        return _make_room_by_keys(inst, dec, need, total, victim_key)
    free = inst.free_blocks
    victims: list[int] = []
    alive = dict(zip(dec.tolist(), need.tolist()))
    prefilling = [r for r in inst.running if r not in alive]
    # prefilling requests hold KV too; they are candidates as well
    pool = sorted(list(alive) + prefilling, key=victim_key)
    while total > free and pool:
        v = pool.pop()
        victims.append(v)
        free += int(rs.kv_blocks[v])
        total -= alive.pop(v, 0)
    keep = np.array([r for r in dec.tolist() if r in alive], dtype=np.int64)
    return keep, victims, free - total


def _make_room_by_keys(inst: Instance, dec: np.ndarray, need: np.ndarray, total: int, run_keys: np.ndarray,
                       ) -> tuple[np.ndarray, list[int], int]:
    """:func:`make_room_for_decodes`' loop in array form: the pool is ``dec`` then the prefilling rest of
    ``inst.running``, stably sorted by key (Python's ``sorted``), victims popped from its end while KV is short."""
    kv = inst.sim.rs.kv_blocks
    run = inst.running_array()
    is_dec = np.isin(run, dec)
    at = np.argsort(run, kind="stable")
    pos = at[np.searchsorted(run, dec, sorter=at)]  # dec's positions in running order
    pool = np.concatenate([dec, run[~is_dec]])
    keys = np.concatenate([run_keys[pos], run_keys[~is_dec]])
    gain = kv[pool] + np.concatenate([need, np.zeros(pool.size - dec.size, np.int64)])  # freed + growth dropped
    popped = np.argsort(keys, kind="stable")[::-1]
    cum = np.cumsum(gain[popped])
    k = min(int(np.searchsorted(cum, total - inst.free_blocks)) + 1, pool.size)
    victims = pool[popped[:k]]
    return dec[~np.isin(dec, victims)], victims.tolist(), inst.free_blocks - total + int(cum[k - 1])


def fill_prefill_chunks(inst: Instance, candidates: Iterable[int], budget: int, free_blocks: int,
                        max_seqs: int, chunked: bool = True) -> tuple[list[int], list[int], int, bool]:
    """Give prefill chunks to ``candidates`` in order within a token ``budget``, KV and sequence limits.

    With ``chunked`` a request gets ``min(remaining, budget left, KV that fits)`` tokens (Sarathi-Serve);
    without it, only whole prefills fit (vLLM's default), except that the first may exceed the budget
    so that a prompt longer than the budget is not starved. The first candidate that does not fit ends the
    batch. Returns (requests, chunk sizes, blocks used, repeatable): ``repeatable`` is True when exactly one
    chunk was scheduled and it was cut by the budget alone (not by its remainder or by KV), so the same batch
    would be formed again next iteration.
    """
    req, tok, used, repeatable = _fill(inst, _EMPTY, candidates, budget, free_blocks, max_seqs, chunked)
    return req.tolist(), tok.tolist(), used, repeatable


def decodes_and_chunks(inst: Instance, dec: np.ndarray, candidates: Iterable[int], budget: int, free_blocks: int,
                       max_seqs: int, whole_prompt_floor: int = -1) -> tuple[np.ndarray, np.ndarray, bool]:
    """Sarathi-Serve's stall-free batch: a one-token step for each of ``dec``, then prefill chunks for
    ``candidates`` by :func:`fill_prefill_chunks`' rule (``budget``, ``max_seqs`` and ``free_blocks`` are what
    the decodes left); with ``whole_prompt_floor >= 0`` a request starts only when its whole prompt fits above
    that many blocks (:func:`slogym.core.kernels.take_in_order`). Returns (requests, tokens, repeatable)."""
    req, tok, _, repeatable = _fill(inst, dec, candidates, budget, free_blocks, max_seqs, True, whole_prompt_floor)
    return req, tok, repeatable


def _fill(inst: Instance, head: np.ndarray, candidates: Iterable[int], budget: int, free: int, max_seqs: int,
          chunked: bool, whole_prompt_floor: int = -1) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """``head`` (one token each), then chunks for ``candidates`` as :func:`fill_prefill_chunks` says."""
    # every chunk takes >= 1 token of the budget, so at most budget + 1 candidates are looked at; they are
    # drawn a few at a time because the budget usually runs out after one or two (a long queue is not copied)
    h, left = head.size, max(min(budget, max_seqs), 0) + 1
    req, tok = np.empty(h + left, np.int64), np.empty(h + left, np.int64)
    req[:h] = head
    tok[:h] = 1
    it, I, bs = iter(candidates), inst.sim.rs.I, inst.block_size
    n = used = 0
    repeatable, k = False, 8
    while left > 0 and budget > 0 and n < max_seqs:
        cands = np.fromiter(islice(it, min(k, left)), np.int64)
        got, u, rep, budget = kernels.take_in_order(I, cands, budget, free - used, max_seqs - n, bs, chunked,
                                                    False, n, req, tok, h + n, whole_prompt_floor)
        repeatable = rep if got else repeatable  # True only when the batch has exactly one chunk
        n += got
        used += u
        if got < cands.size or cands.size < min(k, left):  # the loop stopped, or no candidates left
            break
        left -= cands.size
        k *= 8
    return req[:h + n], tok[:h + n], used, repeatable


class TokenBudgetScheduler(Scheduler):
    """Base of schedulers that fill a per-iteration token budget (Sarathi-Serve, EDF, ...)."""

    steady_through_finish = True

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256) -> None:
        self.token_budget = positive_count("token_budget", token_budget)
        self.max_num_seqs = positive_count("max_num_seqs", max_num_seqs)


def positive_count(name: str, value: object) -> int:
    """``value`` as an ``int`` when it is a finite, integer-valued number >= 1 (``512.0`` is ``512``); else a
    ``ValueError`` naming ``name`` and the value (NaN, inf, 2.5, 0, booleans and strings are refused)."""
    number = value.item() if isinstance(value, np.generic) else value
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(f"{name}={value!r}; must be a finite integer >= 1")
    return int(number)


class BatchBuilder:
    """A batch under construction: a token ``budget`` left, ``free`` KV blocks left, at most ``max_seqs``.

    ``take(r)`` adds request ``r`` if it fits -- a decode step takes one token and its KV growth, a prefill a
    chunk of ``min(remaining, budget left, KV that fits)`` tokens -- and tells whether it did.
    """

    def __init__(self, inst: Instance, budget: int, free: int, max_seqs: int = 1 << 30) -> None:
        self.inst, self.budget, self.free, self.max_seqs = inst, budget, free, max_seqs
        self.reqs: list[int] = []
        self.toks: list[int] = []

    @property
    def full(self) -> bool:
        return self.budget <= 0 or len(self.reqs) >= self.max_seqs

    def is_decode(self, r: int) -> bool:
        row = self.inst.sim.rs.I[r]
        return int(row[I_NT]) - int(row[I_NC]) == 1

    def decode_need(self, r: int) -> int:
        """Extra KV blocks a decode step of ``r`` needs."""
        row = self.inst.sim.rs.I[r]
        return max(-(-(int(row[I_NC]) + 1) // self.inst.block_size) - int(row[I_KV]), 0)

    def take(self, r: int) -> bool:
        return self.take_all(np.array([r], np.int64)) == 1

    def take_all(self, cands: np.ndarray) -> int:
        """Offer ``cands`` in order, as ``take`` each until the batch is full; returns how many were taken."""
        reqs, toks = np.empty(cands.size, np.int64), np.empty(cands.size, np.int64)
        n, used, _, self.budget = kernels.take_in_order(self.inst.sim.rs.I, cands, self.budget, self.free,
                                                        self.max_seqs - len(self.reqs), self.inst.block_size, True,
                                                        True, 0, reqs, toks, 0)
        self.reqs += reqs[:n].tolist()
        self.toks += toks[:n].tolist()
        self.free -= used
        return n


def unstick(inst: Instance, victim_key: Callable[[int], float]) -> Batch | None:
    """Nothing fits but requests hold KV. With several requests running, preempt the one with the largest key
    so that the rest can progress (vLLM preempts the lowest-priority running request when an allocation fails).
    With at most one running, waiting requests back from tool calls may hold the KV it (or the queue's head)
    needs: the latest arrived of them drops its KV first (recomputed later; vLLM's prefix cache would evict
    those blocks before preempting anyone). Preempting a lone running request instead would only restart it,
    forever, under a scheduler that puts it back ahead of those holders (deadline orders do). Else the lone
    running request is preempted, or the instance idles."""
    if inst.n_waiting_kv and len(inst.running) <= 1:
        rs, arrival = inst.sim.rs, inst.sim.w.arrival
        holders = [r for r in inst.waiting if rs.kv_blocks[r] > 0]
        return batch_of([], [], [max(holders, key=lambda r: arrival[r])])
    if inst.running:
        return batch_of([], [], [max(inst.running, key=victim_key)])
    return None


def batch_of(reqs: np.ndarray | list[int], tokens: np.ndarray | list[int], preempt: list[int] | tuple = (),
             steady: bool = False) -> Batch:
    return Batch(req=np.asarray(reqs, dtype=np.int64), tokens=np.asarray(tokens, dtype=np.int64),
                 preempt=tuple(preempt), steady=steady)


def decode_batch(dec: np.ndarray, preempt: list[int] | tuple = (), steady: bool = False) -> Batch:
    """A one-token (decode) step for each request of ``dec``."""
    tok = np.empty(dec.size, np.int64)
    tok.fill(1)
    return Batch(req=dec, tokens=tok, preempt=tuple(preempt), steady=steady)


def kv_transfer_known(sim: "Simulator") -> bool:
    """Whether the cluster's KV-transfer model knows the engine's KV bytes per token (a P/D split needs it;
    policies that split a colocated cluster themselves stay colocated otherwise, as documented)."""
    try:
        sim.transfer.bytes_for(sim.engines[0])
    except ValueError:
        return False
    return True


def split_colocated(sim: "Simulator", split: Callable[[int], tuple[int, int]], name: str) -> bool:
    """Make a colocated cluster disaggregated at reset, for a P/D policy run without ``Simulator(pd=...)``: the
    first ``P`` of ``(P, D) = split(n)`` instances become PREFILL, the rest DECODE (``sim.switch_role``; the
    instances are empty, so at once). A cluster that is not all colocated (built with ``pd=``, or already split)
    keeps its roles, and one instance, or an engine whose KV bytes per token are unknown (no transfer model,
    :func:`kv_transfer_known`), stays colocated: the policy then runs colocated. Shared by DistServe, the PD
    variants of PolyServe and HyperFlexis' P/D variants. Returns whether it split."""
    n = len(sim.instances)
    if any(i.role != Role.COLOCATED for i in sim.instances) or n < 2 or not kv_transfer_known(sim):
        return False
    p, d = split(n)
    if p + d != n or p < 1 or d < 1:
        raise ValueError(f"{name} pd=({p}, {d}) does not split the cluster's {n} instances")
    for i in range(n):
        sim.switch_role(i, Role.PREFILL if i < p else Role.DECODE)
    return True

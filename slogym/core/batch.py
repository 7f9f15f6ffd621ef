"""What a scheduler returns (:class:`Batch`) and what a perf model sees of it (:class:`BatchFeatures`).

A perf model never sees requests, only integer features of a batch. Features are exact integers so that the
step-by-step path and the fast-forward path (which builds the features of many future decode iterations at
once) feed bit-identical inputs to the same vectorized ``batch_time`` and get bit-identical times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


def _column(name: str, a: np.ndarray | None, m: int) -> np.ndarray:
    """``a`` as an owned int64 column of ``m`` batches: copied, a length-1 value repeated, zeros when absent."""
    if a is None:
        return np.zeros(m, np.int64)
    if a.ndim == 1 and a.shape[0] == m:
        return a.copy()
    if a.ndim == 1 and a.shape[0] == 1:
        return np.full(m, a[0], np.int64)
    raise ValueError(f"BatchFeatures field {name} has shape {a.shape}; expected ({m},) or a scalar")


class BatchFeatures(NamedTuple):
    """Integer features of ``m`` batches (each field an ``int64`` array of shape ``(m,)``).

    prefill_tokens  new prompt tokens processed (sum of prefill chunk sizes, recompute included)
    prefill_seqs    requests doing a prefill chunk
    prefill_attn    attention work of the prefill chunks: sum of chunk * (past + chunk), in token pairs
    prefill_sq      sum of chunk**2 (the quadratic prefill term of DistServe / HyperFlexis Eq. 1)
    decode_seqs     requests doing a decode step
    decode_tokens   tokens verified by decoding requests (= decode_seqs without speculation, 1 + sl each with)
    decode_ctx      KV tokens read by the decoding requests (sum of their context lengths)
    kv_tokens       KV tokens resident for all requests of the batch after the iteration
    spec_steps      draft-model forward passes this iteration (largest speculation length, 0 if none)
    """

    prefill_tokens: np.ndarray
    prefill_seqs: np.ndarray
    prefill_attn: np.ndarray
    prefill_sq: np.ndarray
    decode_seqs: np.ndarray
    decode_tokens: np.ndarray
    decode_ctx: np.ndarray
    kv_tokens: np.ndarray
    spec_steps: np.ndarray

    @property
    def total_tokens(self) -> np.ndarray:
        return self.prefill_tokens + self.decode_tokens

    @property
    def batch_size(self) -> np.ndarray:
        return self.prefill_seqs + self.decode_seqs

    def __len__(self) -> int:  # type: ignore[override]
        """Number of batches (1 for the Python-int features of a single batch)."""
        return int(np.shape(self.prefill_tokens)[0]) if np.ndim(self.prefill_tokens) else 1

    @classmethod
    def build(cls, **fields: np.ndarray | int) -> "BatchFeatures":
        """Features from keyword arrays/ints; missing fields are zero, scalars broadcast."""
        arrays = {k: np.atleast_1d(np.asarray(v, dtype=np.int64)) for k, v in fields.items()}
        unknown = set(arrays) - set(cls._fields)
        if unknown:
            raise TypeError(f"unknown BatchFeatures fields {sorted(unknown)}; known: {cls._fields}")
        m = max((a.shape[0] for a in arrays.values()), default=1)
        return cls(*(_column(f, arrays.get(f), m) for f in cls._fields))

    @classmethod
    def random(cls, m: int, seed: int = 0) -> "BatchFeatures":
        """``m`` plausible random batches (mixed prefill chunks and decodes), for tests and benchmarks."""
        rng = np.random.default_rng(seed)
        pre = rng.integers(0, 4096, m) * rng.integers(0, 2, m)
        return cls.build(prefill_tokens=pre, prefill_seqs=(pre > 0).astype(np.int64), prefill_attn=pre * pre,
                         prefill_sq=pre * pre, decode_seqs=rng.integers(0, 128, m),
                         decode_tokens=rng.integers(0, 160, m), decode_ctx=rng.integers(0, 400000, m),
                         kv_tokens=rng.integers(0, 400000, m), spec_steps=rng.integers(0, 4, m))

    @classmethod
    def concat(cls, parts: list["BatchFeatures"]) -> "BatchFeatures":
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls._fields))


@dataclass
class Batch:
    """One engine iteration chosen by a scheduler.

    req       request indices that run this iteration (into the workload)
    tokens    tokens scheduled per request: a prefill chunk size, or 1 for a decode step
    spec      speculation length per request (decode only; 0 = no speculation). A decode with spec ``sl``
              verifies ``1 + sl`` tokens and keeps the accepted prefix plus one (SLOs-Serve App. D).
    preempt   running requests to preempt by recompute *before* the iteration (KV dropped, tokens kept)
    drop      waiting/running requests to give up on (outcome ``dropped``), e.g. after a failed admission
    demote    requests moved to the best-effort tier (they keep running when capacity allows)
    steady    the scheduler promises to return this same batch (same requests, same tokens each) at every
              iteration until the next event the simulator can see: an arrival, a timer, a stage change (a
              prefill completing, a decode stage ending), a KV shortage -- and a finish, unless the scheduler
              declares ``steady_through_finish``. This lets the simulator fast-forward with identical results.
              A prefill chunk in a steady batch must be limited by the token budget, not by KV or its remainder.
    """

    req: np.ndarray = field(default_factory=lambda: _EMPTY)
    tokens: np.ndarray = field(default_factory=lambda: _EMPTY)
    spec: np.ndarray | None = None
    preempt: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()
    demote: tuple[int, ...] = ()
    steady: bool = False

    def __len__(self) -> int:
        return int(self.req.shape[0])

    @property
    def empty(self) -> bool:
        return self.req.shape[0] == 0

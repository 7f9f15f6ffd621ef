"""Per-request mutable simulation state, one NumPy array per field (struct of arrays).

Token accounting follows vLLM v1: ``num_tokens`` is the length of the sequence known so far (prompt plus
generated tokens of the current residency), ``num_computed`` the tokens whose KV is stored. A scheduled chunk
advances ``num_computed``; when it catches up with ``num_tokens`` in a generating position the engine samples
one token. A decode step is therefore a chunk of one token, and a preempted request (``num_computed = 0``)
recomputes prompt + generated tokens as a prefill before sampling its next token, as vLLM does.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from slogym.core.request import StageKind, Workload

NO_TPOT = 1e30  # "no TPOT SLO" kept finite so that 0 * tpot never makes a NaN deadline in the hot path


class Status(IntEnum):
    PENDING = 0   # not yet arrived
    HELD = 1      # arrived, waiting for its collective group's previous stage
    QUEUED = 2    # deferred by the router in the cluster's global queue
    WAITING = 3   # on an instance, no KV
    RUNNING = 4   # on an instance, KV resident
    EXTERNAL = 5  # in a tool call
    DONE = 6


class Outcome(IntEnum):
    NONE = 0
    FINISHED = 1
    REJECTED = 2
    BEST_EFFORT = 3
    DROPPED = 4
    FAILED = 5


OUTCOME_NAMES = {o: o.name.lower() for o in Outcome}


class RequestState:
    """Dynamic state of every request of a workload (arrays of length ``n``)."""

    def __init__(self, w: Workload) -> None:
        n = len(w)
        i64, f64 = np.int64, np.float64
        self.status = np.zeros(n, np.int8)
        self.outcome = np.zeros(n, np.int8)
        self.instance = np.full(n, -1, np.int32)       # instance it was last placed on
        self.slot = np.full(n, -1, np.int32)           # instance it is waiting/running on now, else -1
        self.scratch = np.zeros(n, np.int64)           # work array for batch validation
        self.be = w.best_effort.copy()                 # served in the best-effort tier
        self.stage = w.stage_ptr[:-1].copy()           # absolute index into the stage arrays
        self.stage_len = w.stage_tokens[self.stage].copy()
        self.num_tokens = np.zeros(n, i64)
        self.num_computed = np.zeros(n, i64)
        self.kv_blocks = np.zeros(n, i64)
        self.gen_in_stage = np.zeros(n, i64)
        self.generated = np.zeros(n, i64)
        self.computed_total = np.zeros(n, i64)        # every token ever scheduled (recompute included)
        self.recomputed = np.zeros(n, i64)            # KV tokens thrown away by preemption
        self.n_preempt = np.zeros(n, np.int32)
        self.ready = w.arrival.copy()                  # time the current segment became ready (t_ref)
        self.tpot = np.full(n, NO_TPOT)                # TPOT of the current decode stage
        self.dl_base = np.full(n, np.inf)              # deadline of token k=0 of the current decode stage
        self.stage_t0 = np.full(n, np.nan)             # start of the current decode stage's gap window
        self.last_token = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.final_deadline = np.full(n, np.inf)       # deadline of the last output token emitted
        self.finish = np.full(n, np.nan)
        self.first_scheduled = np.full(n, np.nan)
        self.max_gap = np.zeros(n, f64)                # max time between tokens (all decode stages)
        self.tpot_slack = np.full(n, np.inf)           # min over gaps of (tpot - gap)
        self.dslo_slack = np.full(n, np.inf)           # min over tokens of (deadline - t)
        self.ttft_slack = np.full(n, np.inf)           # min over prefill stages of (ready + ttft - t)
        self.mean_slack = np.full(n, np.inf)           # min over decode stages of (tpot - mean gap)
        self.sg_in = np.zeros(n, f64)                  # Tempo service gain of input tokens (Eq. 3, first term)
        self.sg_out = np.zeros(n, f64)                 # sum over output tokens of f(SLO_TBT, TBT)

    def next_deadline(self, w: Workload, idx: np.ndarray) -> np.ndarray:
        """Deadline of each request's next output: its next token's deadline in a decode stage, the TTFT
        deadline in a prefill stage (``inf`` without an SLO)."""
        stage = self.stage[idx]
        in_decode = w.stage_kind[stage] == StageKind.DECODE
        token_dl = self.dl_base[idx] + self.gen_in_stage[idx] * self.tpot[idx]
        return np.where(in_decode, token_dl, self.ready[idx] + w.stage_ttft[stage])

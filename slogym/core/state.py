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
    TRANSFER = 7  # prefill done on a PREFILL instance; KV on its way to (or waiting for) a decode instance


class Outcome(IntEnum):
    NONE = 0
    FINISHED = 1
    REJECTED = 2
    BEST_EFFORT = 3
    DROPPED = 4
    FAILED = 5


OUTCOME_NAMES = {o: o.name.lower() for o in Outcome}

F_COLS: tuple[tuple[str, float], ...] = (
    ("tpot", NO_TPOT),          # TPOT of the current decode stage
    ("dl_base", np.inf),        # deadline of token k=0 of the current decode stage
    ("last_token", np.nan),     # time of the last output token
    ("dslo_slack", np.inf),     # min over tokens of (deadline - t)
    ("max_gap", 0.0),           # max time between tokens (all decode stages)
    ("tpot_slack", np.inf),     # min over gaps of (tpot - gap)
    ("sg_out", 0.0),            # sum over output tokens of f(D_k - t_ref, t_k - t_ref) (Tempo Eq. 3)
    ("final_deadline", np.inf),  # deadline of the last output token emitted
    ("line_ref", np.nan),       # t_ref of the current decode stage's deadline line (Tempo Eq. 3)
)
I_COLS: tuple[str, ...] = (
    "num_tokens", "num_computed", "gen_in_stage", "generated", "kv_blocks", "computed_total", "stage_len", "slot",
)
F_TPOT, F_DL, F_LAST, F_DSLO, F_GAP, F_TSLACK, F_SG, F_FINAL, F_REF = range(len(F_COLS))
I_NT, I_NC, I_GEN_STAGE, I_GEN, I_KV, I_COMP, I_SLEN, I_SLOT = range(len(I_COLS))


class RequestState:
    """Dynamic state of every request of a workload (arrays of length ``n``).

    The fields the per-iteration paths touch together live as columns of two 2-D tables, ``F`` (float64) and
    ``I`` (int64), so a batch is gathered and scattered with one call per table; each column is also
    available under its name as a 1-D view (``rs.tpot is rs.F[:, F_TPOT]``).
    """

    def __init__(self, w: Workload) -> None:
        n = len(w)
        i64, f64 = np.int64, np.float64
        self.F = np.empty((n, len(F_COLS)), f64)
        self.I = np.zeros((n, len(I_COLS)), i64)
        for j, (name, init) in enumerate(F_COLS):
            self.F[:, j] = init
            setattr(self, name, self.F[:, j])
        for j, name in enumerate(I_COLS):
            setattr(self, name, self.I[:, j])
        self.slot[:] = -1                              # instance it is waiting/running on now, else -1
        self.stage_len[:] = w.stage_tokens[w.stage_ptr[:-1]]
        self.status = np.zeros(n, np.int8)
        self.outcome = np.zeros(n, np.int8)
        self.instance = np.full(n, -1, np.int32)       # instance it was last placed on
        self.scratch = np.zeros(n, np.int64)           # work array for batch validation
        self.be = w.best_effort.copy()                 # served in the best-effort tier
        self.stage = w.stage_ptr[:-1].copy()           # absolute index into the stage arrays
        self.recomputed = np.zeros(n, i64)             # KV tokens thrown away by preemption
        self.n_preempt = np.zeros(n, np.int32)
        self.ready = w.arrival.copy()                  # time the current segment became ready (t_ref)
        self.stage_t0 = np.full(n, np.nan)             # start of the current decode stage's gap window
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.first_scheduled = np.full(n, np.nan)
        self.ttft_slack = np.full(n, np.inf)           # min over prefill stages of (ready + ttft - t)
        self.mean_slack = np.full(n, np.inf)           # min over decode stages of (tpot - mean gap)
        self.sg_in = np.zeros(n, f64)                  # Tempo service gain of input tokens (Eq. 3, first term)

    def next_deadline(self, w: Workload, idx: np.ndarray) -> np.ndarray:
        """Deadline of each request's next output: its next token's deadline in a decode stage, the TTFT
        deadline in a prefill stage (``inf`` without an SLO)."""
        from slogym.core import kernels  # kernels import this module

        return kernels.next_deadline(self.F, self.I, self.stage, self.ready, w.stage_kind, w.stage_ttft,
                                     np.asarray(idx, dtype=np.int64), int(StageKind.DECODE))

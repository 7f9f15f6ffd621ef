"""One serving replica: role, lifecycle state, paged KV memory, waiting and running sets, the iteration in
flight, cost clock."""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

from slogym.core.batch import BatchFeatures
from slogym.core.pilot import PF_BUSY as _PF_BUSY, PF_AFTER as _PF_AFTER, PF_FLOOR as _PF_FLOOR
from slogym.core.pilot import PF_LASTDT as _PF_LASTDT, PI_FREE as _PI_FREE, PI_ITERS as _PI_ITERS
from slogym.core.pilot import PI_NRUN as _PI_NRUN, PI_NWAIT as _PI_NWAIT, PI_SEQ as _PI_SEQ, PI_TOKENS as _PI_TOKENS

if TYPE_CHECKING:
    from slogym.core.simulator import Simulator


class Role(IntEnum):
    """What an instance runs: everything (COLOCATED), prompts whose KV then moves to a decode instance
    (PREFILL), or the decode stages of requests whose KV it received (DECODE)."""

    COLOCATED = 0
    PREFILL = 1
    DECODE = 2


ENTRY_ROLES = (Role.COLOCATED, Role.PREFILL)
"""Roles that take newly arriving requests (a DECODE instance receives requests only by KV transfer)."""


class InstanceState(IntEnum):
    """Lifecycle: STARTING (cold start, until ``ready_at``) -> ACTIVE -> DRAINING (accepts nothing new,
    finishes its requests) -> STOPPED; a role switch drains and returns to ACTIVE with the new role."""

    STARTING = 0
    ACTIVE = 1
    DRAINING = 2
    STOPPED = 3


class Instance:
    """A replica. Schedulers read it; only the simulator mutates it.

    ``waiting`` and ``running`` are request indices in queue order (a preempted request goes back to the
    front of ``waiting``, as in vLLM). ``free_blocks`` counts free KV blocks of ``block_size`` tokens.
    """

    def __init__(self, idx: int, engine: Any, sim: "Simulator", role: Role = Role.COLOCATED,
                 started_at: float = 0.0, ready_at: float = 0.0, pool: int = 0) -> None:
        self.id = idx
        self.engine = engine
        self.sim = sim
        self.role = Role(role)
        self.state = InstanceState.STARTING if ready_at > started_at else InstanceState.ACTIVE
        self.pool = pool
        self.switch_to: Role | None = None  # role taken once a draining instance is empty (else it stops)
        self.n_parked = 0    # requests off both lists whose KV stays here (tool call, KV transfer out)
        self.n_incoming = 0  # KV transfers on their way to this instance
        self.n_staged = 0  # waiting requests whose KV arrived but is still held by the prefill instance
        self.n_waiting_kv = 0  # waiting requests that hold KV here (back from a tool call): see _kv_holders_first
        self.block_size: int = int(engine.block_size)
        self.total_blocks: int = int(engine.kv_blocks)
        self.free_blocks: int = self.total_blocks
        self.waiting: list[int] = []
        self.running: list[int] = []
        self._running_arr: np.ndarray | None = None
        self.busy = False
        self.inflight: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None
        # one batch of Python-int features -> seconds; the scalar path of shipped presets, or the vector one
        one = getattr(engine, "batch_time_one", None)
        self.time_one = one if one is not None else (
            lambda f: float(engine.batch_time(BatchFeatures(*(np.array([v], np.int64) for v in f)))[0]))
        coef = getattr(engine, "compiled_time", None)
        self.time_coef: np.ndarray | None = None if coef is None else coef()  # for the compiled pilot
        self.dt_floor = _iteration_floor(self.time_coef)
        # (heap sequence number of the iteration in flight, no request here finishes before this time, the end of
        # the iteration after it at the earliest): set by the simulator's pilot, see Simulator._earliest_finish
        self.finish_floor: tuple[int, float, float] = (-1, -np.inf, -np.inf)
        self.last_dt = 0.01
        self.iterations = 0
        self.busy_time = 0.0
        self.tokens = 0
        self.started_at = started_at  # cost clock: from the start request, cold start included
        self.ready_at = ready_at
        self.stopped_at: float | None = None

    # ---------------------------------------------------------------- read-only helpers for policies
    @property
    def n_resident(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def accepting(self) -> bool:
        """Takes new requests: ACTIVE (not starting, draining or stopped)."""
        return self.state == InstanceState.ACTIVE

    @property
    def empty(self) -> bool:
        """Nothing resident, parked, or on its way here."""
        return not (self.waiting or self.running or self.n_parked or self.n_incoming)

    @property
    def kv_utilization(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 1.0

    def running_array(self) -> np.ndarray:
        """``running`` as an int64 array (cached until the running set changes)."""
        if self._running_arr is None:
            self._running_arr = np.array(self.running, dtype=np.int64)
        return self._running_arr

    def running_changed(self) -> None:
        self._running_arr = None

    def set_running(self, run: np.ndarray) -> None:
        """Replace the running set by ``run`` (request indices in order; the simulator's pilot)."""
        self.running = run.tolist()
        self._running_arr = run.copy()

    def remaining(self, idx: np.ndarray | list[int]) -> np.ndarray:
        """Tokens each request still has to compute before its next sample (prefill chunk left, or 1)."""
        rs = self.sim.rs
        return rs.num_tokens[idx] - rs.num_computed[idx]

    def blocks_needed(self, idx: np.ndarray | list[int], tokens: np.ndarray | int) -> np.ndarray:
        """Extra KV blocks each request needs to compute ``tokens`` more tokens."""
        rs = self.sim.rs
        need = -(-(rs.num_computed[idx] + tokens) // self.block_size) - rs.kv_blocks[idx]
        return np.maximum(need, 0)

    def blocks_for_tokens(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.block_size)

    def __repr__(self) -> str:
        return (f"Instance({self.id}, {self.engine.name}, {self.role.name}, {self.state.name}, "
                f"waiting={len(self.waiting)}, "
                f"running={len(self.running)}, free_blocks={self.free_blocks}/{self.total_blocks})")


def _unparking(name: str) -> Any:
    """A :class:`ParkedInstance` attribute that unparks the instance, then reads its own."""
    return property(lambda self: getattr(self._unparked(), name))


def _from_row(col: int, floats: bool = False) -> Any:
    """A :class:`ParkedInstance` attribute read from its row of the simulator's parked tables (``pilot.PF_*``
    columns with ``floats``, else ``pilot.PI_*``)."""
    if floats:
        return property(lambda self: float(self.sim._pk_f[self.id, col]))
    return property(lambda self: int(self.sim._pk_i[self.id, col]))


class ParkedInstance(Instance):
    """An instance parked by the simulator's compiled pilot (``Simulator._pilot``, ``pilot.park``): its batch in
    flight, running set, waiting queue and counters live in row ``id`` of the simulator's parked tables
    (``pilot.PI_*`` / ``PF_*``), so those attributes in its ``__dict__`` (``_PARKED_FIELDS``) are stale. Reading
    a counter, ``free_blocks``, ``finish_floor`` or ``n_resident`` reads the row; ``busy`` is True (a batch is in
    flight); reading the lists or ``inflight``, or writing any of those attributes, first unparks it (the
    simulator writes the row back into the object and turns it into an :class:`Instance` again). Its other
    attributes (role, lifecycle state, ...) are not parked. The simulator switches ``__class__`` between the
    two, so an instance that is not parked pays nothing for this."""

    def _unparked(self) -> Instance:
        self.sim._unpark(self)
        return self

    # what a parked instance answers: its lists and batch after unparking; counters from its table row
    waiting = _unparking("waiting")
    running = _unparking("running")
    inflight = _unparking("inflight")
    busy = property(lambda self: True)  # a batch is in flight
    free_blocks = _from_row(_PI_FREE)
    iterations = _from_row(_PI_ITERS)
    tokens = _from_row(_PI_TOKENS)
    busy_time = _from_row(_PF_BUSY, floats=True)
    last_dt = _from_row(_PF_LASTDT, floats=True)

    @property
    def finish_floor(self) -> tuple[int, float, float]:  # type: ignore[override]
        f = self.sim._pk_f[self.id]
        return int(self.sim._pk_i[self.id, _PI_SEQ]), float(f[_PF_FLOOR]), float(f[_PF_AFTER])

    @property
    def n_resident(self) -> int:
        row = self.sim._pk_i[self.id]
        return int(row[_PI_NWAIT] + row[_PI_NRUN])

    def running_array(self) -> np.ndarray:
        return self._unparked().running_array()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PARKED_FIELDS:
            self.sim._unpark(self)
        object.__setattr__(self, name, value)


_PARKED_FIELDS = frozenset(("waiting", "running", "inflight", "busy", "free_blocks", "iterations", "tokens",
                            "busy_time", "last_dt", "finish_floor", "_running_arr"))
"""The attributes whose truth a parked instance keeps in the simulator's tables."""


def _iteration_floor(coef: np.ndarray | None) -> float:
    """A lower bound on any iteration's duration under the compiled perf model ``coef``: its time for one prompt
    token or one decode step, the two smallest batches (every term of ``analytic_time`` grows with every feature
    when no coefficient is negative); 0 when there is no compiled model or a coefficient is negative."""
    if coef is None or (coef < 0).any():
        return 0.0
    from slogym.engines.perf_models import analytic_time  # engines import core: imported on first use

    return float(min(analytic_time(1, 1, 1, 0, 0, 0, coef), analytic_time(0, 0, 0, 1, 1, 1, coef)))

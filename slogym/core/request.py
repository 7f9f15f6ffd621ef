"""Requests, stages and SLOs, stored as a struct-of-arrays :class:`Workload`.

A request is an arrival time plus a list of stages:

* ``prefill(n, ttft)`` -- process ``n`` new prompt tokens; its completion emits the first token of the
  following decode stage. ``ttft`` is the stage's time-to-first-token budget (seconds, from the moment the
  stage becomes ready: the arrival, or the return of the tool call before it).
* ``decode(n, tpot)`` -- generate ``n`` tokens at ``tpot`` seconds per output token.
* ``external(delay)`` -- a tool call: the request leaves the running set for ``delay`` seconds, then the next
  prefill stage (the tool's response) begins. Its KV stays parked on its instance meanwhile (session affinity
  with a prefix cache, as SLOs-Serve's fast tool loop assumes), so that prefill computes only the new tokens.

SLOs are token-deadline lines (SLOs-Serve §3.1, PolyServe's deadline-based SLO): within a
prefill+decode segment that becomes ready at ``t_ref`` the k-th output token (k = 0 is the one emitted by the
prefill) is due at ``t_ref + ttft + k * tpot``. A decode stage that directly follows another decode stage
(reasoning: thinking then response) continues the line of the stage before it, with its own ``tpot``.
A request may also carry an end-to-end ``ttlt`` deadline, a ``priority`` level and a ``best_effort`` flag
(no SLO at all).

The hot path never touches :class:`Request` objects: a :class:`Workload` keeps every field in NumPy arrays,
stages in CSR layout (``stage_ptr[i]:stage_ptr[i+1]`` are request ``i``'s stages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from enum import IntEnum
from typing import Iterable, Sequence

import numpy as np

INF = math.inf


class StageKind(IntEnum):
    PREFILL = 0
    DECODE = 1
    EXTERNAL = 2


@dataclass(frozen=True)
class Stage:
    """One stage of a request. Use :func:`prefill`, :func:`decode`, :func:`external` to build them."""

    kind: StageKind
    tokens: int = 0
    delay: float = 0.0
    ttft: float = INF
    tpot: float = INF


def prefill(n: int, ttft: float = INF) -> Stage:
    """A prefill of ``n`` prompt tokens with time-to-first-token budget ``ttft`` seconds."""
    return Stage(StageKind.PREFILL, tokens=int(n), ttft=float(ttft))


def decode(n: int, tpot: float = INF) -> Stage:
    """A decode of ``n`` output tokens at ``tpot`` seconds per output token."""
    return Stage(StageKind.DECODE, tokens=int(n), tpot=float(tpot))


def external(delay: float) -> Stage:
    """A tool call lasting ``delay`` seconds outside the engine."""
    return Stage(StageKind.EXTERNAL, delay=float(delay))


@dataclass
class Request:
    """A user-facing request description; collect many into a :class:`Workload`."""

    arrival: float
    stages: Sequence[Stage]
    app: str = "default"
    tier: str = "default"
    ttlt: float = INF
    priority: int = 0
    best_effort: bool = False
    group: int = -1
    group_stage: int = 0


class WorkloadError(ValueError):
    """Raised for an invalid workload (names the request index and field)."""


@dataclass
class Workload:
    """Struct-of-arrays request table, sorted by arrival.

    Request fields (length ``n``): ``arrival`` (s), ``app``/``tier`` (codes into ``app_names``/``tier_names``),
    ``ttlt`` (s, ``inf`` if none), ``priority`` (int, larger = more important), ``best_effort`` (bool).
    Collective requests (Tempo §2): ``group`` (-1 = standalone) and ``group_stage``; a request of stage
    ``s > 0`` is released when every request of its group with a lower stage has finished (its ``arrival`` is the
    group's arrival, and its ``ttlt`` is the group's end-to-end deadline measured from there).
    Stage fields (CSR, length ``stage_ptr[-1]``): ``stage_kind``, ``stage_tokens``, ``stage_delay``,
    ``stage_ttft``, ``stage_tpot``.
    """

    arrival: np.ndarray
    app: np.ndarray
    tier: np.ndarray
    ttlt: np.ndarray
    priority: np.ndarray
    best_effort: np.ndarray
    stage_ptr: np.ndarray
    stage_kind: np.ndarray
    stage_tokens: np.ndarray
    stage_delay: np.ndarray
    stage_ttft: np.ndarray
    stage_tpot: np.ndarray
    app_names: list[str] = field(default_factory=lambda: ["default"])
    tier_names: list[str] = field(default_factory=lambda: ["default"])
    name: str = "workload"
    group: np.ndarray | None = None
    group_stage: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self)
        if self.group is None:
            self.group = np.full(n, -1, dtype=np.int64)
        if self.group_stage is None:
            self.group_stage = np.zeros(n, dtype=np.int32)
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_requests(cls, requests: Iterable[Request], name: str = "workload") -> "Workload":
        reqs = sorted(requests, key=lambda r: r.arrival)
        apps: dict[str, int] = {}
        tiers: dict[str, int] = {}
        ptr = [0]
        kinds, toks, delays, ttfts, tpots = [], [], [], [], []
        for r in reqs:
            for s in r.stages:
                kinds.append(int(s.kind))
                toks.append(s.tokens)
                delays.append(s.delay)
                ttfts.append(s.ttft)
                tpots.append(s.tpot)
            ptr.append(len(kinds))
        return cls(
            arrival=np.array([r.arrival for r in reqs], dtype=np.float64),
            app=np.array([apps.setdefault(r.app, len(apps)) for r in reqs], dtype=np.int32),
            tier=np.array([tiers.setdefault(r.tier, len(tiers)) for r in reqs], dtype=np.int32),
            ttlt=np.array([r.ttlt for r in reqs], dtype=np.float64),
            priority=np.array([r.priority for r in reqs], dtype=np.int32),
            best_effort=np.array([r.best_effort for r in reqs], dtype=bool),
            stage_ptr=np.array(ptr, dtype=np.int64),
            stage_kind=np.array(kinds, dtype=np.int8),
            stage_tokens=np.array(toks, dtype=np.int64),
            stage_delay=np.array(delays, dtype=np.float64),
            stage_ttft=np.array(ttfts, dtype=np.float64),
            stage_tpot=np.array(tpots, dtype=np.float64),
            app_names=list(apps) or ["default"],
            tier_names=list(tiers) or ["default"],
            name=name,
            group=np.array([r.group for r in reqs], dtype=np.int64),
            group_stage=np.array([r.group_stage for r in reqs], dtype=np.int32),
        )

    @classmethod
    def two_stage(
        cls,
        arrival: np.ndarray,
        input_tokens: np.ndarray,
        output_tokens: np.ndarray,
        ttft: np.ndarray | float,
        tpot: np.ndarray | float,
        app: np.ndarray | int = 0,
        tier: np.ndarray | int = 0,
        app_names: list[str] | None = None,
        tier_names: list[str] | None = None,
        ttlt: np.ndarray | float = INF,
        priority: np.ndarray | int = 0,
        best_effort: np.ndarray | bool = False,
        name: str = "workload",
    ) -> "Workload":
        """Vectorized constructor for the common prefill(n) + decode(m) request (chat, code, summarization)."""
        arrival = np.asarray(arrival, dtype=np.float64)
        n = arrival.shape[0]
        order = np.argsort(arrival, kind="stable")

        def col(x, dtype) -> np.ndarray:
            a = np.broadcast_to(np.asarray(x, dtype=dtype), (n,))
            return np.ascontiguousarray(a[order])

        kinds = np.empty(2 * n, dtype=np.int8)
        kinds[0::2], kinds[1::2] = StageKind.PREFILL, StageKind.DECODE
        toks = np.empty(2 * n, dtype=np.int64)
        toks[0::2], toks[1::2] = col(input_tokens, np.int64), col(output_tokens, np.int64)
        ttfts = np.full(2 * n, INF)
        ttfts[0::2] = col(ttft, np.float64)
        tpots = np.full(2 * n, INF)
        tpots[1::2] = col(tpot, np.float64)
        return cls(
            arrival=arrival[order],
            app=col(app, np.int32),
            tier=col(tier, np.int32),
            ttlt=col(ttlt, np.float64),
            priority=col(priority, np.int32),
            best_effort=col(best_effort, bool),
            stage_ptr=np.arange(0, 2 * n + 1, 2, dtype=np.int64),
            stage_kind=kinds,
            stage_tokens=toks,
            stage_delay=np.zeros(2 * n),
            stage_ttft=ttfts,
            stage_tpot=tpots,
            app_names=app_names or ["default"],
            tier_names=tier_names or ["default"],
            name=name,
        )

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return int(self.arrival.shape[0])

    def stages(self, i: int) -> list[Stage]:
        lo, hi = self.stage_ptr[i], self.stage_ptr[i + 1]
        return [
            Stage(StageKind(int(self.stage_kind[j])), int(self.stage_tokens[j]), float(self.stage_delay[j]),
                  float(self.stage_ttft[j]), float(self.stage_tpot[j]))
            for j in range(lo, hi)
        ]

    def request(self, i: int) -> Request:
        return Request(float(self.arrival[i]), self.stages(i), self.app_names[self.app[i]],
                       self.tier_names[self.tier[i]], float(self.ttlt[i]), int(self.priority[i]),
                       bool(self.best_effort[i]), int(self.group[i]), int(self.group_stage[i]))

    def _per_request_sum(self, kind: StageKind) -> np.ndarray:
        tok = np.where(self.stage_kind == kind, self.stage_tokens, 0)
        csum = np.concatenate(([0], np.cumsum(tok)))
        return csum[self.stage_ptr[1:]] - csum[self.stage_ptr[:-1]]

    @cached_property
    def input_tokens(self) -> np.ndarray:
        """Total new prompt tokens over all prefill stages, per request."""
        return self._per_request_sum(StageKind.PREFILL)

    @cached_property
    def output_tokens(self) -> np.ndarray:
        """Total output tokens over all decode stages, per request (the trace's true length)."""
        return self._per_request_sum(StageKind.DECODE)

    @cached_property
    def first_ttft(self) -> np.ndarray:
        return self.stage_ttft[self.stage_ptr[:-1]]

    @cached_property
    def min_tpot(self) -> np.ndarray:
        """Tightest TPOT over a request's decode stages (SLOs-Serve's tightest-SLO rule), ``inf`` if none."""
        tp = np.where(self.stage_kind == StageKind.DECODE, self.stage_tpot, INF)
        return np.minimum.reduceat(tp, self.stage_ptr[:-1]) if len(self) else np.zeros(0)

    def subset(self, idx: np.ndarray, name: str | None = None) -> "Workload":
        """Requests ``idx`` (sorted positions) as a new workload; codes and names are kept."""
        idx = np.asarray(idx, dtype=np.int64)
        lo, hi = self.stage_ptr[idx], self.stage_ptr[idx + 1]
        lens = hi - lo
        ptr = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        sidx = np.arange(ptr[-1], dtype=np.int64) + np.repeat(lo - ptr[:-1], lens)  # stage rows, request by request
        return Workload(
            self.arrival[idx], self.app[idx], self.tier[idx], self.ttlt[idx], self.priority[idx],
            self.best_effort[idx], ptr,
            self.stage_kind[sidx], self.stage_tokens[sidx], self.stage_delay[sidx], self.stage_ttft[sidx],
            self.stage_tpot[sidx], list(self.app_names), list(self.tier_names), name or self.name,
            self.group[idx], self.group_stage[idx],
        )

    def with_arrivals(self, arrival: np.ndarray, name: str | None = None) -> "Workload":
        """Same requests with new arrival times (re-sorted)."""
        arrival = np.asarray(arrival, dtype=np.float64)
        if arrival.shape != self.arrival.shape:
            raise WorkloadError(f"arrival has shape {arrival.shape}, workload has {len(self)} requests")
        w = Workload(arrival, self.app, self.tier, self.ttlt, self.priority, self.best_effort, self.stage_ptr,
                     self.stage_kind, self.stage_tokens, self.stage_delay, self.stage_ttft, self.stage_tpot,
                     self.app_names, self.tier_names, name or self.name, self.group, self.group_stage)
        order = np.argsort(arrival, kind="stable")
        return w if np.all(order == np.arange(len(w))) else w.subset(order)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        n = len(self)
        for f in ("app", "tier", "ttlt", "priority", "best_effort", "group", "group_stage"):
            if getattr(self, f).shape != (n,):
                raise WorkloadError(f"field {f!r} has shape {getattr(self, f).shape}, expected ({n},)")
        if self.stage_ptr.shape != (n + 1,) or self.stage_ptr[0] != 0:
            raise WorkloadError("stage_ptr must have n+1 entries starting at 0")
        if not np.all(np.isfinite(self.arrival)):
            i = int(np.flatnonzero(~np.isfinite(self.arrival))[0])
            raise WorkloadError(f"request {i}: field 'arrival' is {float(self.arrival[i])} (must be finite)")
        if n and np.any(np.diff(self.arrival) < 0):
            i = int(np.flatnonzero(np.diff(self.arrival) < 0)[0]) + 1
            raise WorkloadError(f"request {i}: field 'arrival' decreases ({self.arrival[i - 1]} -> {self.arrival[i]})")
        if np.any(np.diff(self.stage_ptr) < 1):
            i = int(np.flatnonzero(np.diff(self.stage_ptr) < 1)[0])
            raise WorkloadError(f"request {i}: has no stages")
        kinds = self.stage_kind
        first = kinds[self.stage_ptr[:-1]]
        if np.any(first != StageKind.PREFILL):
            i = int(np.flatnonzero(first != StageKind.PREFILL)[0])
            raise WorkloadError(f"request {i}: field 'stages' must start with a prefill stage")
        tok_stage = kinds != StageKind.EXTERNAL
        bad = tok_stage & (self.stage_tokens < 1)
        if np.any(bad):
            j = int(np.flatnonzero(bad)[0])
            i = int(np.searchsorted(self.stage_ptr, j, side="right") - 1)
            raise WorkloadError(f"request {i}: stage {j - self.stage_ptr[i]} field 'tokens' is "
                                f"{self.stage_tokens[j]} (must be >= 1)")
        for f in ("stage_ttft", "stage_tpot", "stage_delay"):
            a = getattr(self, f)
            bad = np.isnan(a) | (a < 0)
            if np.any(bad):
                j = int(np.flatnonzero(bad)[0])
                i = int(np.searchsorted(self.stage_ptr, j, side="right") - 1)
                raise WorkloadError(f"request {i}: stage {j - self.stage_ptr[i]} field {f[6:]!r} is {float(a[j])}")
        # an external stage must be followed by a prefill (the tool result) and cannot end the request
        nxt = np.append(kinds[1:], -1)
        last = np.zeros(len(kinds), dtype=bool)
        last[self.stage_ptr[1:] - 1] = True
        bad = (kinds == StageKind.EXTERNAL) & (last | (nxt != StageKind.PREFILL))
        if np.any(bad):
            j = int(np.flatnonzero(bad)[0])
            i = int(np.searchsorted(self.stage_ptr, j, side="right") - 1)
            raise WorkloadError(f"request {i}: external stage {j - self.stage_ptr[i]} must be followed by a prefill")
        self._validate_groups()

    def _validate_groups(self) -> None:
        """The calls of a collective group share its arrival, end-to-end deadline and best-effort flag (the class
        docstring): the group is scored once with them (``metrics.user_request_scores``), so a disagreement
        would be a silent choice."""
        calls = np.flatnonzero(self.group >= 0)
        if not calls.size:
            return
        if np.any(self.group_stage[calls] < 0):
            i = int(calls[self.group_stage[calls] < 0][0])
            raise WorkloadError(f"request {i}: field 'group_stage' is {int(self.group_stage[i])} in collective group "
                                f"{int(self.group[i])} (must be >= 0)")
        calls = calls[np.argsort(self.group[calls], kind="stable")]
        g = self.group[calls]
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        first = np.repeat(calls[starts], np.diff(np.r_[starts, calls.size]))  # each call's group's first call
        for f in ("arrival", "ttlt", "best_effort"):
            a = getattr(self, f)
            bad = a[calls] != a[first]
            if np.any(bad):
                k = int(np.flatnonzero(bad)[0])
                i, j = int(calls[k]), int(first[k])
                raise WorkloadError(f"request {i}: field {f!r} is {a[i]} but request {j} of the same collective group "
                                    f"{int(g[k])} has {a[j]} (a group's calls share its arrival, deadline and "
                                    f"best-effort flag)")

"""A request trace as read from disk: arrivals and token counts, before any SLOs are attached.

Scenario presets turn a :class:`Trace` into a :class:`slogym.core.request.Workload`; readers for the
supported file formats live in :mod:`slogym.workloads.readers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd


def _is_column(value: object) -> bool:
    """Whether an ``extra`` entry holds one value per row (and so follows slicing)."""
    return isinstance(value, (np.ndarray, list))


@dataclass
class Trace:
    """Per-request arrivals and token counts of one trace file.

    ``arrival`` is in seconds relative to the first request (``arrival[0] == 0.0``), non-decreasing, or
    ``None`` for length-only tables. Token counts are positive int64. ``extra`` holds per-row columns
    (NumPy arrays or lists with one entry per row, e.g. Mooncake ``hash_ids``; they are sliced with the rows)
    and scalar metadata (anything else; copied as is). ``skipped`` maps a reason to the number of rows the
    reader dropped (or, for ``"unsorted"``, reordered) for it.
    """

    arrival: np.ndarray | None
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str = ""
    format: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.input_tokens = np.asarray(self.input_tokens, dtype=np.int64)
        self.output_tokens = np.asarray(self.output_tokens, dtype=np.int64)
        if self.arrival is not None:
            self.arrival = np.asarray(self.arrival, dtype=np.float64)
        n = len(self.input_tokens)
        lengths = {"output_tokens": len(self.output_tokens)}
        if self.arrival is not None:
            lengths["arrival"] = len(self.arrival)
        lengths.update({f"extra[{k!r}]": len(v) for k, v in self.extra.items() if _is_column(v)})
        wrong = {k: m for k, m in lengths.items() if m != n}
        if wrong:
            raise ValueError(f"Trace columns must all have {n} rows (input_tokens); got {wrong}")

    def __len__(self) -> int:
        return len(self.input_tokens)

    def _take(self, index: np.ndarray | slice, rebase: bool = False) -> Trace:
        """The rows selected by ``index`` (a slice or an increasing index array) as a new trace."""
        arrival = None if self.arrival is None else self.arrival[index]
        if rebase and arrival is not None and len(arrival):
            arrival = arrival - arrival[0]
        extra: dict[str, object] = {}
        for key, value in self.extra.items():
            if isinstance(value, np.ndarray):
                extra[key] = value[index]
            elif isinstance(value, list):
                extra[key] = value[index] if isinstance(index, slice) else [value[i] for i in index]
            else:
                extra[key] = value
        return Trace(arrival, self.input_tokens[index], self.output_tokens[index], self.source, self.format,
                     extra, dict(self.skipped))

    def head(self, n: int) -> Trace:
        """The first ``n`` requests."""
        return self._take(slice(0, max(int(n), 0)))

    def _require_arrivals(self, what: str) -> np.ndarray:
        if self.arrival is None:
            raise ValueError(f"{what} needs arrival times; {self.source or 'this trace'} is a length-only table")
        return self.arrival

    def window(self, t0: float, t1: float) -> Trace:
        """Requests arriving in ``[t0, t1)`` seconds, re-based so the first of them arrives at 0.0."""
        arrival = self._require_arrivals("window()")
        lo, hi = np.searchsorted(arrival, [t0, t1], side="left")
        return self._take(slice(int(lo), int(max(lo, hi))), rebase=True)

    def scale_rate(self, factor: float) -> Trace:
        """The same requests with the arrival rate multiplied by ``factor`` (arrival times divided by it)."""
        arrival = self._require_arrivals("scale_rate()")
        if not (np.isfinite(factor) and factor > 0):
            raise ValueError(f"scale_rate factor must be positive and finite, got {factor!r}")
        scaled = self._take(slice(None))
        scaled.arrival = arrival / factor
        return scaled

    def summary(self) -> dict[str, Any]:
        """Row count, time span, mean rate and token statistics.

        Keys follow ``STATS.json`` of the shared traces: ``rows``, ``duration_s`` (last minus first arrival),
        ``mean_rate_rps`` (rows / duration), then ``{input,output}_{mean,p50,p99,min,max}``. Percentiles use
        linear interpolation. Time keys are ``None`` for length-only tables (and the rate for zero span).
        """
        out: dict[str, Any] = {"rows": len(self), "duration_s": None, "mean_rate_rps": None}
        if self.arrival is not None and len(self):
            span = float(self.arrival[-1] - self.arrival[0])
            out["duration_s"] = span
            out["mean_rate_rps"] = len(self) / span if span > 0 else None
        for name, values in (("input", self.input_tokens), ("output", self.output_tokens)):
            if not len(values):
                continue
            p50, p99 = np.percentile(values, [50, 99])
            out.update({f"{name}_mean": float(values.mean()), f"{name}_p50": float(p50), f"{name}_p99": float(p99),
                        f"{name}_min": int(values.min()), f"{name}_max": int(values.max())})
        return out

    def to_frame(self) -> pd.DataFrame:
        """A DataFrame with ``arrival`` (if any), ``input_tokens``, ``output_tokens`` and the per-row extras."""
        columns: dict[str, object] = {}
        if self.arrival is not None:
            columns["arrival"] = self.arrival
        columns["input_tokens"] = self.input_tokens
        columns["output_tokens"] = self.output_tokens
        for key, value in self.extra.items():
            if _is_column(value):
                columns[key] = pd.Series(value, dtype=object) if isinstance(value, list) else value
        return pd.DataFrame(columns)

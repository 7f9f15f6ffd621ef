"""Readers for public LLM-serving trace files, with row-level validation.

Supported formats (see ``traces/README.md`` for sources and citations):

* ``"azure"`` -- Azure LLM inference traces, 2023 and 2024 layouts: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``
  with ISO-like timestamps (``2023-11-16 18:17:03.9799600``; an offset such as ``+00:00`` is accepted).
* ``"burstgpt"`` -- BurstGPT CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``,
  timestamps in seconds. Rows with ``Response tokens == 0`` are failed requests: they are always dropped and
  counted as ``skipped["failed_request"]`` (they are not malformed, so ``on_error="raise"`` does not raise).
* ``"mooncake"`` -- Mooncake JSONL, one object per line with ``timestamp`` (ms), ``input_length``,
  ``output_length`` and optional ``hash_ids`` (kept as ``extra["hash_ids"]``, a list of int lists).
* ``"lengths"`` -- length tables (ShareGPT / arXiv as processed by sarathi-serve and vidur):
  ``num_prefill_tokens,num_decode_tokens`` (other columns ignored); no arrivals.

Files may be gzip-compressed (detected from the content). Every row is checked: token counts must be positive
integers and timestamps parseable and non-decreasing. With ``on_error="raise"`` (default) the first bad row
raises :class:`TraceFormatError`; with ``on_error="skip"`` bad rows are dropped, counted per reason in
:attr:`Trace.skipped`, out-of-order rows are stably sorted (counted as ``"unsorted"``), and one warning
summarizes. A missing column, a CSV line with more fields than the header, an unreadable CSV layout and a file
without data rows always raise.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import numpy as np
import pandas as pd

from slogym.workloads.trace import Trace

__all__ = ["FORMATS", "TraceFormatError", "read_trace", "read_azure", "read_burstgpt", "read_mooncake",
           "read_length_table"]

OnError = Literal["raise", "skip"]
FORMATS = ("azure", "burstgpt", "mooncake", "lengths")

_PROBLEMS = {
    "bad_json": "line is not a JSON object",
    "missing": "missing, empty or NaN value",
    "non_numeric": "not a finite number",
    "non_integer": "token count is not an integer",
    "negative": "negative token count",
    "zero": "zero token count",
    "bad_timestamp": "unparseable timestamp",
    "bad_hash_ids": "hash_ids is not a list",
    "unsorted": "timestamp is earlier than the one on the row before",
}
_MISSING_TEXT = frozenset({"", "nan", "null", "none"})
_NO_VALUE = object()


class TraceFormatError(ValueError):
    """A trace file that cannot be read; names the file, the 1-based line, the field and the bad value."""

    def __init__(self, path: str, line: int, field: str | None, problem: str, value: object = _NO_VALUE):
        self.path, self.line, self.field, self.problem = path, line, field, problem
        if isinstance(value, np.generic):
            value = value.item()
        self.value = None if value is _NO_VALUE else value
        where = f"{path}, line {line}" + (f", field {field!r}" if field is not None else "")
        shown = "" if value is _NO_VALUE else f" (value {_clip(value)})"
        super().__init__(f"{where}: {problem}{shown}")


def _clip(value: object, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------------- validation


@dataclass
class _Issue:
    reason: str
    field: str
    mask: np.ndarray
    raw: Sequence[object]
    fatal: bool


@dataclass
class _Rows:
    """Validation state of the data rows of one file: their line numbers and the problems found so far."""

    path: str
    lines: np.ndarray
    issues: list[_Issue] = field(default_factory=list)

    def flag(self, reason: str, field: str, mask: np.ndarray, raw: Sequence[object], fatal: bool = True) -> None:
        if mask.any():
            self.issues.append(_Issue(reason, field, mask, raw, fatal))

    def number(self, field: str, raw: Sequence[object], values: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Flag missing and non-finite ``values`` (NaN where ``raw`` was unparseable); return them."""
        self.flag("missing", field, missing, raw)
        self.flag("non_numeric", field, ~missing & ~np.isfinite(values), raw)
        return values

    def tokens(self, field: str, raw: Sequence[object], values: np.ndarray, missing: np.ndarray,
               zero_ok: bool = False) -> np.ndarray:
        """Check a token-count column; return it as int64 (0 where invalid)."""
        values = self.number(field, raw, values, missing)
        finite = np.isfinite(values)
        self.flag("non_integer", field, finite & (values != np.floor(values)), raw)
        self.flag("negative", field, values < 0, raw)
        if not zero_ok:
            self.flag("zero", field, values == 0, raw)
        return np.where(finite, values, 0).astype(np.int64)

    def fail(self, issue: _Issue, row: int) -> TraceFormatError:
        return TraceFormatError(self.path, int(self.lines[row]), issue.field, _PROBLEMS[issue.reason],
                                issue.raw[row])

    def resolve(self, on_error: OnError) -> tuple[np.ndarray, dict[str, int]]:
        """Rows to keep and drop counts per reason; raises on the first fatal problem unless skipping."""
        if on_error == "raise":
            first = [(int(np.argmax(i.mask)), k) for k, i in enumerate(self.issues) if i.fatal]
            if first:
                row, k = min(first)
                raise self.fail(self.issues[k], row)
        dropped = np.zeros(len(self.lines), dtype=bool)
        counts: dict[str, int] = {}
        for issue in self.issues:
            new = issue.mask & ~dropped
            if new.any():
                counts[issue.reason] = counts.get(issue.reason, 0) + int(new.sum())
                dropped |= new
        return ~dropped, counts


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def _finish(rows: _Rows, on_error: OnError, fmt: str, inputs: np.ndarray, outputs: np.ndarray,
            time: tuple[str, Sequence[object], np.ndarray] | None, extra: dict[str, np.ndarray | list]) -> Trace:
    """Drop bad rows, check (or repair) the arrival order and assemble the :class:`Trace`.

    ``time`` is ``(field, raw values, seconds from any origin)``, or ``None`` for length-only tables.
    """
    keep, skipped = rows.resolve(on_error)
    index = np.flatnonzero(keep)
    if not len(index):
        first_line = int(rows.lines[0]) if len(rows.lines) else 2
        raise TraceFormatError(rows.path, first_line, None, f"no valid data rows (dropped: {skipped})")
    arrival = None
    if time is not None:
        name, raw, seconds = time
        t = seconds[index]
        late = t[1:] < np.maximum.accumulate(t)[:-1]
        if late.any():
            if on_error == "raise":
                row = int(index[np.argmax(late) + 1])
                raise TraceFormatError(rows.path, int(rows.lines[row]), name, _PROBLEMS["unsorted"], raw[row])
            skipped["unsorted"] = int(late.sum())
            order = np.argsort(t, kind="stable")
            index, t = index[order], t[order]
        arrival = t - t[0]
    if skipped:
        dropped = {k: v for k, v in skipped.items() if k != "unsorted"}
        note = f"dropped {sum(dropped.values())} of {len(rows.lines)} rows {dropped}" if dropped else "dropped no rows"
        if "unsorted" in skipped:
            note += f"; re-sorted {skipped['unsorted']} out-of-order rows"
        warnings.warn(f"{rows.path}: {note}", stacklevel=3)
    kept_extra: dict[str, object] = {
        k: v[index] if isinstance(v, np.ndarray) else [v[i] for i in index] for k, v in extra.items()}
    return Trace(arrival, inputs[index], outputs[index], rows.path, fmt, kept_extra, skipped)


# ---------------------------------------------------------------------------------------------------- CSV


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def _open_text(path: Path) -> IO[str]:
    if _is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _read_csv(path: Path, required: Sequence[str], limit: int | None) -> tuple[pd.DataFrame, _Rows]:
    """The data rows of a CSV (every cell kept as text unless a whole column is numeric) and their lines."""
    name = str(path)
    try:
        # index_col=False: without it, a first data row with one field more than the header silently turns the
        # first column into the index and shifts every column left; with it pandas drops the surplus and warns
        with warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)
            frame = pd.read_csv(path, compression="gzip" if _is_gzip(path) else None, keep_default_na=False,
                                skip_blank_lines=False, skipinitialspace=True, nrows=limit, index_col=False)
    except pd.errors.ParserWarning:
        raise _too_many_fields(path, limit) from None
    except pd.errors.EmptyDataError:
        raise TraceFormatError(name, 1, None, "empty file (no header line)") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        # pandas counts lines like we do (header = line 1); fall back to the header when it names none.
        ragged = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(exc))
        if ragged:
            expected, line, saw = (int(x) for x in ragged.groups())
            raise TraceFormatError(name, line, None, f"{saw} fields but the header has {expected}") from None
        found = re.search(r"line (\d+)", str(exc))
        raise TraceFormatError(name, int(found.group(1)) if found else 1, None,
                               f"not a readable CSV: {str(exc).strip()}") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    for column in required:
        if column not in frame.columns:
            raise TraceFormatError(name, 1, column, "missing column", list(frame.columns))
    lines = np.arange(2, len(frame) + 2)
    text_columns = [c for c in frame.columns if not pd.api.types.is_numeric_dtype(frame[c])]
    if len(text_columns) == len(frame.columns) and len(frame):
        blank = np.logical_and.reduce([(frame[c] == "").to_numpy() for c in text_columns])
        frame, lines = frame[~blank], lines[~blank]
    if not len(frame):
        raise TraceFormatError(name, 2, None, "no data rows")
    return frame, _Rows(name, lines)


def _too_many_fields(path: Path, limit: int | None) -> TraceFormatError:
    """The error for the first line (of the header and ``limit`` data rows) with more fields than the header."""
    with _open_text(path) as fh:
        reader = csv.reader(fh, skipinitialspace=True)
        header = next((r for r in reader if r), [])
        for count, row in enumerate(reader):
            if limit is not None and count >= limit:
                break
            if len(row) > len(header):
                return TraceFormatError(str(path), reader.line_num, None,
                                        f"{len(row)} fields but the header has {len(header)}", ",".join(row))
    return TraceFormatError(str(path), 1, None, "a line has more fields than the header")  # pragma: no cover


def _csv_number(column: pd.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(raw cells, float values with NaN where unparseable, missing mask)`` of one CSV column."""
    raw = column.to_numpy()
    if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
        values = raw.astype(np.float64)
        return raw, values, np.isnan(values)
    text = column.astype(str).str.strip()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    return raw, values, text.str.lower().isin(_MISSING_TEXT).to_numpy()


def _csv_tokens(rows: _Rows, frame: pd.DataFrame, column: str, zero_ok: bool = False) -> np.ndarray:
    raw, values, missing = _csv_number(frame[column])
    return rows.tokens(column, raw, values, missing, zero_ok)


def read_azure(path: str | Path, on_error: OnError = "raise", limit: int | None = None) -> Trace:
    """Read an Azure LLM inference trace (2023 or 2024 layout); arrivals relative to the first request."""
    _check_on_error(on_error)
    frame, rows = _read_csv(Path(path), ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), limit)
    stamps = frame["TIMESTAMP"].astype(str).str.strip()
    parsed = pd.to_datetime(stamps, format="ISO8601", errors="coerce", utc=True)
    missing = stamps.str.lower().isin(_MISSING_TEXT).to_numpy()
    unparsed = parsed.isna().to_numpy()
    raw_stamps = frame["TIMESTAMP"].to_numpy()
    rows.flag("missing", "TIMESTAMP", missing, raw_stamps)
    rows.flag("bad_timestamp", "TIMESTAMP", unparsed & ~missing, raw_stamps)
    origin = parsed.iloc[int(np.argmin(unparsed))]
    seconds = (parsed - origin).dt.total_seconds().to_numpy(dtype=np.float64, na_value=np.nan)
    inputs = _csv_tokens(rows, frame, "ContextTokens")
    outputs = _csv_tokens(rows, frame, "GeneratedTokens")
    return _finish(rows, on_error, "azure", inputs, outputs, ("TIMESTAMP", raw_stamps, seconds), {})


def read_burstgpt(path: str | Path, on_error: OnError = "raise", limit: int | None = None) -> Trace:
    """Read a BurstGPT CSV; failed requests (``Response tokens == 0``) are dropped as ``"failed_request"``.

    ``Model`` and ``Log Type`` columns, when present, are kept as ``extra["model"]`` and ``extra["log_type"]``.
    """
    _check_on_error(on_error)
    frame, rows = _read_csv(Path(path), ("Timestamp", "Request tokens", "Response tokens"), limit)
    raw_time, seconds, missing = _csv_number(frame["Timestamp"])
    rows.number("Timestamp", raw_time, seconds, missing)
    inputs = _csv_tokens(rows, frame, "Request tokens")
    raw_out, out_values, out_missing = _csv_number(frame["Response tokens"])
    outputs = rows.tokens("Response tokens", raw_out, out_values, out_missing, zero_ok=True)
    rows.flag("failed_request", "Response tokens", out_values == 0, raw_out, fatal=False)
    extra = {key: frame[column].astype(str).to_numpy(dtype=object)
             for key, column in (("model", "Model"), ("log_type", "Log Type")) if column in frame.columns}
    return _finish(rows, on_error, "burstgpt", inputs, outputs, ("Timestamp", raw_time, seconds), extra)


def read_length_table(path: str | Path, on_error: OnError = "raise", limit: int | None = None) -> Trace:
    """Read a ``num_prefill_tokens,num_decode_tokens`` length table; the trace has no arrivals."""
    _check_on_error(on_error)
    frame, rows = _read_csv(Path(path), ("num_prefill_tokens", "num_decode_tokens"), limit)
    inputs = _csv_tokens(rows, frame, "num_prefill_tokens")
    outputs = _csv_tokens(rows, frame, "num_decode_tokens")
    return _finish(rows, on_error, "lengths", inputs, outputs, None, {})


# ---------------------------------------------------------------------------------------------------- JSONL


def _json_number(values: list[object]) -> tuple[np.ndarray, np.ndarray]:
    """``(float values, NaN where not a JSON number; missing mask)`` of one JSON field."""
    numbers = np.array([float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
                        for v in values], dtype=np.float64)
    return numbers, np.array([v is None for v in values], dtype=bool)


def read_mooncake(path: str | Path, on_error: OnError = "raise", limit: int | None = None) -> Trace:
    """Read a Mooncake JSONL trace (timestamps in ms); ``hash_ids`` become ``extra["hash_ids"]``."""
    _check_on_error(on_error)
    name = str(path)
    records: list[object] = []
    texts: list[str] = []
    lines: list[int] = []
    with _open_text(Path(path)) as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                records.append(json.loads(text))
            except json.JSONDecodeError:
                records.append(None)
            texts.append(text.rstrip("\r\n"))
            lines.append(number)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise TraceFormatError(name, 1, None, "empty file (no JSON lines)")
    rows = _Rows(name, np.asarray(lines))
    objects = [r if isinstance(r, dict) else {} for r in records]
    rows.flag("bad_json", "<line>", np.array([not isinstance(r, dict) for r in records]), texts)

    def column(key: str) -> list[object]:
        return [o.get(key) for o in objects]

    raw_time = column("timestamp")
    times, missing = _json_number(raw_time)
    rows.number("timestamp", raw_time, times, missing)
    token_columns = []
    for key in ("input_length", "output_length"):
        raw = column(key)
        token_columns.append(rows.tokens(key, raw, *_json_number(raw)))
    extra: dict[str, np.ndarray | list] = {}
    if any("hash_ids" in o for o in objects):
        hashes = column("hash_ids")
        rows.flag("bad_hash_ids", "hash_ids", np.array([not isinstance(h, list) for h in hashes]), hashes)
        extra["hash_ids"] = hashes
    return _finish(rows, on_error, "mooncake", *token_columns, ("timestamp", raw_time, times / 1000.0), extra)


# ---------------------------------------------------------------------------------------------------- dispatch

_READERS: dict[str, Callable[..., Trace]] = {
    "azure": read_azure, "burstgpt": read_burstgpt, "mooncake": read_mooncake, "lengths": read_length_table}
_MARKERS = {
    "azure": {"TIMESTAMP", "ContextTokens", "GeneratedTokens"},
    "burstgpt": {"Request tokens", "Response tokens", "Log Type"},
    "lengths": {"num_prefill_tokens", "num_decode_tokens"},
}


def detect_format(path: str | Path) -> str:
    """The format of ``path``: JSON lines (or a ``.jsonl`` name) mean Mooncake, else the CSV header decides."""
    path = Path(path)
    stem = path.name[:-3] if path.name.endswith(".gz") else path.name
    with _open_text(path) as fh:
        first = next((line for line in fh if line.strip()), "")
    if stem.endswith((".jsonl", ".json")) or first.lstrip().startswith("{"):
        return "mooncake"
    if not first:
        raise TraceFormatError(str(path), 1, None, "empty file")
    header = {c.strip() for c in next(csv.reader(io.StringIO(first)))}
    for fmt, markers in _MARKERS.items():
        if header & markers:
            return fmt
    raise TraceFormatError(str(path), 1, None, f"unrecognized header; expected one of {list(_READERS)}",
                           first.strip())


def read_trace(path: str | Path, format: str | None = None, on_error: OnError = "raise",
               limit: int | None = None) -> Trace:
    """Read a trace file of any supported format (auto-detected unless ``format`` is given).

    ``limit`` reads at most that many data rows from the top of the file; ``on_error`` is ``"raise"`` or
    ``"skip"`` (see the module docstring).
    """
    fmt = detect_format(path) if format is None else format
    if fmt not in _READERS:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {list(_READERS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive row count, got {limit!r}")
    return _READERS[fmt](path, on_error=on_error, limit=limit)

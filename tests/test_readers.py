"""Trace readers: real public traces against STATS.json, malformed inputs, and the synthetic samples."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from slogym.workloads.readers import TraceFormatError, detect_format, read_trace
from slogym.workloads.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
SAMPLES = ROOT / "traces" / "samples"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def _stats() -> list[dict]:
    path = SHARED / "STATS.json"
    return json.loads(path.read_text()) if path.exists() else []


def _write(tmp_path: Path, name: str, lines: list[str]) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _azure(tmp_path: Path, rows: list[str], header: str = AZURE_HEADER) -> Path:
    return _write(tmp_path, "t.csv", [header, *rows])


def _expect_error(path: Path, line: int, field: str | None, value: object = None, **kw) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as info:
        read_trace(path, **kw)
    err = info.value
    assert (err.line, err.field) == (line, field)
    message = str(err)
    assert str(path) in message and f"line {line}" in message
    if field is not None:
        assert repr(field) in message
    if value is not None:  # cells of an all-numeric column come back parsed, others as text
        assert str(err.value) == str(value) and repr(err.value) in message
    return err


def _skip(path: Path, **kw) -> Trace:
    with pytest.warns(UserWarning, match=path.name):
        return read_trace(path, on_error="skip", **kw)


# ---------------------------------------------------------------------------------------------------- real traces


@pytest.mark.parametrize("stats", _stats(), ids=lambda s: s["file"])
def test_real_trace_matches_stats(stats: dict) -> None:
    path = SHARED / (stats["file"] + ".gz")
    if not path.exists():
        pytest.skip(f"{path} not present (shared traces are not part of the repository)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the real files are clean: nothing may be dropped
        trace = read_trace(path)
    summary = trace.summary()
    assert summary["rows"] == stats["rows"] == len(trace)
    assert trace.skipped == {}
    for side in ("input", "output"):
        assert summary[f"{side}_min"] == stats[f"{side}_min"]
        assert summary[f"{side}_max"] == stats[f"{side}_max"]
        assert summary[f"{side}_mean"] == pytest.approx(stats[f"{side}_mean"], abs=0.006)
        for q in ("p50", "p99"):  # STATS.json rounds to one decimal
            assert summary[f"{side}_{q}"] == pytest.approx(stats[f"{side}_{q}"], abs=0.051)
    if "duration_s" in stats:
        assert trace.arrival[0] == 0.0 and np.all(np.diff(trace.arrival) >= 0)
        assert summary["duration_s"] == pytest.approx(stats["duration_s"], abs=1e-3)
        assert summary["mean_rate_rps"] == pytest.approx(stats["mean_rate_rps"], rel=1e-4)
    else:
        assert trace.arrival is None and summary["duration_s"] is None
    if trace.format == "mooncake":
        blocks = np.array([len(h) for h in trace.extra["hash_ids"]])
        assert np.array_equal(blocks, -(-trace.input_tokens // 512))


def test_azure_conv_is_fast() -> None:
    import time

    path = SHARED / "azure_conv_2023.csv.gz"
    if not path.exists():
        pytest.skip(f"{path} not present")
    read_trace(path)  # warm-up (imports, pandas caches)
    start = time.perf_counter()
    read_trace(path)
    assert time.perf_counter() - start < 0.5


# ---------------------------------------------------------------------------------------------------- malformed files


def test_unsorted_timestamps(tmp_path: Path) -> None:
    stamps = ["2023-11-16 18:00:00.0000000", "2023-11-16 18:00:02.0000000", "2023-11-16 18:00:01.5000000",
              "2023-11-16 18:00:03.0000000"]
    path = _azure(tmp_path, [f"{t},{10 + k},5" for k, t in enumerate(stamps)])
    _expect_error(path, 4, "TIMESTAMP", stamps[2])
    trace = _skip(path)
    assert trace.skipped == {"unsorted": 1}
    np.testing.assert_allclose(trace.arrival, [0.0, 1.5, 2.0, 3.0])
    assert trace.input_tokens.tolist() == [10, 12, 11, 13]


@pytest.mark.parametrize(("cell", "reason"), [("-5", "negative"), ("0", "zero"), ("abc", "non_numeric"),
                                              ("3.5", "non_integer"), ("", "missing"), ("NaN", "missing"),
                                              ("inf", "non_numeric")])
def test_bad_token_cell(tmp_path: Path, cell: str, reason: str) -> None:
    rows = [f"2023-11-16 18:00:0{k}.0000000,100,{cell if k == 2 else 7}" for k in range(4)]
    path = _azure(tmp_path, rows)
    _expect_error(path, 4, "GeneratedTokens", cell)
    trace = _skip(path)
    assert trace.skipped == {reason: 1}
    np.testing.assert_allclose(trace.arrival, [0.0, 1.0, 3.0])


def test_skip_counts_each_row_once_and_raise_names_first_line(tmp_path: Path) -> None:
    path = _azure(tmp_path, ["2023-11-16 18:00:00.0,1,1", "2023-11-16 18:00:01.0,x,-1", "bad,2,2",
                             "2023-11-16 18:00:02.0,3,", "2023-11-16 18:00:03.0,4,4"])
    _expect_error(path, 3, "ContextTokens", "x")
    trace = _skip(path)
    assert trace.skipped == {"bad_timestamp": 1, "non_numeric": 1, "missing": 1}
    assert trace.input_tokens.tolist() == [1, 4] and trace.arrival.tolist() == [0.0, 3.0]


def test_bad_timestamp(tmp_path: Path) -> None:
    path = _azure(tmp_path, ["2023-11-16 18:00:00.0,1,1", "2023-13-45 99:00:00.0,2,2"])
    _expect_error(path, 3, "TIMESTAMP", "2023-13-45 99:00:00.0")
    assert _skip(path).skipped == {"bad_timestamp": 1}


def test_missing_column_always_raises(tmp_path: Path) -> None:
    path = _azure(tmp_path, ["2023-11-16 18:00:00.0,1"], header="TIMESTAMP,ContextTokens")
    _expect_error(path, 1, "GeneratedTokens")
    _expect_error(path, 1, "GeneratedTokens", on_error="skip")
    burst = _write(tmp_path, "b.csv", ["Timestamp,Model,Request tokens", "1,ChatGPT,5"])
    _expect_error(burst, 1, "Response tokens", format="burstgpt")


def test_empty_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    _expect_error(empty, 1, None)
    _expect_error(_azure(tmp_path, []), 2, None)
    _expect_error(_azure(tmp_path, []), 2, None, on_error="skip")
    jsonl = tmp_path / "empty.jsonl"
    jsonl.write_text("\n")
    _expect_error(jsonl, 1, None)


def test_all_rows_bad_raises_even_when_skipping(tmp_path: Path) -> None:
    path = _azure(tmp_path, ["2023-11-16 18:00:00.0,0,1", "2023-11-16 18:00:01.0,-1,1"])
    with pytest.raises(TraceFormatError, match="no valid data rows"):
        read_trace(path, on_error="skip")


def test_blank_lines_keep_line_numbers(tmp_path: Path) -> None:
    path = _azure(tmp_path, ["2023-11-16 18:00:00.0,1,1", "", "2023-11-16 18:00:01.0,1,-3"])
    _expect_error(path, 4, "GeneratedTokens", "-3")


def test_ragged_csv_line(tmp_path: Path) -> None:
    path = _azure(tmp_path, ["2023-11-16 18:00:00.0,1,1", "2023-11-16 18:00:01.0,1,1,9"])
    _expect_error(path, 3, None)


def test_jsonl_bad_line_and_missing_field(tmp_path: Path) -> None:
    good = '{"timestamp": %d, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
    lines = [good % 0, "{not json", '{"timestamp": 2000, "output_length": 3, "hash_ids": [3]}', good % 3000,
             '{"timestamp": 4000, "input_length": 9, "output_length": 3, "hash_ids": 7}']
    path = _write(tmp_path, "m.jsonl", lines)
    _expect_error(path, 2, "<line>", "{not json")
    trace = _skip(path)
    assert trace.skipped == {"bad_json": 1, "missing": 1, "bad_hash_ids": 1}
    assert trace.arrival.tolist() == [0.0, 3.0] and trace.extra["hash_ids"] == [[1, 2], [1, 2]]
    missing = _write(tmp_path, "n.jsonl", [good % 0, lines[2]])
    _expect_error(missing, 2, "input_length", None)


def test_burstgpt_failed_requests_are_dropped(tmp_path: Path) -> None:
    path = _write(tmp_path, "b.csv", [BURST_HEADER, "5,ChatGPT,10,4,14,Conversation log",
                                      "6,GPT-4,11,0,11,API log", "9,GPT-4,12,3,15,API log"])
    with pytest.warns(UserWarning, match="failed_request"):
        trace = read_trace(path)  # failures are not format errors
    assert trace.skipped == {"failed_request": 1}
    assert trace.arrival.tolist() == [0.0, 4.0] and list(trace.extra["model"]) == ["ChatGPT", "GPT-4"]
    zero_input = _write(tmp_path, "z.csv", [BURST_HEADER, "5,ChatGPT,0,4,4,API log"])
    _expect_error(zero_input, 2, "Request tokens", 0)


def test_azure_2024_layout_and_gzip_content_detection(tmp_path: Path) -> None:
    rows = ["2024-05-10 00:00:00.009930+00:00,2162,5", "2024-05-10 00:00:01.5+00:00,300,20"]
    path = tmp_path / "week.data"  # gzip and format are detected from the content, not the name
    path.write_bytes(gzip.compress(("\n".join([AZURE_HEADER, *rows]) + "\n").encode()))
    assert detect_format(path) == "azure"
    trace = read_trace(path)
    np.testing.assert_allclose(trace.arrival, [0.0, 1.49007], atol=1e-9)


def test_limit_and_unknown_format(tmp_path: Path) -> None:
    assert len(read_trace(SAMPLES / "azure_sample.csv", limit=7)) == 7
    assert len(read_trace(SAMPLES / "mooncake_sample.jsonl", limit=7)) == 7
    _expect_error(_write(tmp_path, "x.csv", ["a,b", "1,2"]), 1, None)
    with pytest.raises(ValueError, match="on_error"):
        read_trace(SAMPLES / "azure_sample.csv", on_error="ignore")


# ---------------------------------------------------------------------------------------------------- samples


def _sample_script():
    spec = importlib.util.spec_from_file_location("make_trace_samples", ROOT / "scripts" / "make_trace_samples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_samples_are_current(tmp_path: Path) -> None:
    for written in _sample_script().write_samples(tmp_path):
        committed = SAMPLES / written.name
        assert committed.read_bytes() == written.read_bytes(), f"{committed} is stale: rerun the script"
        assert committed.stat().st_size < 8_000


@pytest.mark.parametrize(("name", "fmt"), [("azure_sample.csv", "azure"), ("burstgpt_sample.csv", "burstgpt"),
                                           ("mooncake_sample.jsonl", "mooncake"), ("lengths_sample.csv", "lengths")])
def test_sample_round_trip(name: str, fmt: str) -> None:
    script = _sample_script()
    rows = script.synth()
    keep = ~rows["failed"] if fmt == "burstgpt" else np.ones(len(rows["input"]), dtype=bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = read_trace(SAMPLES / name)
    assert trace.format == fmt and len(trace) == keep.sum()
    assert np.array_equal(trace.input_tokens, rows["input"][keep])
    assert np.array_equal(trace.output_tokens, rows["output"][keep])
    if fmt == "lengths":
        assert trace.arrival is None
        return
    expected = rows["arrival"][keep]
    np.testing.assert_allclose(trace.arrival, expected - expected[0], atol=1e-9)
    if fmt == "burstgpt":
        assert trace.skipped == {"failed_request": int(rows["failed"].sum())}
        assert list(trace.extra["model"]) == list(rows["model"][keep])
        assert list(trace.extra["log_type"]) == list(rows["log_type"][keep])
    if fmt == "mooncake":
        assert trace.extra["hash_ids"] == script.hash_ids(rows["input"])
        assert all(len(h) == math.ceil(n / 512) for h, n in zip(trace.extra["hash_ids"], trace.input_tokens))


# ---------------------------------------------------------------------------------------------------- Trace methods


def test_trace_methods() -> None:
    trace = read_trace(SAMPLES / "mooncake_sample.jsonl")
    head = trace.head(5)
    assert len(head) == 5 and head.extra["hash_ids"] == trace.extra["hash_ids"][:5]
    t0, t1 = trace.arrival[10], trace.arrival[20]
    window = trace.window(t0, t1)
    assert len(window) == np.count_nonzero((trace.arrival >= t0) & (trace.arrival < t1))
    np.testing.assert_allclose(window.arrival, trace.arrival[10:10 + len(window)] - t0)
    assert window.extra["hash_ids"] == trace.extra["hash_ids"][10:10 + len(window)]
    fast = trace.scale_rate(2.0)
    np.testing.assert_allclose(fast.arrival, trace.arrival / 2)
    assert fast.summary()["mean_rate_rps"] == pytest.approx(2 * trace.summary()["mean_rate_rps"])
    frame = trace.to_frame()
    assert list(frame.columns) == ["arrival", "input_tokens", "output_tokens", "hash_ids"]
    assert frame["hash_ids"].iloc[3] == trace.extra["hash_ids"][3]
    lengths = read_trace(SAMPLES / "lengths_sample.csv")
    with pytest.raises(ValueError, match="arrival"):
        lengths.window(0, 1)
    with pytest.raises(ValueError, match="factor"):
        trace.scale_rate(0)
    with pytest.raises(ValueError, match="rows"):
        Trace(None, [1, 2], [1], extra={"model": np.array(["a", "b"])})


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("fmt", ["lengths", "azure", "burstgpt"])
def test_every_row_one_field_too_many_raises(tmp_path: Path, fmt: str, on_error: str) -> None:
    """pandas would read the first column as an index and shift the others left (input <- decode column)."""
    header, rows = {
        "lengths": ("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio",
                    ["760,98,858,7.75,5", "100,20,120,5.0,5"]),
        "azure": (AZURE_HEADER, ["2023-11-16 18:00:00.0,5,3,1", "2023-11-16 18:00:01.0,6,4,1"]),
        "burstgpt": (BURST_HEADER, ["1,ChatGPT,10,20,30,Conversation log,7", "2,ChatGPT,11,21,32,Conversation log,7"]),
    }[fmt]
    path = _write(tmp_path, "t.csv", [header, *rows])
    with pytest.raises(TraceFormatError) as info:
        read_trace(path, format=fmt, on_error=on_error)
    err = info.value
    n_header = header.count(",") + 1
    assert (err.line, err.field) == (2, None)
    assert str(path) in str(err) and "line 2" in str(err) and f"{n_header + 1} fields" in str(err)
    assert f"header has {n_header}" in str(err)


@pytest.mark.parametrize("rows, line", [(["5,6,9", "1,2"], 2), (["1,2", "", "5,6,9"], 4)])
def test_one_row_one_field_too_many_raises(tmp_path: Path, rows: list[str], line: int) -> None:
    """Only the first data row too long (pandas' implicit-index case), or a later one (its tokenizer's error)."""
    path = _write(tmp_path, "u.csv", ["num_prefill_tokens,num_decode_tokens", *rows])
    with pytest.raises(TraceFormatError, match=rf"u\.csv, line {line}: 3 fields but the header has 2"):
        read_trace(path, on_error="skip")

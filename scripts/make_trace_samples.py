"""Write tiny SYNTHETIC sample traces, one per format that :mod:`slogym.workloads.readers` supports.

The rows are random draws (seeded, so the output is byte-for-byte reproducible), not real traffic; they only
show the file layouts and back the reader tests. Usage: ``python scripts/make_trace_samples.py [--out DIR]``
(default ``traces/samples/``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROWS = 50
SEED = 20231116
BLOCK = 512  # Mooncake hash block size (tokens)
AZURE_EPOCH = np.datetime64("2023-11-16T18:00:00", "ns")
BURSTGPT_OFFSET_S = 17.0  # BurstGPT timestamps need not start at 0; the reader re-bases them
FAILED_EVERY = 10  # every 10th BurstGPT row is a failed request (Response tokens 0)
OUT_DIR = Path(__file__).resolve().parents[1] / "traces" / "samples"


def synth(rows: int = ROWS, seed: int = SEED) -> dict[str, np.ndarray]:
    """Arrivals (s, first 0, whole milliseconds), token counts and BurstGPT-style labels for ``rows`` requests."""
    rng = np.random.default_rng(seed)
    gaps = np.round(rng.exponential(0.4, rows), 3)
    gaps[0] = 0.0
    return {
        "arrival": np.round(np.cumsum(gaps), 3),
        "input": np.maximum(1, rng.lognormal(6.5, 1.0, rows)).astype(np.int64),
        "output": np.maximum(1, rng.lognormal(4.5, 0.9, rows)).astype(np.int64),
        "model": rng.choice(["ChatGPT", "GPT-4"], rows),
        "log_type": rng.choice(["Conversation log", "API log"], rows),
        "failed": np.arange(rows) % FAILED_EVERY == FAILED_EVERY - 1,
    }


def hash_ids(inputs: np.ndarray, seed: int = SEED) -> list[list[int]]:
    """Mooncake-style block ids: ``ceil(input / 512)`` per request, some sharing a prefix with an earlier one."""
    rng = np.random.default_rng(seed + 1)
    out: list[list[int]] = []
    fresh = 0
    for n in inputs:
        blocks = -(-int(n) // BLOCK)
        shared: list[int] = []
        if out and rng.random() < 0.4:
            parent = out[int(rng.integers(len(out)))]
            shared = parent[: int(rng.integers(0, min(len(parent), blocks) + 1))]
        new = list(range(fresh, fresh + blocks - len(shared)))
        fresh += len(new)
        out.append(shared + new)
    return out


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_samples(out_dir: Path = OUT_DIR, rows: int = ROWS, seed: int = SEED) -> list[Path]:
    """Write ``azure_sample.csv``, ``burstgpt_sample.csv``, ``mooncake_sample.jsonl``, ``lengths_sample.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    s = synth(rows, seed)
    ns = np.round(s["arrival"] * 1e9).astype("timedelta64[ns]")
    stamps = [t.replace("T", " ")[:-2] for t in np.datetime_as_string(AZURE_EPOCH + ns, unit="ns")]
    responses = np.where(s["failed"], 0, s["output"])
    azure = [f"{t},{i},{o}" for t, i, o in zip(stamps, s["input"], s["output"])]
    burstgpt = [f"{BURSTGPT_OFFSET_S + t:.3f},{m},{i},{o},{i + o},{k}"
                for t, m, i, o, k in zip(s["arrival"], s["model"], s["input"], responses, s["log_type"])]
    mooncake = [json.dumps({"timestamp": int(round(t * 1000)), "input_length": int(i), "output_length": int(o),
                            "hash_ids": h})
                for t, i, o, h in zip(s["arrival"], s["input"], s["output"], hash_ids(s["input"], seed))]
    lengths = [f"{i},{o},{i + o},{float(i / o)!r}" for i, o in zip(s["input"], s["output"])]
    return [
        _write(out_dir / "azure_sample.csv", ["TIMESTAMP,ContextTokens,GeneratedTokens", *azure]),
        _write(out_dir / "burstgpt_sample.csv",
               ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type", *burstgpt]),
        _write(out_dir / "mooncake_sample.jsonl", mooncake),
        _write(out_dir / "lengths_sample.csv",
               ["num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio", *lengths]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output folder (default: traces/samples/)")
    for path in write_samples(parser.parse_args().out):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

"""The leaderboard: every policy on every scenario, serving capacity by bisection, metrics at fixed loads.

Outputs in ``out``: ``leaderboard.md`` (capacity table, best in bold, and per-scenario metrics at the default
rate), ``runs.parquet`` and ``runs.csv`` (every run), ``attainment_<scenario>.png`` (attainment vs load per
policy), ``meta.json`` (versions, code hash, seeds, engine preset, policy parameters, run time) and ``cache/``
(one file per run, so a re-run computes only what changed; Ctrl-C keeps what completed).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from slogym.leaderboard.capacity import CapacitySearch
from slogym.leaderboard.sweep import InputFingerprints, RunCache, Runner, RunSpec, code_version

LOAD_FACTORS = (0.5, 1.0, 1.5)


@dataclass
class BoardConfig:
    scenarios: list[str]
    policies: list[str]
    seeds: list[int]
    n_requests: int
    min_duration: float = 60.0  # seconds of arrivals per run at least: short bursts would drain within loose SLOs
    max_requests: int = 3000  # ...but no more requests than this (high-rate runs of loose-SLO scenarios)
    engine: str = "llama3-8b-h100"
    threshold: float = 0.9
    iters: int = 6
    max_expand: int = 4
    trace: str | None = None
    attainment: str = "dslo"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls, scenarios: list[str], policies: list[str]) -> "BoardConfig":
        """The ``make run`` board: one seed, >= 200 requests and >= 15 s of arrivals per run, three bisection
        steps. Capacities are indicative (within ~1/8 of the bracket); the full board is the reference."""
        return cls(scenarios, policies, seeds=[0], n_requests=200, min_duration=15.0, iters=3, max_expand=3)

    @classmethod
    def full(cls, scenarios: list[str], policies: list[str]) -> "BoardConfig":
        """The reference board: three seeds, >= 400 requests and >= 60 s of arrivals per run, six bisection steps."""
        return cls(scenarios, policies, seeds=[0, 1, 2], n_requests=400, min_duration=60.0, iters=6, max_expand=4)


def default_rate(scenario: str) -> float:
    from slogym.workloads.scenarios import SCENARIOS

    return float(SCENARIOS[scenario].default_rate)


def agent_setting(policy: str) -> dict[str, Any] | None:
    """For ``agent:<name>``: the scenario and cluster size it was trained for (it runs nowhere else)."""
    if not policy.startswith("agent:"):
        return None
    from slogym.agents import read_metadata

    kw = read_metadata(policy.split(":", 1)[1])["env_kwargs"]
    return {"scenario": kw["scenario"], "n_instances": int(kw.get("n_instances", 1))}


CLUSTER_SIZE = 4
"""Replicas for policies that need a cluster (P/D disaggregation, tier pools): capacity is for the whole cluster."""


def replicas(policy: str) -> int:
    """Cluster size a policy runs on: an agent's training size, ``CLUSTER_SIZE`` for cluster-only baselines, else 1."""
    from slogym.baselines import MIN_INSTANCES

    setting = agent_setting(policy)
    if setting is not None:
        return setting["n_instances"]
    return CLUSTER_SIZE if policy in MIN_INSTANCES else 1


def _runs_on(policy: str, scenario: str) -> bool:
    setting = agent_setting(policy)
    return setting is None or setting["scenario"] == scenario


def _specs(cfg: BoardConfig, policy: str, scenario: str, rate: float) -> list[RunSpec]:
    n = min(max(cfg.n_requests, int(np.ceil(rate * cfg.min_duration))), max(cfg.max_requests, cfg.n_requests))
    inst = replicas(policy)
    return [RunSpec(policy, scenario, float(rate), s, n, cfg.engine, n_instances=inst, trace=cfg.trace,
                    attainment=cfg.attainment) for s in cfg.seeds]


def run_board(cfg: BoardConfig, runner: Runner) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Fixed-load runs plus one capacity search per (policy, scenario), advanced together round by round.
    Returns (every run, capacity per policy and scenario)."""
    pairs = [(p, sc) for p in cfg.policies for sc in cfg.scenarios if _runs_on(p, sc)]
    fixed = [s for p, sc in pairs for f in LOAD_FACTORS for s in _specs(cfg, p, sc, f * default_rate(sc))]
    rows = runner.run(fixed)
    searches = {(p, sc): CapacitySearch(default_rate(sc), cfg.threshold, cfg.iters, cfg.max_expand)
                for p, sc in pairs}
    while True:
        active = [(k, s) for k, s in searches.items() if not s.done]
        if not active:
            break
        batch = {k: _specs(cfg, k[0], k[1], s.next_rate()) for k, s in active}
        got = runner.run([spec for specs in batch.values() for spec in specs])
        rows += got
        i = 0
        for k, s in active:
            n = len(batch[k])
            s.update(float(np.mean([r["attainment"] for r in got[i:i + n]])))
            i += n
    df = pd.DataFrame(rows).drop_duplicates(subset=["policy", "scenario", "rate", "seed"])
    cap = pd.DataFrame([{"policy": p, "scenario": sc, "capacity": s.capacity, "censored": s.censored,
                         "fail_rate": np.nan if s.fail_rate is None else s.fail_rate}
                        for (p, sc), s in searches.items()])
    return df.reset_index(drop=True), cap


def round_sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits (rates written to CSV: 3.4000000000000004 -> 3.4)."""
    return float(f"{x:.{digits}g}") if np.isfinite(x) else x


def _bold_best(table: pd.DataFrame, fmt: str = "{:.2f}", censored: pd.DataFrame | None = None,
               bound: pd.DataFrame | None = None) -> pd.DataFrame:
    """``table`` formatted with ``fmt``, the best one-replica value of each column (higher is better) in bold.

    Values are compared as displayed (rounded by ``fmt``), so values shown alike are bold alike. With
    ``censored`` (``"above"`` / ``"below"`` / ``""`` per cell, :attr:`CapacitySearch.censored`) a value censored
    above shows as ``>= x`` and is a lower bound: it is bold only if x is strictly above every uncensored
    one-replica value of its column (and is the highest such bound); an uncensored value is bold if it is the
    highest uncensored value and no censored value is bold. A value censored below shows as ``< y``, y its
    ``bound`` (the lowest rate tried), and is never bold."""
    out = table.copy().astype(object)
    single = [replicas(str(p)) == 1 for p in table.index]
    for col in table.columns:
        shown = [fmt.format(float(v)) if np.isfinite(float(v)) else "n/a" for v in table[col]]
        vals = [float(t) if t != "n/a" else np.nan for t in shown]  # compared as displayed: shown ties bold alike
        cens = [""] * len(shown) if censored is None else [c if isinstance(c, str) else "" for c in censored[col]]
        # multi-replica rows are not compared with one replica
        ranked = [i for i, one in enumerate(single) if one and np.isfinite(vals[i])]
        measured = [vals[i] for i in ranked if cens[i] == ""]
        bounds = [vals[i] for i in ranked if cens[i] == "above"]
        top = max(measured, default=-np.inf)
        if bounds and max(bounds) > top:
            best, kind = max(bounds), "above"
        else:
            best, kind = top, ""
        cells = []
        for i, (text, c) in enumerate(zip(shown, cens)):
            bold = i in ranked and c == kind and np.isfinite(best) and vals[i] == best
            if c == "above":
                text = ">= " + text
            elif c == "below":
                text = "< " + (fmt.format(float(bound[col].iloc[i])) if bound is not None else text)
            cells.append(f"**{text}**" if bold else text)
        out[col] = cells
    return out


def _label(policy: str) -> str:
    """Row label; policies run on several replicas say so (their capacity is for the whole cluster)."""
    n = replicas(policy)
    return f"{policy} ({n} replicas)" if n > 1 else policy


def _md(table: pd.DataFrame) -> str:
    cols = [table.index.name or ""] + [str(c) for c in table.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join([_label(str(i))] + [str(v) for v in row]) + " |" for i, row in table.iterrows()]
    return "\n".join(lines)


def markdown(df: pd.DataFrame, capacity: pd.DataFrame, cfg: BoardConfig, meta: dict[str, Any]) -> str:
    cap, censored, bound = (capacity.pivot(index="policy", columns="scenario", values=v)
                            .reindex(index=cfg.policies, columns=cfg.scenarios)
                            for v in ("capacity", "censored", "fail_rate"))
    at_default = df[np.isclose(df["rate"], df["scenario"].map(default_rate))]
    mean = at_default.groupby(["policy", "scenario"])[["attainment", "goodput", "user_service_gain_rate",
                                                      "sa_objective"]].mean()
    parts = [
        "# slogym leaderboard",
        f"Engine `{cfg.engine}`, attainment mode `{cfg.attainment}`, seeds {cfg.seeds}, at least {cfg.n_requests} "
        f"requests and {cfg.min_duration:.0f} s of arrivals per run (at most {cfg.max_requests} requests), "
        + (f"trace `{cfg.trace}` (sha256 {meta['inputs']['trace']['sha256'][:12]}), " if cfg.trace else "")
        + f"code `{meta['code_version']}`, slogym {meta['versions']['slogym']}, built in {meta['wall_seconds']:.0f} s.",
        f"## Serving capacity (req/s with >= {cfg.threshold:.0%} attainment; higher is better)",
        "Bisection over the arrival rate starting at each scenario's default rate; attainment averaged over seeds. "
        "Learned agents (`agent:<name>`) run only on the scenario and cluster size they were trained for; "
        f"cluster-only baselines (P/D, tier pools) on {CLUSTER_SIZE} replicas. Bold marks the best one-replica row. "
        f"The doubling stops after {cfg.max_expand} doublings ({2 ** cfg.max_expand}x the default rate): `>= x` "
        "means attainment still met the threshold there (a lower bound, bold only if above every measured value); "
        "`< y` means even the lowest rate tried, y, missed it (never bold).",
        _md(_bold_best(cap, censored=censored, bound=bound)),
    ]
    for metric, title, fmt in (("attainment", "Attainment at the default rate (each LLM call scored)", "{:.3f}"),
                               ("goodput", "Goodput at the default rate (LLM calls/s within SLO)", "{:.2f}"),
                               ("user_service_gain_rate", "Tempo service gain per second at the default rate (Eq. 2; "
                                "a collective request counts once)", "{:.0f}"),
                               ("sa_objective", "SA objective (attainment / mean latency) at the default rate",
                                "{:.3f}")):
        t = mean[metric].unstack("scenario").reindex(index=cfg.policies, columns=cfg.scenarios)
        parts += [f"## {title}", _md(_bold_best(t, fmt=fmt))]
    return "\n\n".join(parts) + "\n"


def plots(df: pd.DataFrame, cap: pd.DataFrame, cfg: BoardConfig, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for sc in cfg.scenarios:
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
        for p in cfg.policies:
            d = df[(df["scenario"] == sc) & (df["policy"] == p)].groupby("rate")["attainment"].mean()
            if len(d):
                line, = ax.plot(d.index, d.values, "o-", ms=3, label=p)
                c = float(cap[(cap["policy"] == p) & (cap["scenario"] == sc)]["capacity"].iloc[0])
                ax.axvline(c, color=line.get_color(), ls=":", lw=0.8)
        ax.axhline(cfg.threshold, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_title(f"{sc} on {cfg.engine}")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"attainment_{sc}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def resolved(cfg: BoardConfig) -> BoardConfig:
    """``cfg`` with the trace and an engine preset file as absolute paths (runs read the same file whatever the
    working directory of the worker, and ``meta.json`` names it)."""
    engine = str(Path(cfg.engine).resolve()) if cfg.engine.endswith(".json") else cfg.engine
    trace = None if cfg.trace is None else str(Path(cfg.trace).resolve())
    return dataclasses.replace(cfg, engine=engine, trace=trace)


def trace_rows(path: str) -> int:
    """Requests in a trace file as runs replay it (rows the reader drops, e.g. BurstGPT failures, not counted)."""
    from slogym.workloads.readers import read_trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return len(read_trace(path).input_tokens)


def check_trace_length(cfg: BoardConfig) -> None:
    """Warn (one line) when the trace has fewer rows than the board's requests per run: runs replay the whole
    trace and stop there, so they would silently run fewer requests than the board says."""
    if cfg.trace is None:
        return
    rows = trace_rows(cfg.trace)
    if rows < cfg.n_requests:
        warnings.warn(f"trace {cfg.trace} has {rows} rows, fewer than the board's {cfg.n_requests} requests per "
                      f"run: every run replays only those {rows}", UserWarning, stacklevel=3)


def input_record(cfg: BoardConfig, inputs: InputFingerprints) -> dict[str, Any]:
    """What the runs read outside slogym's code, with the content hashes in their cache keys."""
    return {"engine": {"name": cfg.engine, "sha256": inputs.engine(cfg.engine)},
            "trace": None if cfg.trace is None else {"path": cfg.trace, "sha256": inputs.trace(cfg.trace)},
            "agents": {p: {"sha256": inputs.agent(p)} for p in cfg.policies if p.startswith("agent:")}}


OPTIONAL_PACKAGES = ("numba", "pyarrow", "torch", "stable-baselines3", "sb3-contrib", "ray")
"""Distributions whose versions ``meta.json`` records when they are installed."""


def package_versions() -> dict[str, str]:
    """Versions of slogym, Python and the packages a run may use (optional ones only where installed)."""
    from importlib import metadata as importlib_metadata

    import gymnasium

    import slogym

    versions = {"slogym": slogym.__version__, "python": platform.python_version(), "numpy": np.__version__,
                "pandas": pd.__version__, "gymnasium": gymnasium.__version__}
    for dist in OPTIONAL_PACKAGES:
        try:
            versions[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            pass
    return versions


def metadata(cfg: BoardConfig, wall: float, inputs: InputFingerprints | None = None) -> dict[str, Any]:
    from slogym.baselines import make_policy
    from slogym.engines import get_engine

    inputs = inputs or InputFingerprints()
    eng = get_engine(cfg.engine)
    params: dict[str, dict[str, Any]] = {}
    for p in cfg.policies:
        if p.startswith("agent:"):  # learned: its parameters are the checkpoint's weights
            from slogym.agents import checkpoint_dir

            params[p] = {"checkpoint": str(checkpoint_dir() / f"{p.split(':', 1)[1]}.zip"),
                         "checkpoint_sha256": inputs.agent(p)}
        else:
            params[p] = {k: v for k, v in make_policy(p, eng).params.items()}
    return {
        "code_version": code_version(),
        "versions": package_versions(),
        "config": {k: v for k, v in cfg.__dict__.items()},
        "engine_preset": eng.to_dict(),
        "inputs": input_record(cfg, inputs),
        "policy_params": params,
        "wall_seconds": wall,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_tables(df: pd.DataFrame, cap: pd.DataFrame, out: Path) -> None:
    """``runs.parquet`` (exact), ``runs.csv`` and ``capacity.csv`` (rates to 6 significant digits: bisection
    midpoints such as 3.4000000000000004 are written 3.4)."""
    df.to_parquet(out / "runs.parquet", index=False)
    df.assign(rate=df["rate"].map(round_sig)).to_csv(out / "runs.csv", index=False)
    cap.assign(capacity=cap["capacity"].map(round_sig), fail_rate=cap["fail_rate"].map(round_sig)).to_csv(
        out / "capacity.csv", index=False)


def build(cfg: BoardConfig, out: Path, workers: int = 2, ray: bool = False, ray_address: str | None = None,
          progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Run (or resume) the board and write every output; returns the runs, the capacities, the Markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = resolved(cfg)
    check_trace_length(cfg)
    cache = RunCache(out / "cache", inputs=InputFingerprints())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit="run", desc="leaderboard", leave=False)
    runner = Runner(cache, workers, ray, ray_address, progress=bar.update if bar else None)
    t0 = time.perf_counter()
    try:
        df, cap = run_board(cfg, runner)
    finally:
        if bar is not None:
            bar.close()
    meta = metadata(cfg, time.perf_counter() - t0, cache.inputs)
    meta["cache"] = {"hits": cache.hits, "computed": cache.misses}
    write_tables(df, cap, out)
    md = markdown(df, cap, cfg, meta)
    (out / "leaderboard.md").write_text(md)
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    plots(df, cap, cfg, out)
    return df, cap, md

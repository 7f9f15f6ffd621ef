"""Runs of the leaderboard: one run = (policy, scenario, rate, seed) on an engine, cached on disk.

A run is a pure function of its :class:`RunSpec`, the code version (a hash of slogym's source files and
presets) and the content of the files it reads outside the package (:class:`InputFingerprints`: the trace
file, the engine preset, a learned agent's checkpoint), so results are cached under that key and a re-run
computes only what changed. Runs execute in a local process pool or as Ray tasks; both call :func:`execute` and
give identical results.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import slogym

SUMMARY_KEYS = ("attainment", "goodput", "throughput", "service_gain", "service_gain_rate", "sa_objective",
                "user_attainment", "user_goodput", "user_service_gain_rate",
                "cost_instance_seconds", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "ttlt_p50", "ttlt_p99",
                "preemptions", "n_requests", "sim_seconds", "wall_seconds")


@dataclass(frozen=True)
class RunSpec:
    policy: str
    scenario: str
    rate: float
    seed: int
    n_requests: int
    engine: str = "llama3-8b-h100"
    n_instances: int = 1
    trace: str | None = None
    attainment: str = "dslo"
    params: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    def key(self, version: str, inputs: dict[str, str | None] | None = None) -> str:
        """Cache key: the spec and the code version; with ``inputs`` (:meth:`InputFingerprints.of`) the engine
        and trace fields are replaced by their content hashes, so a preset named or given as a file with the same
        content shares runs, and a changed trace, preset or checkpoint never returns a stale run."""
        fields = asdict(self)
        if inputs is not None:
            fields |= inputs
        blob = json.dumps([fields, version], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class InputFingerprints:
    """Content hashes of what a run reads outside slogym's own source (which :func:`code_version` covers):
    the trace file's bytes, the loaded engine preset (``EngineSpec.to_dict()``, so a shipped name and a file with
    the same content are alike) and a learned agent's checkpoint (``<name>.zip`` and ``<name>.json`` in
    :func:`slogym.agents.checkpoint_dir`). Each is computed once per instance (one instance per board)."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, str], str] = {}

    def _get(self, kind: str, name: str, compute: Callable[[], str]) -> str:
        if (kind, name) not in self._memo:
            self._memo[(kind, name)] = compute()
        return self._memo[(kind, name)]

    def trace(self, path: str) -> str:
        """SHA-256 of the trace file (keyed by its absolute path)."""
        absolute = str(Path(path).resolve())
        return self._get("trace", absolute, lambda: sha256_file(absolute))

    def engine(self, name: str) -> str:
        """SHA-256 of the preset's ``to_dict()`` as sorted JSON."""
        def compute() -> str:
            from slogym.engines import get_engine

            blob = json.dumps(get_engine(name).to_dict(), sort_keys=True, default=str)
            return hashlib.sha256(blob.encode()).hexdigest()

        key = str(Path(name).resolve()) if name.endswith(".json") else name
        return self._get("engine", key, compute)

    def agent(self, policy: str) -> str:
        """SHA-256 over agent ``agent:<name>``'s checkpoint files (``.zip`` then ``.json``)."""
        def compute() -> str:
            from slogym.agents import checkpoint_dir

            base = checkpoint_dir() / policy.split(":", 1)[1]
            h = hashlib.sha256()
            for p in (base.with_suffix(".zip"), base.with_suffix(".json")):
                h.update(sha256_file(p).encode())
            return h.hexdigest()

        return self._get("agent", policy, compute)

    def of(self, spec: RunSpec) -> dict[str, str | None]:
        """The fingerprints replacing ``spec``'s engine, trace and (for agents) policy fields in its cache key."""
        fp: dict[str, str | None] = {"engine": self.engine(spec.engine),
                                     "trace": None if spec.trace is None else self.trace(spec.trace)}
        if spec.policy.startswith("agent:"):
            fp["policy"] = f"{spec.policy}@{self.agent(spec.policy)}"
        return fp

    def recorded(self) -> dict[str, dict[str, str]]:
        """Every fingerprint computed so far: ``{kind: {name or absolute path: sha256}}`` (for ``meta.json``)."""
        out: dict[str, dict[str, str]] = {}
        for (kind, name), sha in sorted(self._memo.items()):
            out.setdefault(kind, {})[name] = sha
        return out


@lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of every source file and preset of the installed slogym package."""
    root = Path(slogym.__file__).parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".json") and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def make_policy_for(spec: RunSpec, engine: Any) -> Any:
    """A baseline by name, or a shipped learned agent (``agent:<name>``)."""
    if spec.policy.startswith("agent:"):
        from slogym import agents

        return agents.load(spec.policy.split(":", 1)[1])
    from slogym.baselines import make_policy

    return make_policy(spec.policy, engine, **dict(spec.params))


def execute(spec: RunSpec) -> dict[str, Any]:
    """Run one spec; returns a flat dict (spec fields + summary metrics)."""
    from slogym.core.simulator import Simulator
    from slogym.engines import get_engine
    from slogym.workloads.scenarios import make_workload

    eng = get_engine(spec.engine)
    w = make_workload(spec.scenario, rate=spec.rate, n_requests=spec.n_requests, seed=spec.seed, trace=spec.trace,
                      engine=eng)
    sim = Simulator(w, eng, make_policy_for(spec, eng), spec.n_instances, seed=spec.seed,
                    attainment=spec.attainment).run()
    s = sim.result().summary
    return _spec_fields(spec) | {k: s[k] for k in SUMMARY_KEYS}


def _spec_fields(spec: RunSpec) -> dict[str, Any]:
    """The spec's fields of a run's row (``attainment`` is left to the summary metric of that name)."""
    row = {k: v for k, v in asdict(spec).items() if k not in SUMMARY_KEYS}
    row["params"] = json.dumps(dict(spec.params), sort_keys=True)
    return row


class RunCache:
    """One JSON file per run under ``directory`` keyed by spec + code version + input fingerprints."""

    def __init__(self, directory: Path, version: str | None = None, inputs: InputFingerprints | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.version = version or code_version()
        self.inputs = inputs or InputFingerprints()
        self.hits = 0
        self.misses = 0

    def _path(self, spec: RunSpec) -> Path:
        return self.dir / f"{spec.key(self.version, self.inputs.of(spec))}.json"

    def get(self, spec: RunSpec) -> dict[str, Any] | None:
        """The cached row of ``spec`` (its spec fields as given now: a hit may come from a run of equal content
        under another trace path or engine spelling), or None."""
        p = self._path(spec)
        if not p.exists():
            return None
        self.hits += 1
        return json.loads(p.read_text()) | _spec_fields(spec)

    def put(self, spec: RunSpec, row: dict[str, Any]) -> None:
        p = self._path(spec)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, default=float))
        os.replace(tmp, p)  # atomic: an interrupted write never leaves a half file


def _ray_execute(specs: list[RunSpec], address: str | None) -> Iterable[tuple[RunSpec, dict[str, Any]]]:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, num_cpus=None if address else 2, include_dashboard=False,
                 ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(execute)
    pending = {remote.remote(s): s for s in specs}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        ref = done[0]
        yield pending.pop(ref), ray.get(ref)


def _pool_execute(specs: list[RunSpec], workers: int) -> Iterable[tuple[RunSpec, dict[str, Any]]]:
    if workers <= 1:
        for s in specs:
            yield s, execute(s)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(execute, s): s for s in specs}
        for fut in as_completed(futures):
            yield futures[fut], fut.result()


class Runner:
    """Evaluates batches of specs through the cache with the chosen backend."""

    def __init__(self, cache: RunCache, workers: int = 2, ray: bool = False, ray_address: str | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.cache, self.workers, self.ray, self.ray_address = cache, workers, ray, ray_address
        self.progress = progress

    def run(self, specs: Iterable[RunSpec]) -> list[dict[str, Any]]:
        specs = list(dict.fromkeys(specs))
        rows: dict[RunSpec, dict[str, Any]] = {}
        todo = []
        for s in specs:
            hit = self.cache.get(s)
            if hit is None:
                todo.append(s)
            else:
                rows[s] = hit
        self.cache.misses += len(todo)
        stream = _ray_execute(todo, self.ray_address) if self.ray else _pool_execute(todo, self.workers)
        for s, row in stream:
            self.cache.put(s, row)
            rows[s] = row
            if self.progress:
                self.progress(1)
        return [rows[s] for s in specs]

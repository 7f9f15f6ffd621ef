"""Profile a live engine: sweep batch compositions and record one row per measured iteration.

The sweep follows HyperFlexis App. A (prefill batches over batch sizes x input lengths; decode steps over batch
sizes x context lengths), scaled to the engine's limits, plus mixed chunked-prefill batches (a prefill chunk
riding along a decode batch, the Sarathi/SLOs-Serve regime). Rows have the :class:`BatchFeatures` columns and
``time_s`` (the step's wall, CPU or normalized CPU time, per ``EngineConfig.timing``) -- exactly what
:func:`slogym.engines.fitting.fit_perf_model` (``slogym profile fit``) reads -- plus ``kind`` (prefill / decode /
mixed), ``pass``, and the raw ``cpu_s`` / ``speed`` (the ``norm`` factor) / ``wall_s`` / ``speed_ops`` of the
visit's median step (diagnosis, and :func:`retime`). Features are computed by the simulator's own feature
function, so a model fitted on these rows sees the same numbers in simulation.

Deviation from App. A: the paper profiles batch sizes up to 192 and inputs up to 2020 tokens on an NPU; the
default grid stops at the engine's ``max_num_seqs`` / ``max_num_batched_tokens`` / KV pool (a tiny CPU model
would take minutes per point otherwise). ``warmup`` unmeasured iterations run before each point;
:func:`warm_shapes` optionally runs every batch token count once first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from slogym.core.batch import BatchFeatures
from slogym.core.kernels import batch_features
from slogym.core.state import I_COLS, I_NC, I_NT
from slogym.engines.live.client import BATCH_KINDS, VLLMEngine, batch_kind

# HyperFlexis App. A grid (batch sizes, input lengths), cut to each engine's limits at run time
APP_A_BATCH = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192)
APP_A_LENGTHS = (4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 284, 512, 768, 1024, 1536, 2020)
SMALL_DECODE = (3, 5, 6, 7)
"""Decode batch sizes added to App. A's: served replays at moderate load are mostly decode steps of 1-8 requests,
and there the engine's time is not linear in the batch size (on the live vLLM CPU engine a decode step of 2 cost
more than one of 4, one of 3 less than the line through 2 and 4 predicts); ``phase-quadratic-pwl`` places a
knot at each profiled token count. Swept at every other context length (the context term is pinned by the
other sizes)."""
PREEMPTED = 1.05
"""A step whose wall time exceeds its CPU time by this factor counts as preempted (:func:`norm_exponents`)."""
DECODE_SETTLE = 8
"""Unmeasured decode steps of a decode visit's batch before its warm-up: the first steps after a batch formed
cost more (vLLM's persistent batch, caches); measured on the live engine, decode steps 3-5 after formation were
1-6 % dearer than steps 20-40 and the fitted model 2-5 % high on the live decode steps. With the warm-up and
measured steps it stays within the 16 KV tokens the grid reserves per decoding request."""


@dataclass
class ProfileGrid:
    """Batch compositions to measure.

    prefill   (batch size, input length): one iteration prefilling that many whole prompts
    decode    (batch size, context length): ``repeats`` decode steps of that many requests at that context
              (App. A's batch sizes plus :data:`SMALL_DECODE`)
    mixed     (decode batch, decode context, prefill chunk, past): a prefill chunk of a prompt whose first ``past``
              tokens are already computed (0: a first chunk; > 0: a continuation, as chunked prefill runs them)
              plus one decode step of each request of the decode batch
    """

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[tuple[int, int]] = field(default_factory=list)
    mixed: list[tuple[int, int, int, int]] = field(default_factory=list)

    @classmethod
    def app_a(cls, max_seqs: int, max_tokens: int, kv_tokens: int, max_len: int,
              quick: bool = False) -> "ProfileGrid":
        """HyperFlexis App. A's grid within the limits; ``quick`` keeps every other value (CI, smoke runs)."""
        bs = [b for b in APP_A_BATCH if b <= max_seqs]
        ls = [n for n in APP_A_LENGTHS if n < max_len]
        if quick:
            bs, ls = bs[::2], ls[1::3]
        prefill = [(b, n) for b in bs for n in ls if b * n <= max_tokens and b * (n + 1) <= kv_tokens]
        ctx = [n for n in ls if n >= 16]
        small = [(b, n) for b in SMALL_DECODE if b <= max_seqs for n in ctx[:: 4 if quick else 2]]
        decode = sorted([(b, n) for b in bs for n in ctx] + small)
        decode = [(b, n) for b, n in decode if b * (n + 16) <= kv_tokens]
        chunks = [c for c in (32, 128, 512, 1024) if c <= max_tokens // 2][:: 2 if quick else 1]
        mixed = [(b, n, c, past) for b in bs[1::2] for n in ctx[::2] for c in chunks for past in (0, 2 * c)
                 if b * (n + 16) + past + 4 * c + 1 <= kv_tokens and b + c <= max_tokens and b < max_seqs
                 and past + 4 * c < max_len]
        return cls(prefill, decode, mixed)

    def __len__(self) -> int:
        return len(self.prefill) + len(self.decode) + len(self.mixed)


class _Driver:
    """Token ledger of the profiler's requests (the simulator's vLLM-v1 semantics: a chunk that reaches the
    known tokens samples one more) and the plans sent to the engine."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.prompt: dict[int, int] = {}
        self.nc: dict[int, int] = {}
        self.nt: dict[int, int] = {}
        self._pending: list[tuple[int, int, int]] = []
        self._next = 0
        self.last: dict[str, Any] = {}  # the last step's reply (raw CPU time, norm factor)

    def new(self, prompt: int, max_out: int) -> int:
        rid = self._next
        self._next += 1
        self.prompt[rid], self.nc[rid], self.nt[rid] = prompt, 0, prompt
        self._pending.append((rid, prompt, max_out))
        return rid

    def step(self, items: list[tuple[int, int]]) -> tuple[float, BatchFeatures]:
        rid = np.array([r for r, _ in items], np.int64)
        tok = np.array([n for _, n in items], np.int64)
        nc = np.array([self.nc[r] for r in rid.tolist()], np.int64)
        nt = np.array([self.nt[r] for r in rid.tolist()], np.int64)
        table = np.zeros((rid.size, len(I_COLS)), np.int64)
        table[:, I_NC], table[:, I_NT] = nc, nt
        no_spec, blocks = np.zeros(rid.size, np.int64), np.empty(rid.size, np.int64)
        *f, _ = batch_features(table, np.arange(rid.size), tok, no_spec, 1, blocks)
        feats = BatchFeatures(*f)
        add, self._pending = self._pending, []
        reply = self.last = self.engine.step(list(zip(rid.tolist(), tok.tolist(), nc.tolist(), nt.tolist())),
                                             add=add)
        for r, n in items:
            self.nc[r] += n
            if self.nc[r] == self.nt[r]:
                self.nt[r] += 1
        return self.engine.duration(reply, batch_kind(feats.prefill_tokens, feats.decode_seqs)), feats

    def release(self, rids: list[int] | None = None) -> None:
        """Abort ``rids`` (default: all) in the engine and forget them."""
        rids = list(self.nc) if rids is None else rids
        if rids:
            self.engine.abort(rids)
        for r in rids:
            for m in (self.prompt, self.nc, self.nt):
                m.pop(r)

    def prefill_all(self, rids: list[int], budget: int) -> None:
        """Prefill ``rids`` completely in as few chunked iterations as ``budget`` tokens allow."""
        while True:
            items, left = [], budget
            for r in rids:
                n = min(self.prompt[r] - self.nc[r], left)
                if n > 0:
                    items.append((r, n))
                    left -= n
            if not items:
                return
            self.step(items)


def warm_shapes(engine: VLLMEngine, upto: int | None = None) -> None:
    """Run one prefill batch of every token count 1..``upto`` (default ``max_num_batched_tokens``).

    vLLM's CPU path pays a large one-time cost the first time it sees a batch of a new token count (~2x the
    step on the tiny model: per-shape kernel setup); a long-running server has seen them all. Without this,
    profiles (which repeat a shape) and live runs (which keep meeting new ones) measure different engines."""
    d = _Driver(engine)
    longest = engine.config.max_model_len - 1
    for n in range(1, (upto or engine.config.max_num_batched_tokens) + 1):
        parts = [longest] * (n // longest) + ([n % longest] if n % longest else [])
        rids = [d.new(p, 1) for p in parts]
        d.step(list(zip(rids, parts)))
        d.release(rids)


def repeat_noise(engine: VLLMEngine, n: int = 100, batch: int = 16, context: int = 256,
                 chunk: int = 128) -> dict[str, float]:
    """The measurement-noise floor: for each kind of :func:`repeat_ratios`, the mean ``|t / median - 1|`` in %
    of the engine's iteration time (its ``timing``). No perf model can have a smaller per-iteration error than
    this on the same machine at the same moment."""
    return noise_pct(repeat_ratios(engine, n, batch, context, chunk))


def noise_pct(ratios: dict[str, np.ndarray]) -> dict[str, float]:
    """Per kind, the mean ``|t / median - 1|`` in % of repeat ratios (:func:`repeat_ratios`)."""
    return {k: float(np.mean(np.abs(r - 1.0)) * 100.0) for k, r in ratios.items()}


def repeat_ratios(engine: VLLMEngine, n: int = 100, batch: int = 16, context: int = 256,
                  chunk: int = 128) -> dict[str, np.ndarray]:
    """``n`` back-to-back repeats of one decode batch (``batch`` requests at ``context``), one prefill of
    ``chunk`` tokens and one mixed batch (both together); for each kind, every repeat's time / their median."""
    cfg = engine.config
    need = context + 2 * n + 4  # tokens each decoding request reaches
    if (n < 1 or need > cfg.max_model_len or batch * need + 2 * chunk > cfg.num_blocks * cfg.block_size
            or batch + 1 > cfg.max_num_seqs or batch + chunk > cfg.max_num_batched_tokens):
        raise ValueError(f"repeat_ratios(n={n}, batch={batch}, context={context}, chunk={chunk}) does not fit the "
                         f"engine (max_model_len={cfg.max_model_len}, KV {cfg.num_blocks}x{cfg.block_size}, "
                         f"max_num_seqs={cfg.max_num_seqs}, max_num_batched_tokens={cfg.max_num_batched_tokens})")
    d = _Driver(engine)
    out: dict[str, np.ndarray] = {}

    def spread(times: list[float]) -> np.ndarray:
        t = np.asarray(times)
        return t / np.median(t)

    def prefill_once() -> float:
        p = d.new(chunk, 1)
        dt = d.step([(p, chunk)])[0]
        d.release([p])
        return dt

    out["prefill"] = spread([prefill_once() for _ in range(n)])
    rids = [d.new(context, 2 * n + 4) for _ in range(batch)]
    d.prefill_all(rids, cfg.max_num_batched_tokens)
    out["decode"] = spread([d.step([(r, 1) for r in rids])[0] for _ in range(n)])

    def mixed_once() -> float:
        p = d.new(chunk + 1, 1)
        dt = d.step([(r, 1) for r in rids] + [(p, chunk)])[0]
        d.release([p])
        return dt

    out["mixed"] = spread([mixed_once() for _ in range(n)])
    d.release()
    return out


def check_visits(repeats: int, warmup: int, measure: int) -> None:
    """The visit rule of :func:`profile` (``ValueError`` naming the values): callers check it before an engine
    starts."""
    if repeats < 1 or warmup < 0 or measure < 1 or measure % 2 == 0 or warmup + measure > 7:
        raise ValueError(f"repeats={repeats} must be >= 1, warmup={warmup} >= 0, measure={measure} odd >= 1 and "
                         "warmup + measure <= 7 (a mixed visit takes two decode tokens per iteration; the grid "
                         "reserves 16 KV tokens per decoding request)")


def profile(engine: VLLMEngine, grid: ProfileGrid | None = None, repeats: int = 3, warmup: int = 2,
            progress: Callable[[str], None] | None = None, warm: bool = False, seed: int = 0,
            measure: int = 1) -> pd.DataFrame:
    """Measure every composition of ``grid`` (default: App. A within the engine's limits) on ``engine``.

    Returns the records: BatchFeatures columns, ``time_s``, ``kind`` and ``pass``. The grid is swept ``repeats``
    times (passes), each pass in its own seeded random order, and each visit measures one iteration after
    ``warmup`` unmeasured ones of the same composition (``measure`` > 1: the median time of that many
    back-to-back measured iterations, odd, with the middle one's features); repeats of one batch are therefore
    minutes apart, so a shared machine's load phases spread over all compositions instead of lining up with some (use
    :func:`aggregate` for one median row per composition). Each visit starts from an empty engine; its setup
    iterations (prefilling a decode batch's context) are not recorded. ``warm`` first runs :func:`warm_shapes`."""
    cfg = engine.config
    kv_tokens = cfg.num_blocks * cfg.block_size
    if grid is None:
        grid = ProfileGrid.app_a(cfg.max_num_seqs, cfg.max_num_batched_tokens, kv_tokens, cfg.max_model_len)
    check_visits(repeats, warmup, measure)
    if warm:
        if progress is not None:
            progress(f"warming up batch shapes 1..{cfg.max_num_batched_tokens} tokens")
        warm_shapes(engine)
    d = _Driver(engine)
    rows: list[dict[str, Any]] = []
    points = [("prefill", p) for p in grid.prefill] + [("decode", p) for p in grid.decode] + \
             [("mixed", p) for p in grid.mixed]
    rng = np.random.default_rng(seed)
    for rep in range(repeats):
        for k, j in enumerate(rng.permutation(len(points))):
            kind, point = points[j]
            if progress is not None:
                progress(f"pass {rep + 1}/{repeats} [{k + 1}/{len(points)}] {kind} {point}")
            dt, f, raw = _visit(d, kind, point, warmup, measure, cfg.max_num_batched_tokens)
            rows.append({"kind": kind, **{k: int(v) for k, v in zip(BatchFeatures._fields, f)}, "time_s": dt,
                         "pass": rep, **raw})
    return pd.DataFrame(rows, columns=["kind", *BatchFeatures._fields, "time_s", "pass", "cpu_s", "speed",
                                       "wall_s", "speed_ops"])


def _visit(d: _Driver, kind: str, point: tuple[int, ...], warmup: int, measure: int,
           budget: int) -> tuple[float, BatchFeatures, dict[str, float]]:
    """``warmup`` + ``measure`` iterations of one composition from an empty engine; returns the measured ones'
    median time, the middle one's features and the medians of their raw ``cpu_s`` and ``speed``.

    A decode batch first runs :data:`DECODE_SETTLE` unmeasured steps. Every prefill or mixed iteration is
    preceded by the step that precedes it in serving: a decode step. A prefill batch follows
    a one-token decode step of a resident request (not in the measured batch; none when the batch already has
    ``max_num_seqs`` prompts), as in vLLM's schedule where a prefill interrupts running decodes; a mixed batch
    follows a decode step of its own decode batch (a continuation chunk: the mixed step with its first chunk),
    as under chunked prefill. Why: an iteration's ``norm`` time depends on the step before it -- the reference
    kernel sampled right before the step runs slower after a big prefill -- so prefills measured back to back
    came out 4-18 % cheaper than the same prefill after a decode step (raw CPU time within 1-5 %), and the
    fitted model was 9-17 % low on the live engine's prefill-only and mixed batches."""
    steps: list[tuple[float, BatchFeatures]] = []
    raw: list[tuple[float, ...]] = []

    def step(items: list[tuple[int, int]]) -> None:
        steps.append(d.step(items))
        raw.append((float(d.last["cpu_s"]), float(d.last["speed"]), float(d.last["time_s"]),
                    float(d.last.get("speed_ops", 1.0))))

    iters = warmup + measure
    if kind == "prefill":
        b, n = point
        cfg, bs = d.engine.config, d.engine.config.block_size
        # the decode request that gives each prefill its serving context, when a sequence slot and KV are left
        room = b < cfg.max_num_seqs and b * -(-(n + 1) // bs) + -(-(16 + iters + 2) // bs) <= cfg.num_blocks
        ctx = [d.new(16, iters + 2)] if room else []
        d.prefill_all(ctx, budget)
        for _ in range(iters):
            if ctx:
                d.step([(ctx[0], 1)])
            rids = [d.new(n, 1) for _ in range(b)]
            step([(r, n) for r in rids])
            d.release(rids)
        d.release()
        return _median_step(steps[warmup:], raw[warmup:])
    b, n = point[0], point[1]
    chunk, past = (point[2], point[3]) if kind == "mixed" else (0, 0)
    rids = [d.new(n, (2 * iters if chunk else DECODE_SETTLE + iters) + 2) for _ in range(b)]
    d.prefill_all(rids, budget)
    if not chunk:  # a decode batch settles first: served decode steps mostly follow many of the same batch
        for _ in range(DECODE_SETTLE):
            d.step([(r, 1) for r in rids])
    for _ in range(iters):
        items = [(r, 1) for r in rids]
        if chunk:
            p = d.new(past + chunk + 1, 1)
            # the step before: the decode batch alone, or with the prompt's first chunk (a continuation follows it)
            d.step(items + ([(p, past)] if past else []))
            items = [(r, 1) for r in rids] + [(p, chunk)]
        step(items)
        if chunk:
            d.release([p])
    d.release()
    return _median_step(steps[warmup:], raw[warmup:])


def _median_step(steps: list[tuple[float, BatchFeatures]],
                 raw: list[tuple[float, ...]]) -> tuple[float, BatchFeatures, dict[str, float]]:
    """The median time of ``steps`` (an odd count) with the middle step's features: fixed per composition (a
    decode context grows by one token per step), so repeats of a composition in other passes aggregate
    together. ``cpu_s`` / ``speed`` (/ ``wall_s`` / ``speed_ops``) are the raw CPU time, ``norm`` factor, wall
    time and diagnostic factor of the median-time step itself, so :func:`retime` can recompute the row under
    other ``norm`` exponents."""
    times = [t for t, _ in steps]
    k = int(np.argsort(times, kind="stable")[len(times) // 2])
    names = ("cpu_s", "speed", "wall_s", "speed_ops")
    return float(times[k]), steps[len(steps) // 2][1], dict(zip(names, map(float, raw[k])))


def norm_exponents(records: pd.DataFrame, min_pairs: int = 20,
                   min_preempted: int = 20) -> tuple[dict[str, float], dict[str, float]]:
    """Per batch kind, the ``norm`` timing's two exponents (``EngineConfig.norm_elasticity`` / ``norm_preempt``)
    fitted on profile rows: ``log cpu_s = c_composition - e * log speed + b * log max(wall_s / cpu_s, 1)``
    within compositions (each composition's own means removed: a fixed-effects regression over the visits of
    different passes), ``e`` clipped to [0, 2] and ``b`` to [0, 1].

    ``e``, the speed elasticity, is how strongly the step's CPU time follows the reference kernel's speed: 1 is
    the plain ``norm`` timing. On the shared VM the two do not always slow alike: in runs where the machine's
    state swung the kernel's speed 2-3x, identical steps followed it with ``e`` 0.4-0.8, so ``cpu_s * speed``
    over-corrected and spread identical steps by 8-11 %. ``b`` prices preemption inside the step: a step the OS
    descheduled (wall time over CPU time) pays cache refills after the other processes ran, which the kernel
    sampled outside the step cannot see (on the fidelity replays, 10-50 % of the steps under load, +2..+7 %
    median CPU time). Least-squares slopes are what a predictor wants of noisy regressors (attenuation
    included). A kind with fewer than ``min_pairs`` visits in repeated compositions or no spread in the factor
    (``cpu`` / ``wall`` timing) gets no ``e`` (1 is used); ``b`` is fitted only where at least
    ``min_preempted`` of those visits were preempted (wall / CPU > :data:`PREEMPTED`), else none (0 is used).
    See docs/live_engine.md, "Speed elasticity"."""
    key = ["kind", *BatchFeatures._fields]
    elasticity: dict[str, float] = {}
    preempt: dict[str, float] = {}
    for kind in BATCH_KINDS:
        d = records[records["kind"] == kind]
        grp = d.groupby(key, sort=False).ngroup()
        rep = grp.map(grp.value_counts()) >= 2
        d, grp = d[rep], grp[rep]
        if len(d) < min_pairs:
            continue
        cols = {"e": -np.log(d["speed"])}
        if "wall_s" in d and int((d["wall_s"] > PREEMPTED * d["cpu_s"]).sum()) >= min_preempted:
            cols["b"] = np.log(np.maximum(d["wall_s"] / d["cpu_s"], 1.0))
        x = np.stack([v - v.groupby(grp).transform("mean") for v in cols.values()], axis=1)
        y = np.log(d["cpu_s"]) - np.log(d["cpu_s"]).groupby(grp).transform("mean")
        if float((x[:, 0] ** 2).sum()) <= 1e-12:
            continue
        coef = dict(zip(cols, np.linalg.lstsq(x, y.to_numpy(), rcond=None)[0].tolist()))
        elasticity[kind] = float(np.clip(coef["e"], 0.0, 2.0))
        if "b" in coef:
            preempt[kind] = float(np.clip(coef["b"], 0.0, 1.0))
    return elasticity, preempt


def retime(records: pd.DataFrame, elasticity: dict[str, float],
           preempt: dict[str, float] | None = None) -> pd.DataFrame:
    """``records`` (profile rows or live iterations with ``cpu_s``, ``speed`` and, for ``preempt``, ``wall_s``)
    with ``time_s`` recomputed as the ``norm`` time under these exponents (kind -> exponent; missing kinds:
    ``e = 1``, ``b = 0``): ``cpu_s * speed ** e * max(wall_s / cpu_s, 1) ** -b``
    (:meth:`~slogym.engines.live.client.VLLMEngine.duration`). Rows without a ``kind`` column get theirs from
    their features."""
    kind = (records["kind"] if "kind" in records else
            pd.Series([batch_kind(p, d) for p, d in zip(records["prefill_tokens"], records["decode_seqs"])],
                      index=records.index))
    e = kind.map(lambda k: elasticity.get(k, 1.0)).astype(float)
    t = records["cpu_s"] * records["speed"] ** e
    if preempt:
        b = kind.map(lambda k: preempt.get(k, 0.0)).astype(float)
        t = t * np.maximum(records["wall_s"] / records["cpu_s"], 1.0) ** -b
    return records.assign(time_s=t)


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per composition (kind + features) with the median ``time_s`` of its repeats and their count."""
    key = ["kind", *BatchFeatures._fields]
    g = df.groupby(key, sort=False)["time_s"]
    return pd.concat([g.median(), g.size().rename("n")], axis=1).reset_index()

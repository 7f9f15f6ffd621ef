"""Registry of published multi-SLO serving scenarios, generated as seeded, vectorized :class:`Workload` s.

Every scenario reproduces a workload from one of the reference papers (see ``docs/scenarios.md``): its request
mix, token-length statistics, SLOs and arrival process. Lengths are drawn from two-parameter distributions
fitted to the published statistics (:class:`LengthDist`); what each fit matches is recorded on the object.

SLO presets (``slo=``): ``"paper"`` is the published assignment. SLOs-Serve scenarios also accept ``"tight"`` /
``"loose"`` (every stage gets the Table 3 tight or loose SLO instead of the per-stage Table 1 mix). A float
multiplies every SLO (TTFT, TPOT, TTLT) of the ``"paper"`` assignment, for SLO-scale sweeps.

SLOs-Serve TTFT SLOs are *relative* (Table 3: max TTFT slowdown vs. zero load), so they are converted to
seconds with the idle prefill time of the serving engine: ``engine.batch_time`` when an engine is given,
otherwise :func:`idle_prefill_time`'s analytic llama3-8b-h100 estimate.

Rates are requests/s of user-level arrivals for ONE replica of llama3-8b-h100; a Tempo collective arrival counts
once and expands into its LLM calls (6 rows for a tree of thoughts, 3-7 for a code-generation chain).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Union

import numpy as np

from slogym.core.batch import BatchFeatures
from slogym.core.request import INF, StageKind, Workload
from slogym.workloads import arrivals as arr

__all__ = [
    "LengthDist", "App", "ChatApp", "ReasoningApp", "ToolApp", "CollectiveApp", "ChainApp", "TieredApp", "ScenarioSpec",
    "SCENARIOS", "list_scenarios", "make_workload", "idle_prefill_time", "idle_decode_time",
]

#: SLOs-Serve Table 3: TTFT slowdown vs. zero-load, and max TPOT (s), per SLO class.
SLOWDOWN = {"tight": 3.0, "loose": 5.0}
TPOT = {"tight": 0.050, "loose": 0.100}

#: standard-normal quantiles of the percentiles used below
_Z = {0.25: -0.6744898, 0.5: 0.0, 0.75: 0.6744898, 0.9: 1.2815516, 0.95: 1.6448536, 0.99: 2.3263479}

SloValue = Union[float, str]  # seconds, or an SLOs-Serve class name ("tight"/"loose") resolved per preset


# ---------------------------------------------------------------------------------------------- engine timing
def idle_prefill_time(tokens: np.ndarray, past: np.ndarray | int = 0, engine: Any = None) -> np.ndarray:
    """Zero-load time (s) to prefill ``tokens`` new tokens on top of ``past`` cached ones.

    With ``engine`` (anything with ``batch_time(BatchFeatures)``) the engine's own model is used. Without one,
    a rough llama3-8b-h100 roofline: 8 ms fixed (weight read + launch) + 29 us/token (16 GFLOP/token at
    ~550 TFLOP/s) + 0.48 ns per attention token pair. Documented as an estimate, not a profile.
    """
    n = np.asarray(tokens, dtype=np.int64)
    p = np.broadcast_to(np.asarray(past, dtype=np.int64), n.shape)
    if engine is not None:
        f = BatchFeatures.build(prefill_tokens=n, prefill_seqs=1, prefill_attn=n * (p + n), prefill_sq=n * n,
                                kv_tokens=p + n)
        return np.asarray(engine.batch_time(f), dtype=np.float64).reshape(n.shape)
    return 0.008 + 2.9e-5 * n + 4.8e-10 * n * (p + n)


def idle_decode_time(context: np.ndarray, engine: Any = None) -> np.ndarray:
    """Zero-load time (s) of one decode step of a single request with ``context`` KV tokens.

    Without ``engine``: 6.5 ms (weights) + 39 ns/token (128 KiB of KV per token at 3.35 TB/s), llama3-8b-h100.
    """
    c = np.asarray(context, dtype=np.int64)
    if engine is not None:
        f = BatchFeatures.build(decode_seqs=1, decode_tokens=1, decode_ctx=c, kv_tokens=c + 1)
        return np.asarray(engine.batch_time(f), dtype=np.float64).reshape(c.shape)
    return 0.0065 + 3.9e-8 * c


# ---------------------------------------------------------------------------------------------- lengths
def _weibull_shape(cv: float) -> float:
    """Weibull shape k with coefficient of variation ``cv`` (bisection; cv decreases in k)."""
    def cv_of(k: float) -> float:
        g1, g2 = math.gamma(1 + 1 / k), math.gamma(1 + 2 / k)
        return math.sqrt(g2 / (g1 * g1) - 1)

    lo, hi = 0.1, 50.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cv_of(mid) > cv else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution fitted to published statistics; samples are rounded and clipped to [lo, hi].

    family     "lognormal" (params mu, sigma), "weibull" (k, scale) or "quantile" (knots: probs then log values,
               piecewise log-linear inverse CDF through the published percentiles)
    published  the table's statistics (keys mean, std, p25..p99) -- tests compare samples to these
    fitted_on  the statistics the fit reproduces exactly (before rounding/clipping)
    """

    family: str
    params: tuple[float, ...]
    published: Mapping[str, float]
    fitted_on: tuple[str, ...]
    lo: int = 1
    hi: int | None = None

    @classmethod
    def moments(cls, mean: float, std: float, *, lo: int = 1, hi: int | None = None,
                **published: float) -> "LengthDist":
        """Match ``mean`` and ``std`` with a lognormal or a Weibull; when published percentiles (p50, p95, p99)
        are given, take the family whose fitted percentiles are closer to them (sum of absolute log ratios)."""
        cv = std / mean
        s2 = math.log1p(cv * cv)
        logn = cls("lognormal", (math.log(mean) - s2 / 2, math.sqrt(s2)), {}, ("mean", "std"), lo, hi)
        k = _weibull_shape(cv)
        weib = cls("weibull", (k, mean / math.gamma(1 + 1 / k)), {}, ("mean", "std"), lo, hi)
        qs = [(int(k[1:]) / 100, v) for k, v in published.items() if k in ("p50", "p95", "p99")]
        best = min((logn, weib), key=lambda d: sum(abs(math.log(d.ppf(p) / v)) for p, v in qs))
        return cls(best.family, best.params, {"mean": mean, "std": std, **published}, best.fitted_on, lo, hi)

    @classmethod
    def quantiles(cls, points: Mapping[float, float], lo: int, hi: int) -> "LengthDist":
        """Piecewise log-linear quantile function through ``points`` ({prob: value}) and (0, lo), (1, hi)."""
        probs = (0.0, *sorted(points), 1.0)
        vals = (float(lo), *(float(points[p]) for p in sorted(points)), float(hi))
        pub = {f"p{round(p * 100)}": float(points[p]) for p in sorted(points)}
        return cls("quantile", (*probs, *np.log(vals)), pub, tuple(pub), lo, hi)

    def ppf(self, p: float) -> float:
        """The fitted (unrounded, unclipped) ``p``-quantile."""
        if self.family == "lognormal":
            mu, sigma = self.params
            z = _Z.get(p)
            if z is None:
                raise ValueError(f"ppf supports p in {sorted(_Z)}, got {p!r}")
            return math.exp(mu + sigma * z)
        if self.family == "weibull":
            k, lam = self.params
            return lam * (-math.log1p(-p)) ** (1 / k)
        m = len(self.params) // 2
        return float(np.exp(np.interp(p, self.params[:m], self.params[m:])))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths (int64)."""
        if self.family == "lognormal":
            x = np.exp(rng.normal(self.params[0], self.params[1], n))
        elif self.family == "weibull":
            x = self.params[1] * rng.weibull(self.params[0], n)
        else:
            m = len(self.params) // 2
            x = np.exp(np.interp(rng.random(n), self.params[:m], self.params[m:]))
        return np.clip(np.rint(x), self.lo, self.hi if self.hi is not None else np.inf).astype(np.int64)


# ---------------------------------------------------------------------------------------------- workload parts
@dataclass
class _Part:
    """Requests of one app, CSR stages, before merging: per-request and per-stage arrays."""

    arrival: np.ndarray
    nstage: np.ndarray
    kind: np.ndarray
    tokens: np.ndarray
    delay: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    tier: np.ndarray
    tier_names: list[str]
    ttlt: np.ndarray
    priority: int = 0
    best_effort: np.ndarray | None = None
    group: np.ndarray | None = None
    group_stage: np.ndarray | None = None


@dataclass
class _Ctx:
    """Generation context: rng, SLO preset and engine."""

    rng: np.random.Generator
    slo: str | float
    engine: Any

    def _cls(self, v: str) -> str:
        """SLOs-Serve class of a stage under the preset ("tight"/"loose" override every stage)."""
        return self.slo if isinstance(self.slo, str) and self.slo != "paper" else v

    @property
    def factor(self) -> float:
        return float(self.slo) if not isinstance(self.slo, str) else 1.0

    def ttft(self, v: SloValue, tokens: np.ndarray, past: np.ndarray | int = 0) -> np.ndarray:
        """TTFT seconds: absolute, or an SLOs-Serve slowdown class times the idle prefill time."""
        if isinstance(v, str):
            return SLOWDOWN[self._cls(v)] * self.factor * idle_prefill_time(tokens, past, self.engine)
        return np.full(np.shape(tokens), v * self.factor)

    def tpot(self, v: SloValue, n: int) -> np.ndarray:
        return np.full(n, (TPOT[self._cls(v)] if isinstance(v, str) else v) * self.factor)


def _two_stage_part(arrival: np.ndarray, inp: np.ndarray, out: np.ndarray, ttft: np.ndarray, tpot: np.ndarray,
                    ttlt: float, tier_name: str, priority: int = 0) -> _Part:
    n = arrival.shape[0]
    kind = np.tile(np.array([StageKind.PREFILL, StageKind.DECODE], dtype=np.int8), n)
    tokens = np.column_stack([inp, out]).ravel()
    return _Part(arrival, np.full(n, 2), kind, tokens, np.zeros(2 * n),
                 np.column_stack([ttft, np.full(n, INF)]).ravel(), np.column_stack([np.full(n, INF), tpot]).ravel(),
                 np.zeros(n, np.int32), [tier_name], np.full(n, ttlt), priority=priority)


@dataclass(frozen=True)
class App:
    """One application class of a scenario: name, share of arrivals, priority, and how its requests look.

    ``ttft``/``tpot`` are the SLOs of its first prefill and final decode (what a trace row gets); ``ttlt`` its
    end-to-end deadline. Subclasses add stages; :meth:`build` makes the requests for given arrival times.
    """

    name: str
    weight: float
    input: LengthDist
    output: LengthDist
    ttft: SloValue = INF
    tpot: SloValue = INF
    ttlt: float = INF
    priority: int = 0
    tier: str = "default"

    def slo_values(self) -> tuple[SloValue, ...]:
        """Every stage SLO of the app, in stage order (names the tier of SLOs-Serve apps)."""
        return (self.ttft, self.tpot)

    def tier_name(self, ctx: _Ctx) -> str:
        """``tier``, or for SLOs-Serve apps the resolved classes ("tight", "loose", "loose/tight", ...)."""
        classes = [ctx._cls(v) for v in self.slo_values() if isinstance(v, str)]
        if not classes:
            return self.tier
        return classes[0] if len(set(classes)) == 1 else "/".join(classes)

    def build(self, arrival: np.ndarray, ctx: _Ctx) -> _Part:
        n = arrival.shape[0]
        return self.build_lengths(arrival, self.input.sample(ctx.rng, n), self.output.sample(ctx.rng, n), ctx)

    def build_lengths(self, arrival: np.ndarray, inp: np.ndarray, out: np.ndarray, ctx: _Ctx) -> _Part:
        """Prefill+decode requests with given lengths (trace rows use this for every app)."""
        return _two_stage_part(arrival, inp, out, ctx.ttft(self.ttft, inp), ctx.tpot(self.tpot, inp.shape[0]),
                               self.ttlt * ctx.factor, self.tier_name(ctx), self.priority)


class ChatApp(App):
    """prefill(n_in, ttft) + decode(n_out, tpot) requests (chat, code, summarization, QA)."""


@dataclass(frozen=True)
class ReasoningApp(App):
    """prefill, decode(thinking, ``think_tpot``), decode(response, ``tpot``) -- SLOs-Serve Table 1/4 "Reasoning".

    ``output`` is the response length; ``thinking`` the thinking length.
    """

    thinking: LengthDist | None = None
    think_tpot: SloValue = "tight"

    def slo_values(self) -> tuple[SloValue, ...]:
        return (self.ttft, self.think_tpot, self.tpot)

    def build(self, arrival: np.ndarray, ctx: _Ctx) -> _Part:
        n, rng = arrival.shape[0], ctx.rng
        inp, think, resp = self.input.sample(rng, n), self.thinking.sample(rng, n), self.output.sample(rng, n)
        kind = np.tile(np.array([StageKind.PREFILL, StageKind.DECODE, StageKind.DECODE], dtype=np.int8), n)
        ttft = np.column_stack([ctx.ttft(self.ttft, inp), np.full((n, 2), INF)]).ravel()
        tpot = np.column_stack([np.full(n, INF), ctx.tpot(self.think_tpot, n), ctx.tpot(self.tpot, n)]).ravel()
        return _Part(arrival, np.full(n, 3), kind, np.column_stack([inp, think, resp]).ravel(), np.zeros(3 * n),
                     ttft, tpot, np.zeros(n, np.int32), [self.tier_name(ctx)],
                     np.full(n, self.ttlt * ctx.factor), self.priority)


@dataclass(frozen=True)
class ToolApp(App):
    """LLM-with-tools loop (SLOs-Serve Table 1/4 "ToolLLM"): K prefill-decode pairs joined by tool calls,
    prefill, decode, [external(delay), prefill, decode] * (K - 1), with K = round(Normal(pairs_mean, pairs_std))
    clipped to >= 1. Every prefill/decode length is drawn independently from ``input``/``output``; loop stages
    (every prefill, every decode but the last) get ``loop_ttft``/``loop_tpot``, the final decode ``tpot``.
    Tool delays are lognormal with median ``delay_median`` s and coefficient of variation ``delay_cv``.
    """

    pairs_mean: float = 2.7
    pairs_std: float = 1.1
    loop_ttft: SloValue = "tight"
    loop_tpot: SloValue = "tight"
    delay_median: float = 1.0
    delay_cv: float = 1.0

    def slo_values(self) -> tuple[SloValue, ...]:
        return (self.ttft, self.loop_tpot, self.loop_ttft, self.tpot)

    def build(self, arrival: np.ndarray, ctx: _Ctx) -> _Part:
        n, rng = arrival.shape[0], ctx.rng
        pairs = np.maximum(np.rint(rng.normal(self.pairs_mean, self.pairs_std, n)), 1).astype(np.int64)
        nstage = 3 * pairs - 1
        total = int(nstage.sum())
        start = np.concatenate(([0], np.cumsum(nstage)[:-1]))
        j = np.arange(total) - np.repeat(start, nstage)  # stage index within its request
        phase = np.where(j == 0, 2, (j - 1) % 3)  # 0 decode, 1 external, 2 prefill
        kind = np.array([StageKind.DECODE, StageKind.EXTERNAL, StageKind.PREFILL], dtype=np.int8)[phase]
        is_p, is_d = kind == StageKind.PREFILL, kind == StageKind.DECODE
        tokens = np.zeros(total, np.int64)
        tokens[is_p] = self.input.sample(rng, int(is_p.sum()))
        tokens[is_d] = self.output.sample(rng, int(is_d.sum()))
        # context before each stage = tokens of all earlier stages of the request
        csum = np.cumsum(tokens)
        past = csum - tokens - np.repeat(csum[start] - tokens[start], nstage)
        ttft = np.full(total, INF)
        first = j == 0
        ttft[first] = ctx.ttft(self.ttft, tokens[first])
        loop_p = is_p & ~first
        ttft[loop_p] = ctx.ttft(self.loop_ttft, tokens[loop_p], past[loop_p])
        last = np.zeros(total, bool)
        last[start + nstage - 1] = True
        tpot = np.full(total, INF)
        tpot[is_d & ~last] = ctx.tpot(self.loop_tpot, int((is_d & ~last).sum()))
        tpot[last] = ctx.tpot(self.tpot, n)
        delay = np.zeros(total)
        is_e = kind == StageKind.EXTERNAL
        sigma = math.sqrt(math.log1p(self.delay_cv ** 2))
        delay[is_e] = self.delay_median * np.exp(sigma * rng.standard_normal(int(is_e.sum())))
        return _Part(arrival, nstage, kind, tokens, delay, ttft, tpot, np.zeros(n, np.int32), [self.tier_name(ctx)],
                     np.full(n, self.ttlt * ctx.factor), self.priority)


def _collective_part(app: App, arrival: np.ndarray, calls: np.ndarray, stage: np.ndarray, inp: np.ndarray,
                     out: np.ndarray, ttlt: np.ndarray, ctx: _Ctx) -> _Part:
    """Rows of collective requests (Tempo §2.1, type 3): group ``i`` (arrival ``arrival[i]``) makes ``calls[i]``
    LLM calls, listed group by group with stage indices ``stage`` and lengths ``inp``/``out``; a call of stage
    ``s > 0`` is released when its group's stage ``s - 1`` has ended. Every call carries the group's arrival
    and end-to-end deadline ``ttlt[i]`` (scaled by the SLO preset)."""
    grp = np.repeat(np.arange(arrival.shape[0], dtype=np.int64), calls)
    m = grp.shape[0]
    part = _two_stage_part(arrival[grp], inp, out, np.full(m, INF), np.full(m, INF), INF, app.tier_name(ctx),
                           app.priority)
    part.ttlt = ttlt[grp] * ctx.factor
    part.group, part.group_stage = grp, stage.astype(np.int32)
    return part


@dataclass(frozen=True)
class CollectiveApp(App):
    """Tempo collective request (§6.1): tree of thoughts of ``depth`` stages x ``width`` thoughts sharing one
    end-to-end deadline ``ttlt_per_stage * depth``. ``input``/``output`` are the *per-collective totals*
    (Tempo Table 2), split over the ``depth * width`` calls with Dirichlet(``split_alpha``) shares.
    """

    depth: int = 2
    width: int = 3
    ttlt_per_stage: float = 20.0
    split_alpha: float = 4.0

    def build(self, arrival: np.ndarray, ctx: _Ctx) -> _Part:
        g, rng, calls = arrival.shape[0], ctx.rng, self.depth * self.width
        shares_in = rng.dirichlet(np.full(calls, self.split_alpha), g)
        shares_out = rng.dirichlet(np.full(calls, self.split_alpha), g)
        inp = np.maximum(np.rint(self.input.sample(rng, g)[:, None] * shares_in), 1).astype(np.int64).ravel()
        out = np.maximum(np.rint(self.output.sample(rng, g)[:, None] * shares_out), 1).astype(np.int64).ravel()
        stage = np.tile(np.repeat(np.arange(self.depth), self.width), g)
        return _collective_part(self, arrival, np.full(g, calls), stage, inp, out,
                                np.full(g, self.ttlt_per_stage * self.depth), ctx)


@dataclass(frozen=True)
class ChainApp(App):
    """Tempo collective request of the chain-style multi-agent kind (§6.1 "agentic code generation workloads
    [69]", Fig. 7 "CodeGen ... chain-style Multi-Agent applications"; §4.1: agents iterate "until a predefined
    confidence threshold is met", so the number of calls is unknown at submission). Modeled on AutoGen's
    code-generation loop [69]: ``k`` rounds of a writer call (writes, then fixes the code) and a safeguard call
    (checks it), then a final writer call that answers -- one call per stage, ``2k + 1`` stages, ``k`` drawn from
    ``rounds`` ({k: probability}; assumption, not published). End-to-end deadline ``ttlt_per_stage`` x stages
    (§6.1).

    Lengths (reconstructed; Tempo publishes only Table 2's per-collective totals, shared by both collective
    kinds): a chain's input and output totals are drawn from ``input``/``output`` and scaled by
    ``stages / E[stages]`` (work grows with the stages, as the deadline does; the mean stays Table 2's), then
    split over the stages with shares proportional to a role weight times Gamma(``split_alpha``) noise:
    output weight ``role_out[0]`` for writer and ``role_out[1]`` for safeguard calls, input weight ``1 + s``
    for stage ``s`` (each agent reads the conversation so far). So stage-time ratios differ from a tree of
    thoughts' even split and between chains of different lengths.
    """

    rounds: Mapping[int, float] = field(default_factory=lambda: {1: 0.4, 2: 0.35, 3: 0.25})
    role_out: tuple[float, float] = (1.0, 0.15)
    ttlt_per_stage: float = 20.0
    split_alpha: float = 4.0

    def build(self, arrival: np.ndarray, ctx: _Ctx) -> _Part:
        g, rng = arrival.shape[0], ctx.rng
        ks = np.array(sorted(self.rounds))
        p = np.array([self.rounds[k] for k in ks], np.float64)
        p /= p.sum()
        calls = 2 * ks[rng.choice(ks.shape[0], g, p=p)] + 1
        scale = calls / float((2 * ks + 1) @ p)
        grp = np.repeat(np.arange(g), calls)
        stage = np.arange(grp.shape[0]) - np.repeat(np.cumsum(calls) - calls, calls)
        w_in = (1.0 + stage) * rng.gamma(self.split_alpha, size=stage.shape[0])
        w_out = np.where(stage % 2 == 0, *self.role_out) * rng.gamma(self.split_alpha, size=stage.shape[0])

        def split(total: np.ndarray, w: np.ndarray) -> np.ndarray:
            share = w / np.bincount(grp, w, minlength=g)[grp]
            return np.maximum(np.rint((total * scale)[grp] * share), 1).astype(np.int64)

        inp, out = split(self.input.sample(rng, g), w_in), split(self.output.sample(rng, g), w_out)
        return _collective_part(self, arrival, calls, stage, inp, out, self.ttlt_per_stage * calls, ctx)


@dataclass(frozen=True)
class TieredApp(App):
    """PolyServe SLO tiers (§5.1): TPOT tier drawn from ``tiers`` ({tpot_s: probability}), TTFT uniformly from
    ``ttft_choices``; tier names ``tpot<ms>``.

    With an engine, only SLOs achievable on an idle server are assigned: the TTFT is raised to the smallest
    choice >= the drawn one that covers the idle prefill time, the TPOT tier to the tightest tier >= the drawn
    one that covers the idle decode step at the final context length; a request with no achievable choice
    becomes best-effort (no SLO, tier ``best_effort``).
    """

    tiers: Mapping[float, float] = field(default_factory=dict)
    ttft_choices: tuple[float, ...] = ()

    def build_lengths(self, arrival: np.ndarray, inp: np.ndarray, out: np.ndarray, ctx: _Ctx) -> _Part:
        rng, n = ctx.rng, arrival.shape[0]
        tp = np.array(sorted(self.tiers)) * ctx.factor
        tier = rng.choice(tp.shape[0], n, p=np.array([self.tiers[t] for t in sorted(self.tiers)]))
        tf = np.array(sorted(self.ttft_choices)) * ctx.factor
        tsel = rng.integers(0, tf.shape[0], n)
        best_effort = np.zeros(n, bool)
        if ctx.engine is not None:
            tsel, ok_f = _bump(tsel, tf, idle_prefill_time(inp, 0, ctx.engine))
            tier, ok_t = _bump(tier, tp, idle_decode_time(inp + out, ctx.engine))
            best_effort = ~(ok_f & ok_t)
        names = [f"tpot{round(t * 1000 / ctx.factor)}" for t in tp] + ["best_effort"]
        part = _two_stage_part(arrival, inp, out, np.where(best_effort, INF, tf[tsel]),
                               np.where(best_effort, INF, tp[tier]), INF, names[0], self.priority)
        part.tier = np.where(best_effort, len(names) - 1, tier).astype(np.int32)
        part.tier_names = names
        part.best_effort = best_effort
        return part


def _bump(idx: np.ndarray, choices: np.ndarray, need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Smallest index >= ``idx`` into ascending ``choices`` with ``choices >= need``; (index, found)."""
    first_ok = np.searchsorted(choices, need, side="left")
    new = np.maximum(idx, first_ok)
    found = new < choices.shape[0]
    return np.minimum(new, choices.shape[0] - 1), found


# ---------------------------------------------------------------------------------------------- assembly
def _assemble(parts: list[_Part], app_of_part: list[int], app_names: list[str], name: str) -> Workload:
    """Merge app parts into one arrival-sorted :class:`Workload` (vectorized CSR reorder)."""
    tier_code: dict[str, int] = {}
    tier_cols, groups, group_off = [], [], 0
    for p in parts:
        codes = np.array([tier_code.setdefault(t, len(tier_code)) for t in p.tier_names], dtype=np.int32)
        tier_cols.append(codes[p.tier])
        g = p.group if p.group is not None else np.full(p.arrival.shape[0], -1, np.int64)
        groups.append(np.where(g >= 0, g + group_off, -1))
        group_off += int(g.max()) + 1 if g.size and g.max() >= 0 else 0

    def cat(attr: str, fill: Any = None, dtype: Any = None) -> np.ndarray:
        cols = [getattr(p, attr) if getattr(p, attr) is not None else np.full(p.arrival.shape[0], fill)
                for p in parts]
        return np.concatenate(cols).astype(dtype) if cols else np.zeros(0, dtype)

    arrival = cat("arrival", dtype=np.float64)
    nstage = cat("nstage", dtype=np.int64)
    order = np.argsort(arrival, kind="stable")
    ptr_old = np.concatenate(([0], np.cumsum(nstage)))
    lens = nstage[order]
    ptr = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    sidx = np.arange(ptr[-1]) - np.repeat(ptr[:-1] - ptr_old[:-1][order], lens)

    def stage(attr: str, dtype: Any) -> np.ndarray:
        return cat(attr, dtype=dtype)[sidx]

    n_per = [p.arrival.shape[0] for p in parts]
    return Workload(
        arrival=arrival[order],
        app=np.repeat(np.array(app_of_part, dtype=np.int32), n_per)[order],
        tier=(np.concatenate(tier_cols) if parts else np.zeros(0, np.int32))[order],
        ttlt=cat("ttlt", dtype=np.float64)[order],
        priority=np.repeat(np.array([p.priority for p in parts], dtype=np.int32), n_per)[order],
        best_effort=cat("best_effort", False, bool)[order],
        stage_ptr=ptr,
        stage_kind=stage("kind", np.int8),
        stage_tokens=stage("tokens", np.int64),
        stage_delay=stage("delay", np.float64),
        stage_ttft=stage("ttft", np.float64),
        stage_tpot=stage("tpot", np.float64),
        app_names=list(app_names),
        tier_names=list(tier_code) or ["default"],
        name=name,
        group=(np.concatenate(groups) if parts else np.zeros(0, np.int64))[order],
        group_stage=cat("group_stage", 0, np.int32)[order],
    )


# ---------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class ScenarioSpec:
    """A published scenario.

    source        paper + table the statistics and SLOs come from
    apps          application classes with their shares of arrivals
    arrival       "poisson", or an :data:`~slogym.workloads.arrivals.PATTERNS` fingerprint ("chat", "code")
    default_rate  requests/s for one llama3-8b-h100 replica: ~80 % of the measured serving capacity of the better
                  of Sarathi and vLLM (docs/scenarios.md "Calibration")
    slo_presets   accepted string values of ``slo=``
    calibration   where ``default_rate`` comes from: engine, measured capacities, date, command
    """

    name: str
    description: str
    source: str
    apps: tuple[App, ...]
    arrival: str
    default_rate: float
    default_n: int
    slo_presets: tuple[str, ...] = ("paper",)
    calibration: str = ""

    def arrivals(self, rate: float, n: int | None, duration: float | None, rng: np.random.Generator) -> np.ndarray:
        if self.arrival == "poisson":
            return arr.poisson(rate, n=n, duration=duration, rng=rng)
        return arr.pattern(self.arrival, rate, n=n, duration=duration, rng=rng)


def _L(mean: float, std: float, **kw: Any) -> LengthDist:
    return LengthDist.moments(mean, std, **kw)


# SLOs-Serve Table 4 (mean, p99, std) and Table 1 per-stage tight/loose classes.
_CHAT = ChatApp("chatbot", 1.0, _L(763, 424, p99=1591), _L(266, 160, p99=619), ttft="loose", tpot="loose")
_CODER = ChatApp("coder", 1.0, _L(847, 617, p99=2010), _L(26, 47, p99=232), ttft="loose", tpot="tight")
_SUMM = ChatApp("summarizer", 1.0, _L(1333, 444, p99=1946), _L(202, 234, p99=1508), ttft="tight", tpot="loose")
_TOOL = ToolApp("toolllm", 1.0, _L(690, 356, p99=2131), _L(116, 66, p99=363), ttft="tight", tpot="loose")
_REASON = ReasoningApp("reasoning", 1.0, _L(127, 83, p99=421), _L(803, 280, p99=1650), ttft="tight",
                       tpot="loose", thinking=_L(4693, 1442, p99=7297), think_tpot="tight")
_SS = "SLOs-Serve (Chen et al. 2025) Tables 1-4"
_SS_PRESETS = ("paper", "tight", "loose")


def _hf(name: str, ttft: float, tpot: float, inp: tuple[float, float], out: tuple[float, float],
        level: int, levels: int) -> ChatApp:
    """HyperFlexis task; paper priority ``P<level>`` (P0 highest) -> Workload priority ``levels - 1 - level``."""
    return ChatApp(name, 1.0, _L(*inp), _L(*out), ttft=ttft, tpot=tpot, priority=levels - 1 - level,
                   tier=f"P{level}")


#: how ``default_rate`` was chosen (docs/scenarios.md "Calibration"; rerun after engine/simulator changes)
CALIBRATION = ("llama3-8b-h100 x1, dslo attainment >= 0.9, 2 seeds x default_n arrivals (>= 60 s), 2026-11-21: "
               "scripts/calibrate_scenarios.py")


def _cal(sarathi: float, vllm: float, note: str = "") -> str:
    """``ScenarioSpec.calibration``: measured capacities (req/s) of Sarathi (budget 512) and vLLM; default
    rate = 0.8 x the better one, 2 significant digits."""
    return f"{CALIBRATION}; capacity sarathi {sarathi:g}, vllm {vllm:g} req/s" + (f"; {note}" if note else "")


_TEMPO_SINGLE_IN = _L(93, 244, p50=27, p95=391)
_TEMPO_SINGLE_OUT = _L(318, 313, p50=225, p95=1024, hi=1024)
_TEMPO_COLL = (_L(1300, 912, p50=1097, p95=2767), _L(4458, 1176, p50=4417, p95=6452))  # per-collective totals
_SA_CAP = 2047  # SA paper §5.1: "request lengths ... restricted to under 2k"

SCENARIOS: dict[str, ScenarioSpec] = {s.name: s for s in (
    ScenarioSpec("chatbot", "ShareGPT chat; loose prefill, loose decode", f"{_SS}: ChatBot",
                 (_CHAT,), "chat", 21.0, 2000, _SS_PRESETS,
                 _cal(14.1, 25.8)),
    ScenarioSpec("coder", "HumanEval coding; loose prefill, tight decode, bursty", f"{_SS}: Coder",
                 (_CODER,), "code", 0.68, 2000, _SS_PRESETS,
                 _cal(0.848, 0.778, "recalibrated 2026-11-21 with the correlated-gap code fingerprint (the earlier "
                                    "Gamma one had no capacity); time-scaled azure_code_2023 replay: sarathi 1.16, "
                                    "vllm 1.32; Poisson: 14.3, 15.6")),
    ScenarioSpec("summarizer", "arXiv summarization; tight prefill, loose decode", f"{_SS}: Summarizer",
                 (_SUMM,), "chat", 7.0, 2000, _SS_PRESETS,
                 _cal(5.19, 8.72)),
    ScenarioSpec("mixed", "ChatBot + Coder + Summarizer, equal shares, each with its own SLOs",
                 f"{_SS}: Mixed", (_CHAT, _CODER, _SUMM), "chat", 11.0, 3000, _SS_PRESETS,
                 _cal(9.51, 13.5)),
    ScenarioSpec("toolllm", "ToolBench agent loop, 2.7 +- 1.1 prefill-decode pairs with tool calls",
                 f"{_SS}: ToolLLM", (_TOOL,), "code", 0.16, 1000, _SS_PRESETS,
                 _cal(0.115, 0.202, "recalibrated 2026-11-21 with the correlated-gap code fingerprint (the earlier "
                                    "Gamma one had no capacity); time-scaled azure_code_2023 replay: sarathi "
                                    "0.105, vllm 0.149; Poisson: 2.18, 3.22")),
    ScenarioSpec("reasoning", "s1K reasoning: tight prefill, tight thinking decode, loose response decode",
                 f"{_SS}: Reasoning", (_REASON,), "chat", 0.6, 500, _SS_PRESETS,
                 _cal(0.406, 0.745)),
    ScenarioSpec("polyserve-tiers", "Azure conversation lengths, TPOT tiers 20/30/50/100 ms at 10/20/30/40%",
                 "PolyServe (Zhu et al. 2025) §5.1 + trace-statistics table (splitwise row)",
                 (TieredApp("chat", 1.0,
                            LengthDist.quantiles({.25: 396, .5: 1019, .75: 1186, .9: 2735, .95: 4083, .99: 4142},
                                                 lo=2, hi=14050),
                            LengthDist.quantiles({.25: 85, .5: 130, .75: 395, .9: 425, .95: 451, .99: 601},
                                                 lo=7, hi=1000),
                            tiers={0.020: 0.1, 0.030: 0.2, 0.050: 0.3, 0.100: 0.4},
                            ttft_choices=(0.3, 0.5, 1.0)),),
                 "poisson", 9.9, 2000, calibration=_cal(12.4, 11.4)),
    ScenarioSpec("hyperflexis-4task", "medical_qa / tldr_content_gen / tldr_headline_gen / wikisql, equal shares",
                 "HyperFlexis (2025) Table 1, §7",
                 (_hf("medical_qa", 0.7, 0.5, (32.57, 10.32), (38.92, 16.83), 0, 4),
                  _hf("tldr_content_gen", 1.0, 0.7, (44.38, 6.58), (96.04, 35.03), 1, 4),
                  _hf("tldr_headline_gen", 2.0, 0.9, (121.82, 35.04), (13.59, 6.55), 2, 4),
                  _hf("wikisql", 20.0, 1.0, (643.22, 337.01), (27.82, 4.84), 3, 4)),
                 "poisson", 95.0, 2000, calibration=_cal(108, 118)),
    ScenarioSpec("hyperflexis-2task", "gsm8k / sharegpt, equal shares", "HyperFlexis (2025) Table 1, §7",
                 (_hf("gsm8k", 0.7, 0.2, (51.44, 15.78), (90.13, 26.73), 0, 2),
                  _hf("sharegpt", 2.0, 0.5, (259.19, 324.88), (207.79, 234.99), 1, 2)),
                 "poisson", 59.0, 2000, calibration=_cal(73.4, 61.7)),
    ScenarioSpec("tempo-mix", "latency-sensitive : throughput-intensive : collective (ToT 2x3 and code-generation "
                              "chains, 1:1 -- an assumption: Tempo gives no shares) = 3:1:1",
                 "Tempo (Zhang et al. 2025) Table 2 (Chatbot workload), §6.1",
                 (ChatApp("latency_sensitive", 3.0, _TEMPO_SINGLE_IN, _TEMPO_SINGLE_OUT, ttft=2.0, tpot=0.1,
                          tier="ttft_tbt"),
                  ChatApp("throughput_intensive", 1.0, _TEMPO_SINGLE_IN, _TEMPO_SINGLE_OUT, ttlt=20.0,
                          tier="ttlt"),
                  CollectiveApp("collective_tot", 0.5, *_TEMPO_COLL, tier="ttlt_collective"),
                  ChainApp("collective_codegen", 0.5, *_TEMPO_COLL, tier="ttlt_collective")),
                 "poisson", 9.2, 1000,
                 calibration=_cal(11.5, 10.1, "measured on the ToT-only collective mix, before the code-generation "
                                              "chains were added (2026-11-22); not re-measured")),
    ScenarioSpec("sa-mix", "ShareGPT chat (TTFT/TPOT) + Python-Code-23k code (end-to-end), 1:1",
                 "SA scheduler (Huang et al. 2025) §5.1; chat lengths from SLOs-Serve Table 4 ChatBot",
                 (ChatApp("chat", 1.0, _L(763, 424, p99=1591, hi=_SA_CAP), _L(266, 160, p99=619, hi=_SA_CAP),
                          ttft=10.0, tpot=0.05, tier="ttft_tpot"),
                  ChatApp("code", 1.0, _L(150, 120, hi=_SA_CAP), _L(150, 120, hi=_SA_CAP), ttlt=30.0,
                          tier="e2e")),
                 "poisson", 32.0, 2000, calibration=_cal(39.7, 39.7)),
)}

# Tempo §6.1 variants of tempo-mix (same 3:1:1 mix and SLOs): the LC-Workload (lighteval-math singles, LC
# collective totals, Table 2 "LC-Workload" rows) and bursty arrivals (the ``code`` fingerprint's correlated gaps, a
# stand-in for BurstGPT [64]). Not calibrated separately: they keep tempo-mix's default rate, so loads given as
# multiples of it (scripts/reproduce/tempo.py) mean the same arrival rate on every variant.
_TEMPO = SCENARIOS["tempo-mix"]
_TEMPO_LC_SINGLE = {"input": _L(76, 100, p50=49, p95=229), "output": _L(482, 236, p50=422, p95=1024, hi=1024)}
_TEMPO_LC_COLL = {"input": _L(1064, 389, p50=983, p95=1713), "output": _L(6744, 819, p50=6703, p95=8120)}
_TEMPO_LC_APPS = (replace(_TEMPO.apps[0], **_TEMPO_LC_SINGLE), replace(_TEMPO.apps[1], **_TEMPO_LC_SINGLE),
                  replace(_TEMPO.apps[2], **_TEMPO_LC_COLL), replace(_TEMPO.apps[3], **_TEMPO_LC_COLL))
_TEMPO_NOTE = "not calibrated separately: tempo-mix's default rate"
for _spec in (
    replace(_TEMPO, name="tempo-mix-lc", description=f"{_TEMPO.description}, LC-Workload lengths",
            source="Tempo (Zhang et al. 2025) Table 2 (LC-Workload), §6.1", apps=_TEMPO_LC_APPS,
            calibration=_TEMPO_NOTE),
    replace(_TEMPO, name="tempo-mix-bursty", description=f"{_TEMPO.description}, bursty arrivals",
            source=f"{_TEMPO.source}; bursty arrivals (BurstGPT stand-in)", arrival="code",
            calibration=_TEMPO_NOTE),
    replace(_TEMPO, name="tempo-mix-lc-bursty",
            description=f"{_TEMPO.description}, LC-Workload lengths, bursty arrivals",
            source="Tempo (Zhang et al. 2025) Table 2 (LC-Workload), §6.1; bursty arrivals (BurstGPT stand-in)",
            apps=_TEMPO_LC_APPS, arrival="code", calibration=_TEMPO_NOTE),
):
    SCENARIOS[_spec.name] = _spec


def list_scenarios() -> list[str]:
    """Registered scenario names."""
    return list(SCENARIOS)


def _load_trace(trace: Any) -> Any:
    if isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        from slogym.workloads.readers import read_trace  # lazy: optional module of the trace reader
        return read_trace(trace)
    return trace


def make_workload(name: str, rate: float | None = None, n_requests: int | None = None,
                  duration: float | None = None, seed: int = 0, trace: Any = None, slo: str | float = "paper",
                  engine: Any = None) -> Workload:
    """Generate scenario ``name`` as a :class:`Workload`.

    rate        user-level arrivals/s (default: the scenario's ``default_rate``); with ``trace`` it rescales the
                trace's timestamps to this mean rate
    n_requests  number of user-level arrivals (default ``default_n`` when neither it nor ``duration`` is given)
    duration    keep arrivals in ``[0, duration)`` s (both bounds may be combined)
    trace       a trace path (read with ``slogym.workloads.readers.read_trace``) or a ``Trace``: its arrivals and
                lengths replace the generated ones; every row becomes one prefill+decode request of an app drawn
                with the scenario's shares and gets that app's first-prefill TTFT, final TPOT and TTLT
                (multi-stage structure is not synthesized). A trace without timestamps gets generated arrivals.
    slo         "paper", another preset in ``spec.slo_presets``, or a float multiplying every paper SLO
    engine      object with ``batch_time(BatchFeatures)``: converts relative TTFTs and applies PolyServe's
                idle-achievability rule
    """
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; valid: {list_scenarios()}")
    spec = SCENARIOS[name]
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive finite number of requests/s, got {rate!r}")
    if n_requests is not None and n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests!r}")
    if duration is not None and not duration >= 0:
        raise ValueError(f"duration must be >= 0, got {duration!r}")
    if isinstance(slo, str):
        if slo not in spec.slo_presets:
            raise ValueError(f"unknown slo {slo!r} for scenario {name!r}; valid: {list(spec.slo_presets)} or a "
                             f"positive float scale")
    elif not (slo > 0 and math.isfinite(slo)):
        raise ValueError(f"slo scale must be a positive finite float, got {slo!r}")
    rng = np.random.default_rng(seed)
    ctx = _Ctx(rng, slo, engine)
    if n_requests is None and duration is None and trace is None:
        n_requests = spec.default_n

    lengths = None
    if trace is not None:
        tr = _load_trace(trace)
        inp, out = np.asarray(tr.input_tokens, np.int64), np.asarray(tr.output_tokens, np.int64)
        if tr.arrival is not None:
            t = arr.replay(tr.arrival, rate)
        else:
            t = spec.arrivals(rate or spec.default_rate, inp.shape[0], None, rng)
        keep = np.ones(t.shape[0], bool) if duration is None else t < duration
        if n_requests is not None:
            keep &= np.cumsum(keep) <= n_requests
        arrival, lengths = t[keep], (np.maximum(inp[keep], 1), np.maximum(out[keep], 1))
    else:
        arrival = spec.arrivals(rate or spec.default_rate, n_requests if duration is None else None, duration, rng)
        if n_requests is not None:
            arrival = arrival[:n_requests]

    weights = np.array([a.weight for a in spec.apps], dtype=np.float64)
    which = rng.choice(len(spec.apps), arrival.shape[0], p=weights / weights.sum())
    parts = []
    for k, app in enumerate(spec.apps):
        sel = which == k
        if lengths is None:
            parts.append(app.build(arrival[sel], ctx))
        else:
            parts.append(app.build_lengths(arrival[sel], lengths[0][sel], lengths[1][sel], ctx))
    return _assemble(parts, list(range(len(spec.apps))), [a.name for a in spec.apps], name)

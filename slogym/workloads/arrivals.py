"""Seeded arrival processes: float64 arrays of arrival times (seconds), sorted, starting near 0.

* :func:`poisson` -- homogeneous Poisson process (PolyServe §5.1, Tempo §6.1, HyperFlexis §7).
* :func:`gamma` -- renewal process with Gamma inter-arrivals of a given coefficient of variation (``cv > 1`` is
  bursty; ``cv = 1`` is Poisson).
* :func:`pattern` -- an *empirical arrival pattern* (SLOs-Serve Table 2 replays the Azure LLM inference traces:
  "Azure-Chatting" is stable, "Azure-Coding" bursty, Fig. 8). The package must run without the trace files, so
  each pattern is a compact **fingerprint** of the trace (statistics only, never the timestamps):

  - ``"chat"`` (:class:`ArrivalPattern`): the per-minute request-rate profile of the trace's first hour
    (normalized to mean 1) plus a within-minute Gamma ``cv`` calibrated so that the process reproduces the
    trace's 1-second count dispersion index. Arrivals are a Gamma renewal process in "operational time" mapped
    through the cumulative rate profile; the profile repeats every hour. Near-Poisson, so its gap distribution
    matches the trace too (:attr:`ArrivalPattern.reference`).
  - ``"code"`` (:class:`CopulaPattern`): a *correlated-gap* process. Inter-arrival gaps follow an embedded
    quantile table of the trace's gaps (39 knots, in units of the mean gap, log-linear interpolation) through a
    Gaussian copula whose latent factor is shared by runs of consecutive gaps (geometric run lengths): gaps of
    20 ms - 1 s cluster into busy periods and long gaps into silences, which is what makes the trace's 1-s and
    10-s count dispersion (13.2 / 71) larger than a renewal process with the same gaps gives (9.3 / 52). Gaps
    below the table's 34 % quantile (~6 ms) are drawn independently, as the trace's ms-scale clumps are short
    (<= 13 arrivals within 10 ms gaps; a fully correlated copula makes them 2-3x longer). The gap marginal --
    the sub-millisecond clumps (17 % of gaps < 1 ms), the 100 ms mode, the multi-minute silences -- is the
    trace's by construction; the copula parameters are calibrated to the dispersion indices.
    A rate change **time-scales** the process (every gap divides by ``rate / trace_rate``), as replaying the
    trace faster or slower does (SLOs-Serve §6), so bursts spread out as the rate drops. ``rate`` is the
    long-run mean; like a window of the time-scaled trace, a short run realizes a random rate.
* :func:`replay`, :func:`scale`, :func:`window` -- rescale and cut real timestamps.

``n`` (number of arrivals) or ``duration`` (seconds) bounds every generator; exactly one must be given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

__all__ = ["ArrivalPattern", "CopulaPattern", "PATTERNS", "poisson", "gamma", "pattern", "replay", "scale", "window"]


def _check_rate(rate: float) -> float:
    rate = float(rate)
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive finite number of requests/s, got {rate!r}")
    return rate


def _renewal(rate: float, cv: float, n: int | None, duration: float | None,
             rng: np.random.Generator) -> np.ndarray:
    """Renewal process with mean rate ``rate`` and Gamma(shape=1/cv^2) gaps; first arrival after one gap."""
    rate = _check_rate(rate)
    cv = float(cv)
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"cv must be a positive finite number, got {cv!r}")
    if (n is None) == (duration is None):
        raise ValueError(f"give exactly one of n={n!r} and duration={duration!r}")
    shape = 1.0 / (cv * cv)

    def gaps(k: int) -> np.ndarray:
        if cv == 1.0:
            return rng.exponential(1.0 / rate, k)
        return rng.gamma(shape, 1.0 / (shape * rate), k)

    if n is not None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n!r}")
        return np.cumsum(gaps(int(n)))
    if not duration >= 0:
        raise ValueError(f"duration must be >= 0, got {duration!r}")
    # draw in chunks until the horizon is passed (expected count + 6 sigma, so usually one chunk)
    expect = rate * duration
    chunk = int(expect + 6.0 * cv * math.sqrt(expect + 1.0) + 16)
    parts, t = [], 0.0
    while t <= duration:
        c = np.cumsum(gaps(chunk)) + t
        parts.append(c)
        t = float(c[-1])
    times = np.concatenate(parts)
    return times[times < duration]


def poisson(rate: float, n: int | None = None, duration: float | None = None,
            rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Poisson arrivals at ``rate`` requests/s: ``n`` of them, or all within ``[0, duration)``."""
    return _renewal(rate, 1.0, n, duration, np.random.default_rng(rng))


def gamma(rate: float, cv: float, n: int | None = None, duration: float | None = None,
          rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Gamma-renewal arrivals: mean rate ``rate``, inter-arrival coefficient of variation ``cv`` (bursty if > 1)."""
    return _renewal(rate, cv, n, duration, np.random.default_rng(rng))


@dataclass(frozen=True)
class ArrivalPattern:
    """Statistical fingerprint of a real arrival trace (see the module docstring).

    profile         relative request rate per ``bin_s`` seconds (mean 1), repeated periodically
    cv              within-bin Gamma inter-arrival cv, calibrated to ``dispersion_1s`` at the trace's own rate
    dispersion_1s   variance/mean of 1-second arrival counts of the trace (reference value)
    trace_rate      the trace's mean rate (requests/s) at which ``dispersion_1s`` was measured
    reference       statistics of the real trace at ``trace_rate`` (see :data:`REFERENCE_KEYS`)
    """

    name: str
    source: str
    profile: tuple[float, ...]
    cv: float
    dispersion_1s: float
    trace_rate: float
    bin_s: float = 60.0
    reference: Mapping[str, float] = field(default_factory=dict)

    def generate(self, rate: float, n: int | None = None, duration: float | None = None,
                 rng: np.random.Generator | int | None = None) -> np.ndarray:
        """Arrivals at long-run mean ``rate`` following this pattern's rate profile and burstiness."""
        rng = np.random.default_rng(rng)
        prof = np.asarray(self.profile, dtype=np.float64)
        prof = prof / prof.mean()
        period = self.bin_s * prof.shape[0]
        # cumulative operational time at bin edges of one period (operational time runs at rate 1 on average)
        edges_t = np.arange(prof.shape[0] + 1) * self.bin_s
        edges_u = np.concatenate(([0.0], np.cumsum(prof) * self.bin_s))
        if duration is not None:
            if not duration >= 0:
                raise ValueError(f"duration must be >= 0, got {duration!r}")
            full, rem = divmod(float(duration), period)
            u_end = full * period + float(np.interp(rem, edges_t, edges_u))
            u = _renewal(rate, self.cv, None, u_end, rng)
        else:
            u = _renewal(rate, self.cv, n, None, rng)
        cycles, frac = np.divmod(u, period)
        # invert the piecewise-linear cumulative profile; flat (zero-rate) bins are skipped by 'right' search
        k = np.clip(np.searchsorted(edges_u, frac, side="right") - 1, 0, prof.shape[0] - 1)
        t = edges_t[k] + (frac - edges_u[k]) / np.maximum(prof[k], 1e-300)
        return np.sort(cycles * period + t)


#: keys of ``reference`` / :func:`gap_statistics`: mean rate (req/s); fractions of inter-arrival gaps below
#: 1 ms, 10 ms, 100 ms; gap percentiles p50/p90/p99 (s); dispersion index (variance / mean) of 1-s and 10-s
#: arrival counts; per-minute counts: fraction of empty minutes and coefficient of variation.
REFERENCE_KEYS = ("rate", "frac_1ms", "frac_10ms", "frac_100ms", "p50", "p90", "p99", "dispersion_1s",
                  "dispersion_10s", "empty_minutes", "cv_minute")


def gap_statistics(times: np.ndarray) -> dict[str, float]:
    """The :data:`REFERENCE_KEYS` statistics of arrival times (seconds; shifted to start at 0; count windows
    are aligned to the first arrival, minutes are whole minutes only)."""
    t = np.sort(np.asarray(times, dtype=np.float64))
    if t.size < 3:
        raise ValueError(f"need >= 3 arrivals for gap statistics, got {t.size}")
    t = t - t[0]
    g = np.diff(t)

    def disp(w: float) -> float:
        c = np.bincount((t / w).astype(np.int64))
        return float(c.var() / c.mean())

    whole = int(t[-1] // 60.0)
    m = np.bincount((t[t < whole * 60.0] / 60.0).astype(np.int64), minlength=whole) if whole else np.zeros(1)
    p50, p90, p99 = np.percentile(g, [50, 90, 99])
    return {"rate": float(g.size / t[-1]), "frac_1ms": float(np.mean(g < 1e-3)),
            "frac_10ms": float(np.mean(g < 1e-2)), "frac_100ms": float(np.mean(g < 0.1)),
            "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "dispersion_1s": disp(1.0), "dispersion_10s": disp(10.0),
            "empty_minutes": float(np.mean(m == 0)), "cv_minute": float(m.std() / max(m.mean(), 1e-300))}


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz & Stegun 7.1.26 erf, |error| < 1.5e-7; numpy only, no scipy)."""
    x = np.abs(z) / math.sqrt(2.0)
    k = 1.0 / (1.0 + 0.3275911 * x)
    poly = k * (0.254829592 + k * (-0.284496736 + k * (1.421413741 + k * (-1.453152027 + k * 1.061405429))))
    half_tail = 0.5 * poly * np.exp(-x * x)  # = 1 - Phi(|z|)
    return np.where(z >= 0, 1.0 - half_tail, half_tail)


@dataclass(frozen=True)
class CopulaPattern:
    """Correlated-gap fingerprint of a bursty trace (see the module docstring).

    gap_probs / gap_quantiles  quantile function of the trace's inter-arrival gaps in units of its mean gap
                    (knots; log-linear interpolation between them)
    rho             share of the Gaussian copula's variance carried by the latent factor (0 = renewal process)
    run_mean        mean number of consecutive gaps sharing one latent factor (geometric run lengths)
    fine_p          gaps below this quantile of the table are drawn independently of the latent factor
    trace_rate      the trace's mean rate (requests/s): at this rate gaps have the trace's absolute values
    reference       statistics of the real trace at ``trace_rate`` (:data:`REFERENCE_KEYS`)
    """

    name: str
    source: str
    gap_probs: tuple[float, ...]
    gap_quantiles: tuple[float, ...]
    rho: float
    run_mean: float
    trace_rate: float
    fine_p: float = 0.0
    reference: Mapping[str, float] = field(default_factory=dict)

    @property
    def dispersion_1s(self) -> float:
        return float(self.reference["dispersion_1s"])

    def gaps(self, k: int, rng: np.random.Generator) -> np.ndarray:
        """``k`` correlated gaps in units of the mean gap (unnormalized draw; mean ~1)."""
        p = np.asarray(self.gap_probs, dtype=np.float64)
        lq = np.log(np.asarray(self.gap_quantiles, dtype=np.float64))
        runs = rng.geometric(1.0 / self.run_mean, int(k / self.run_mean) + 16)
        while runs.sum() < k:  # rare: top up
            runs = np.concatenate((runs, rng.geometric(1.0 / self.run_mean, runs.size)))
        latent = np.repeat(rng.standard_normal(runs.size), runs)[:k]
        z = math.sqrt(self.rho) * latent + math.sqrt(1.0 - self.rho) * rng.standard_normal(k)
        # gaps below the `fine_p` quantile are drawn independently (sub-ms / ms clumps of the trace are short
        # and uncorrelated); the latent factor only modulates the coarser gaps -- the marginal is unchanged
        v = rng.random(k)
        u = np.where(v < self.fine_p, v, self.fine_p + (1.0 - self.fine_p) * _norm_cdf(z))
        j = np.clip(np.searchsorted(p, u, side="right") - 1, 0, p.size - 2)
        w = (u - p[j]) / (p[j + 1] - p[j])
        return np.exp(lq[j] + w * (lq[j + 1] - lq[j]))

    def generate(self, rate: float, n: int | None = None, duration: float | None = None,
                 rng: np.random.Generator | int | None = None) -> np.ndarray:
        """Arrivals at long-run mean ``rate`` (the first after one gap): the trace's gap process time-scaled by
        ``rate / trace_rate``. Like a window of the time-scaled trace, a short run realizes a random rate (a
        run without one of the rare multi-minute silences is denser than ``rate``)."""
        rng = np.random.default_rng(rng)
        rate = _check_rate(rate)
        if (n is None) == (duration is None):
            raise ValueError(f"give exactly one of n={n!r} and duration={duration!r}")
        if n is not None:
            if n < 0:
                raise ValueError(f"n must be >= 0, got {n!r}")
            return np.cumsum(self.gaps(int(n), rng)) / rate
        if not duration >= 0:
            raise ValueError(f"duration must be >= 0, got {duration!r}")
        expect = rate * float(duration)
        parts, t = [], 0.0
        while t <= duration:
            c = np.cumsum(self.gaps(int(1.5 * expect + 64), rng)) / rate + t
            parts.append(c)
            t = float(c[-1])
        times = np.concatenate(parts)
        return times[times < duration]


# "chat": per-minute rate profile of the first 58 minutes of azure_conv_2023 (Azure LLM inference traces 2023,
# Splitwise), normalized to mean 1; cv calibrated by simulation so that generate(trace_rate) reproduces the
# trace's 1-s dispersion index 1.386. "code": quantile function of azure_code_2023's 8818 inter-arrival gaps
# (units of the mean gap 0.3897 s) and copula parameters calibrated by simulation to its 1-s and 10-s
# dispersion indices (scripts/calibrate_scenarios.py --arrival-stats prints real trace vs model).
# ``reference`` values: gap_statistics() of the real traces.
PATTERNS: dict[str, ArrivalPattern | CopulaPattern] = {
    "chat": ArrivalPattern(
        name="chat",
        source="Azure LLM inference trace 2023, conversation (azure_conv_2023): 19366 requests, 5.53 req/s",
        profile=(0.573, 0.795, 0.987, 1.059, 0.921, 0.819, 0.804, 0.783, 0.966, 0.894, 0.903, 0.906, 1.035,
                 0.978, 0.849, 0.837, 0.840, 0.924, 1.029, 1.053, 1.053, 1.029, 1.224, 1.188, 1.158, 1.194,
                 1.296, 1.440, 1.428, 1.359, 1.344, 1.521, 1.314, 1.239, 1.269, 1.254, 1.395, 0.933, 0.987,
                 0.948, 0.999, 1.065, 0.957, 1.080, 1.002, 1.125, 0.990, 0.747, 0.663, 0.747, 0.795, 0.840,
                 0.768, 0.762, 0.726, 0.780, 0.738, 0.675),
        cv=1.07,
        dispersion_1s=1.386,
        trace_rate=5.5304,
        reference={"rate": 5.530, "frac_1ms": 0.01503, "frac_10ms": 0.06884, "frac_100ms": 0.4439,
                   "p50": 0.1184, "p90": 0.4207, "p99": 0.8897, "dispersion_1s": 1.386, "dispersion_10s": 4.003,
                   "empty_minutes": 0.0, "cv_minute": 0.220},
    ),
    "code": CopulaPattern(
        name="code",
        source="Azure LLM inference trace 2023, code (azure_code_2023): 8819 requests, 2.57 req/s",
        gap_probs=(0.0, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.25, 0.3, 0.33, 0.36,
                   0.38, 0.4, 0.42, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98,
                   0.99, 0.995, 0.998, 0.999, 0.9995, 1.0),
        gap_quantiles=(1.54e-05, 5.69e-05, 0.0001078, 0.0001553, 0.0002258, 0.0003362, 0.0005364, 0.001358,
                       0.002133, 0.002414, 0.002695, 0.003039, 0.005331, 0.008449, 0.01101, 0.01539, 0.02149,
                       0.03876, 0.06284, 0.09808, 0.1637, 0.2298, 0.2438, 0.2514, 0.257, 0.2669, 0.4108, 0.5103,
                       0.7003, 0.8021, 1.029, 1.533, 2.05, 5.659, 25.61, 106.3, 203.3, 340.0, 557.3),
        rho=0.7,
        run_mean=12.0,
        trace_rate=2.5664,
        fine_p=0.34,
        reference={"rate": 2.566, "frac_1ms": 0.1703, "frac_10ms": 0.3867, "frac_100ms": 0.6954,
                   "p50": 0.0638, "p90": 0.2729, "p99": 2.205, "dispersion_1s": 13.18, "dispersion_10s": 71.3,
                   "empty_minutes": 0.2105, "cv_minute": 1.041},
    ),
}


def pattern(name: str, rate: float, n: int | None = None, duration: float | None = None,
            rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Arrivals following the fingerprint ``PATTERNS[name]`` ("chat" or "code") at mean ``rate`` requests/s."""
    if name not in PATTERNS:
        raise ValueError(f"unknown arrival pattern {name!r}; valid: {sorted(PATTERNS)}")
    return PATTERNS[name].generate(rate, n=n, duration=duration, rng=rng)


def replay(timestamps: np.ndarray, rate: float | None = None) -> np.ndarray:
    """Sorted timestamps shifted to start at 0 and, if ``rate`` is given, time-scaled to that mean rate.

    The mean rate of ``m`` arrivals spanning ``T`` seconds is taken as ``(m - 1) / T``.
    """
    t = np.sort(np.asarray(timestamps, dtype=np.float64))
    if t.size and not np.all(np.isfinite(t)):
        raise ValueError("timestamps must be finite")
    t = t - t[0] if t.size else t
    if rate is None:
        return t
    rate = _check_rate(rate)
    if t.size < 2 or t[-1] <= 0:
        raise ValueError(f"cannot rescale {t.size} timestamps spanning {t[-1] if t.size else 0.0} s to a rate")
    return scale(t, rate / ((t.size - 1) / t[-1]))


def scale(arrivals: np.ndarray, factor: float) -> np.ndarray:
    """Multiply the arrival *rate* by ``factor`` (times are divided by it; ``factor = 2`` halves every gap)."""
    return np.asarray(arrivals, dtype=np.float64) / _check_rate(factor)


def window(arrivals: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """Arrivals in ``[t0, t1)``, shifted so that ``t0`` becomes 0."""
    if not t1 >= t0:
        raise ValueError(f"window needs t0 <= t1, got t0={t0!r}, t1={t1!r}")
    a = np.asarray(arrivals, dtype=np.float64)
    return a[(a >= t0) & (a < t1)] - t0

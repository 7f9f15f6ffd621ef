"""Seeded arrival processes: float64 arrays of arrival times (seconds), sorted, starting near 0.

* :func:`poisson` -- homogeneous Poisson process (PolyServe §5.1, Tempo §6.1, HyperFlexis §7).
* :func:`gamma` -- renewal process with Gamma inter-arrivals of a given coefficient of variation (``cv > 1`` is
  bursty; ``cv = 1`` is Poisson).
* :func:`pattern` -- an *empirical arrival pattern* (SLOs-Serve Table 2 replays the Azure LLM inference traces:
  "Azure-Chatting" is stable, "Azure-Coding" bursty, Fig. 8). The package must run without the trace files, so
  each pattern is a compact **fingerprint** of the trace, not the trace itself: the per-minute request-rate
  profile of its first hour (normalized to mean 1) plus a within-minute Gamma ``cv`` calibrated so that the
  generated process reproduces the trace's 1-second count dispersion index (variance / mean). Arrivals are a
  Gamma renewal process in "operational time" mapped through the cumulative rate profile (a time change), so the
  long-run mean rate is the requested one and the profile repeats every hour.
* :func:`replay`, :func:`scale`, :func:`window` -- rescale and cut real timestamps.

``n`` (number of arrivals) or ``duration`` (seconds) bounds every generator; exactly one must be given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ArrivalPattern", "PATTERNS", "poisson", "gamma", "pattern", "replay", "scale", "window"]


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
    """

    name: str
    source: str
    profile: tuple[float, ...]
    cv: float
    dispersion_1s: float
    trace_rate: float
    bin_s: float = 60.0

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


# Per-minute rate profiles of the first 58 minutes of the Azure LLM inference traces 2023 (Splitwise), counted
# from azure_conv_2023.csv / azure_code_2023.csv and normalized to mean 1. cv calibrated by simulation so that
# generate(trace_rate) reproduces dispersion_1s (trace values: 1.386 and 13.182).
PATTERNS: dict[str, ArrivalPattern] = {
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
    ),
    "code": ArrivalPattern(
        name="code",
        source="Azure LLM inference trace 2023, code (azure_code_2023): 8819 requests, 2.57 req/s",
        profile=(0.414, 0.000, 0.000, 3.492, 1.230, 0.855, 0.099, 0.276, 0.250, 3.131, 2.769, 0.414, 0.000,
                 0.000, 4.156, 1.966, 0.000, 0.132, 2.604, 2.072, 0.763, 0.513, 2.012, 2.940, 1.657, 0.224,
                 0.842, 0.730, 2.670, 1.539, 0.776, 1.111, 0.855, 2.012, 1.039, 0.000, 2.230, 0.362, 1.874,
                 1.256, 0.000, 0.184, 1.348, 1.611, 0.651, 0.000, 0.000, 0.210, 0.000, 0.000, 0.000, 0.638,
                 1.394, 0.145, 0.210, 0.743, 0.309, 1.289),
        cv=3.85,
        dispersion_1s=13.182,
        trace_rate=2.5667,
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

"""Online Gaussian output-length predictor of the SA scheduler (Huang et al. 2025, §4.2 and §5.1 "Workflows").

The paper's request profiler "tracked the actual lengths of the outputs once a request's response was produced,
and dynamically modeled this data using a Gaussian distribution. To estimate the output length for a new request,
the predictor generates a random integer based on this fitted distribution" (§5.1); §5.3 says it updates "the mean
and the standard deviation of tasks' actual outputs" per task type. Here: one running mean/variance per app
(Welford's update), a seeded NumPy generator for the draws, and a prior mean (std 0) for apps that have not
completed a request yet (the paper leaves the cold start unspecified).

A running system's predictor has a history. §4.2 lets "business users ... specify a typical output range or
distribution for each task type", else the profiler gathers it; :meth:`GaussianLengthPredictor.warm` replays such a
history of completed requests (e.g. :func:`history_of` a disjoint draw of the workload) through the same update
:meth:`~GaussianLengthPredictor.observe` applies online. The SA scheduler does so by default with the profiling
slice of :func:`slogym.workloads.profiling.default_history` (§5.3's "profiling data from tasks").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from slogym.core.request import Workload


class GaussianLengthPredictor:
    """Per-app Gaussian of completed output lengths; ``sample`` draws integers >= 1 from it."""

    def __init__(self, n_apps: int, prior_mean: float | Sequence[float] = 128.0, seed: int = 0) -> None:
        if n_apps < 1:
            raise ValueError(f"n_apps={n_apps}; must be >= 1")
        prior = np.broadcast_to(np.asarray(prior_mean, dtype=np.float64), (n_apps,))
        if not np.all(prior >= 1):
            raise ValueError(f"prior_mean={prior_mean}; every prior must be >= 1 token")
        self.prior = prior.copy()
        self.count = np.zeros(n_apps, np.int64)
        self._mean = np.zeros(n_apps, np.float64)
        self._m2 = np.zeros(n_apps, np.float64)
        self.rng = np.random.default_rng(seed)

    def observe(self, app: int, length: int) -> None:
        """Record a completed request's true output length (Welford's online mean/variance)."""
        self.count[app] += 1
        d = length - self._mean[app]
        self._mean[app] += d / self.count[app]
        self._m2[app] += d * (length - self._mean[app])

    def warm(self, apps: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Replay a history of completed requests (app codes, true output lengths), in order, through
        :meth:`observe`: the fitted Gaussian is the one the online path would have after those completions."""
        apps, lengths = np.asarray(apps, dtype=np.int64), np.asarray(lengths)
        if apps.shape != lengths.shape or apps.ndim != 1:
            raise ValueError(f"history: app codes of shape {apps.shape} vs lengths of shape {lengths.shape}; "
                             "need two 1-D sequences of equal length")
        bad = (apps < 0) | (apps >= self.count.shape[0])
        if bad.any():
            raise ValueError(f"history app code {int(apps[bad][0])}; must be in 0..{self.count.shape[0] - 1}")
        if lengths.size and not (np.all(np.isfinite(lengths)) and lengths.min() >= 1):
            raise ValueError(f"history lengths {lengths[~(np.isfinite(lengths) & (lengths >= 1))][:3]}; "
                             "every output length must be a finite number >= 1")
        for app, length in zip(apps.tolist(), lengths.tolist()):
            self.observe(app, length)

    def mean(self, apps: np.ndarray | int) -> np.ndarray:
        """Fitted mean per app (the prior until the app has a completion)."""
        return np.where(self.count[apps] > 0, self._mean[apps], self.prior[apps])

    def std(self, apps: np.ndarray | int) -> np.ndarray:
        """Fitted (population) standard deviation per app; 0 with fewer than two completions."""
        n = self.count[apps]
        return np.sqrt(np.where(n > 1, self._m2[apps] / np.maximum(n, 1), 0.0))

    def sample(self, apps: np.ndarray) -> np.ndarray:
        """One random integer length (>= 1) per entry of ``apps``, drawn from its app's Gaussian."""
        apps = np.asarray(apps, dtype=np.int64)
        draw = self.rng.normal(self.mean(apps), self.std(apps))
        return np.maximum(np.rint(draw), 1).astype(np.int64)


def history_of(w: "Workload") -> tuple[tuple[str, int], ...]:
    """The (app name, true output length) pair of every request of ``w``, in request order: a history of completed
    requests to warm a predictor with (``SAScheduler(history=...)``). Use a draw disjoint from the evaluated one."""
    return tuple((w.app_names[a], int(o)) for a, o in zip(w.app.tolist(), w.output_tokens.tolist()))

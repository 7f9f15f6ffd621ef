"""Online Gaussian output-length predictor of the SA scheduler (Huang et al. 2025, §4.2 and §5.1 "Workflows").

The paper's request profiler "tracked the actual lengths of the outputs once a request's response was produced,
and dynamically modeled this data using a Gaussian distribution. To estimate the output length for a new request,
the predictor generates a random integer based on this fitted distribution" (§5.1); §5.3 says it updates "the mean
and the standard deviation of tasks' actual outputs" per task type. Here: one running mean/variance per app
(Welford's update), a seeded NumPy generator for the draws, and a prior mean (std 0) for apps that have not
completed a request yet (the paper leaves the cold start unspecified).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


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

"""Output-length predictors a policy or an agent may consult (the true length stays hidden in the trace)."""

from __future__ import annotations

import numpy as np

from slogym.core.request import Workload


class EmpiricalLengthPredictor:
    """Per-app quantiles of total output length, learned from a history of requests.

    The simplest honest predictor: what a serving system knows from past traffic of the same application.
    ``predict(apps)`` returns an array ``(len(apps), len(quantiles))``; apps unseen in the history get the
    quantiles of all history.
    """

    def __init__(self, history: Workload, quantiles: tuple[float, ...] = (0.5, 0.9)) -> None:
        if len(history) == 0:
            raise ValueError("EmpiricalLengthPredictor needs a non-empty history")
        self.quantiles = quantiles
        out = history.output_tokens
        n_apps = len(history.app_names)
        overall = np.quantile(out, quantiles)
        self.table = np.tile(overall, (n_apps, 1))
        for a in range(n_apps):
            mine = out[history.app == a]
            if mine.size:
                self.table[a] = np.quantile(mine, quantiles)

    def predict(self, apps: np.ndarray | int) -> np.ndarray:
        return self.table[apps]

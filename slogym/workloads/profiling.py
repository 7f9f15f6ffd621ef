"""The history a predictor-carrying policy is fitted on before a run: its training / profiling slice.

A deployed scheduler has seen earlier traffic of the same applications. Tempo (Zhang et al. 2025) trains its
quantile regression forest and matches request DAGs on such a history (§4.1); the SA scheduler (Huang et al. 2025)
fits its per-task Gaussian of output lengths on "profiling data from tasks" (§5.3, §4.2). Both policies draw it
here, so that one seed gives both the same slice and neither reads data outside the simulated workload.
"""

from __future__ import annotations

import numpy as np

from slogym.core.request import Workload


def default_history(w: Workload, n_requests: int, seed: int) -> Workload:
    """The training slice: a fresh seeded draw of the same scenario when ``w`` names one (held out from the
    served requests), otherwise the first ``n_requests`` requests of ``w`` (a trace's past)."""
    from slogym.workloads.scenarios import SCENARIOS, make_workload

    if w.name in SCENARIOS:
        return make_workload(w.name, n_requests=n_requests, seed=seed + 1_000_003)
    return w.subset(np.arange(min(n_requests, len(w))), name=f"{w.name}-history")

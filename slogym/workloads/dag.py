"""Super-node dependency-graph matching for collective requests (Tempo §4.1, Fig. 6).

A collective request is a chain of stages; the requests of one stage run in parallel and the next stage starts
when all of them finish. Tempo abstracts each stage into a *super-node* weighted by the stage's aggregate output
length, joined by an *edge* weighted by the total input length of the stage's requests. A live collective
request is matched against historical graphs of the same application (history is clustered by application,
§5) that have at least as many stages; the live graph is compared with the equally long prefix of each
historical graph. The stage-time ratios of the best match split the remaining end-to-end budget into the
current stage's deadline.

Reconstructed details (the paper names the ingredients but not the formulas):

* similarity ``S(G, H) = beta * mean_k K(n_k, n'_k) + (1 - beta) * mean_k K(e_k, e'_k)`` over the ``len(G)``
  stages of the live graph ``G`` and the prefix of ``H``, with the Gaussian kernel
  ``K(a, b) = exp(-(ln a - ln b)^2 / (2 sigma^2))`` on log weights (scale-free; ``beta = 0.5``, ``sigma = 0.5``);
* the time of a historical stage is its critical path in engine iterations,
  ``max_j(ceil(in_j / token_budget) + out_j)`` over the stage's requests (decode-bound, parallel requests);
* the deadline of stage ``s`` started at ``t_s`` with end-to-end deadline ``E`` is
  ``t_s + (E - t_s) * rho_s / sum_{j >= s} rho_j`` with ``rho`` the matched stage times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slogym.core.request import Workload


@dataclass(frozen=True)
class SuperGraph:
    """A chain of super-nodes: per stage the aggregate output length (``node``), total input length (``edge``)
    and, for a historical graph, the stage's execution time (``time``)."""

    node: np.ndarray
    edge: np.ndarray
    time: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.node.shape[0])


def stage_time(inputs: np.ndarray, outputs: np.ndarray, token_budget: int) -> float:
    """Critical path of one stage in engine iterations: its slowest request's prefill chunks plus decodes."""
    return float(np.max(-(-inputs // token_budget) + outputs))


def graphs_of(w: Workload, token_budget: int) -> dict[int, tuple[int, SuperGraph]]:
    """The complete super-node graph of every collective group in ``w``: ``{group: (app code, graph)}``."""
    out: dict[int, tuple[int, SuperGraph]] = {}
    idx = np.flatnonzero(w.group >= 0)
    if not idx.size:
        return out
    order = idx[np.lexsort((w.group_stage[idx], w.group[idx]))]
    inp, outp = w.input_tokens, w.output_tokens
    for g_idx in np.split(order, np.flatnonzero(np.diff(w.group[order])) + 1):
        stages = np.split(g_idx, np.flatnonzero(np.diff(w.group_stage[g_idx])) + 1)
        node = np.array([outp[s].sum() for s in stages], np.float64)
        edge = np.array([inp[s].sum() for s in stages], np.float64)
        time = np.array([stage_time(inp[s], outp[s], token_budget) for s in stages])
        out[int(w.group[g_idx[0]])] = (int(w.app[g_idx[0]]), SuperGraph(node, edge, time))
    return out


class GraphHistory:
    """Historical graphs clustered by application name, stored as padded log-weight matrices for matching."""

    def __init__(self, beta: float = 0.5, sigma: float = 0.5) -> None:
        if not 0.0 <= beta <= 1.0 or sigma <= 0:
            raise ValueError(f"beta={beta} must be in [0, 1] and sigma={sigma} > 0")
        self.beta, self.sigma = beta, sigma
        self._graphs: dict[str, list[SuperGraph]] = {}
        self._packed: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_workload(cls, w: Workload, token_budget: int, **kw: float) -> "GraphHistory":
        h = cls(**kw)
        for app, g in graphs_of(w, token_budget).values():
            h.add(w.app_names[app], g)
        return h

    def add(self, app: str, graph: SuperGraph) -> None:
        if graph.time is None:
            raise ValueError("a historical graph needs its stage times")
        self._graphs.setdefault(app, []).append(graph)
        self._packed.pop(app, None)

    def __len__(self) -> int:
        return sum(len(v) for v in self._graphs.values())

    def _pack(self, app: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if app not in self._packed:
            gs = self._graphs[app]
            m = max(len(g) for g in gs)
            lens = np.array([len(g) for g in gs])
            ln_node, ln_edge, time = np.zeros((len(gs), m)), np.zeros((len(gs), m)), np.zeros((len(gs), m))
            for i, g in enumerate(gs):
                k = len(g)
                ln_node[i, :k], ln_edge[i, :k] = np.log1p(g.node), np.log1p(g.edge)
                time[i, :k] = g.time
            self._packed[app] = (lens, ln_node, ln_edge, time)
        return self._packed[app]

    def similarity(self, app: str, live: SuperGraph) -> np.ndarray:
        """Similarity of ``live`` to every historical graph of ``app`` (``-inf`` for graphs with fewer stages)."""
        lens, ln_node, ln_edge, _ = self._pack(app)
        k = len(live)
        if k > ln_node.shape[1]:
            return np.full(lens.shape[0], -np.inf)
        two_s2 = 2.0 * self.sigma ** 2
        kn = np.exp(-(ln_node[:, :k] - np.log1p(live.node)) ** 2 / two_s2).mean(axis=1)
        ke = np.exp(-(ln_edge[:, :k] - np.log1p(live.edge)) ** 2 / two_s2).mean(axis=1)
        return np.where(lens >= k, self.beta * kn + (1 - self.beta) * ke, -np.inf)

    def match(self, app: str, live: SuperGraph) -> SuperGraph | None:
        """The most similar historical graph of ``app`` with at least ``len(live)`` stages, or None."""
        if app not in self._graphs:
            return None
        s = self.similarity(app, live)
        best = int(np.argmax(s))
        return self._graphs[app][best] if np.isfinite(s[best]) else None


def stage_deadline(ratios: np.ndarray, stage: int, start: float, end: float) -> float:
    """Deadline of ``stage`` (0-based) started at ``start``: its share of the budget left until ``end``."""
    rest = float(np.sum(ratios[stage:]))
    if stage >= ratios.shape[0] or rest <= 0:
        return end
    return start + (end - start) * float(ratios[stage]) / rest

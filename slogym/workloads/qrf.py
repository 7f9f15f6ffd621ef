"""Quantile-regression-forest output-length bounds (Tempo §4.1, "Request Analyzer").

Tempo predicts an *upper bound* of a request's response length with a quantile regression forest (QRF,
Meinshausen 2006, via the ``quantile-forest`` package) and re-predicts it while the response is generated,
conditioned on the tokens produced so far, so that the bound tightens as generation progresses.

Features (everything a serving system knows at arrival, plus the progress so far; slogym has no prompt text,
so the paper's prompt-content features are not available):

* ``app``           application / request type code (latency-sensitive, throughput-intensive, collective, ...)
* ``input_tokens``  prompt length of the request
* ``group_stage``   stage of a collective request within its DAG, ``-1`` for a standalone request
* ``generated``     output tokens generated so far, rounded down to a multiple of ``refresh_tokens``

The forest is trained on *prefixes* of a training slice of requests: each history request contributes one row
per multiple ``g`` of ``refresh_tokens`` below its output length (``g = 0, N, 2N, ...``), all with target = its
total output length. Every request still generating at ``g`` is represented exactly once there, so the bound at
``generated = g`` is the quantile of the total length among requests that survived to ``g`` -- the online
refinement of §4.1 (re-predicted every ``refresh_tokens`` generated tokens).

Prediction is compiled: the fitted trees are flattened into padded NumPy arrays and walked for all samples
and trees at once, and each leaf stores the quantiles of the training targets that reach it; the forest's
quantile is the mean over trees of the leaf quantiles (the package's ``aggregate_leaves_first=False`` mode).
This keeps one arrival at a few tens of microseconds, against ~2 ms for the package's generic ``predict``
(the paper reports 7 ms). Fitted arrays are cached in memory and on disk, keyed by a hash of the training
data and hyper-parameters.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from slogym.core.request import Workload

N_FEATURES = 4


@dataclass(frozen=True)
class QRFConfig:
    """Hyper-parameters. ``quantiles`` are the levels stored per leaf (any may be asked for later)."""

    quantiles: tuple[float, ...] = (0.5, 0.9)
    refresh_tokens: int = 128
    n_estimators: int = 32
    max_depth: int = 12
    min_samples_leaf: int = 24
    max_features: float = 0.75
    seed: int = 0


def request_features(w: Workload) -> np.ndarray:
    """Per-request arrival features ``(n, 3)``: app, input tokens, group stage (-1 standalone)."""
    stage = np.where(w.group >= 0, w.group_stage, -1)
    return np.column_stack([w.app, w.input_tokens, stage]).astype(np.float64)


def _training_rows(w: Workload, cfg: QRFConfig) -> tuple[np.ndarray, np.ndarray]:
    """Prefix rows: (features with ``generated`` = every multiple of ``refresh_tokens`` below the length,
    total output length)."""
    out = w.output_tokens
    reps = (out - 1) // cfg.refresh_tokens + 1
    first = np.concatenate(([0], np.cumsum(reps)[:-1]))
    gen = (np.arange(int(reps.sum())) - np.repeat(first, reps)) * cfg.refresh_tokens
    x = np.column_stack([np.repeat(request_features(w), reps, axis=0), gen.astype(np.float64)])
    return x, np.repeat(out.astype(np.float64), reps)


class CompiledForest:
    """Flattened trees: ``feature``, ``threshold``, ``left``, ``right`` (trees x nodes, -1 = leaf) and
    ``value`` (trees x nodes x quantiles: leaf quantiles of the training targets)."""

    def __init__(self, feature: np.ndarray, threshold: np.ndarray, left: np.ndarray, right: np.ndarray,
                 value: np.ndarray, depth: int, quantiles: tuple[float, ...]) -> None:
        self.feature, self.threshold, self.left, self.right, self.value = feature, threshold, left, right, value
        self.depth = depth
        self.quantiles = quantiles
        self._tree = np.arange(feature.shape[0])

    @classmethod
    def from_forest(cls, forest: object, x: np.ndarray, y: np.ndarray,
                    quantiles: tuple[float, ...]) -> "CompiledForest":
        trees = [est.tree_ for est in forest.estimators_]  # type: ignore[attr-defined]
        m = max(t.node_count for t in trees)
        t_n, q_n = len(trees), len(quantiles)
        feature = np.zeros((t_n, m), np.int64)
        threshold = np.zeros((t_n, m))
        left = np.full((t_n, m), -1, np.int64)
        right = np.full((t_n, m), -1, np.int64)
        value = np.zeros((t_n, m, q_n))
        for i, (t, est) in enumerate(zip(trees, forest.estimators_)):  # type: ignore[attr-defined]
            c = t.node_count
            feature[i, :c] = np.maximum(t.feature, 0)
            threshold[i, :c] = t.threshold
            left[i, :c], right[i, :c] = t.children_left, t.children_right
            leaf = est.apply(x.astype(np.float32))
            order = np.lexsort((y, leaf))
            ls, ys = leaf[order], y[order]
            ids, start, count = np.unique(ls, return_index=True, return_counts=True)
            for j, q in enumerate(quantiles):  # linear interpolation inside each leaf's sorted targets
                pos = (count - 1) * q
                lo = np.floor(pos).astype(np.int64)
                hi = np.minimum(lo + 1, count - 1)
                frac = pos - lo
                value[i, ids, j] = ys[start + lo] * (1 - frac) + ys[start + hi] * frac
        depth = max(int(est.get_depth()) for est in forest.estimators_)  # type: ignore[attr-defined]
        return cls(feature, threshold, left, right, value, depth, quantiles)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Forest quantiles ``(n, len(quantiles))`` for feature rows ``x`` ``(n, N_FEATURES)``."""
        n = x.shape[0]
        node = np.zeros((n, self._tree.shape[0]), np.int64)
        tree = self._tree[None, :]
        row = np.arange(n)[:, None]
        xf = x.astype(np.float32).astype(np.float64)  # sklearn splits on float32 features
        for _ in range(self.depth):
            lft = self.left[tree, node]
            go_left = xf[row, self.feature[tree, node]] <= self.threshold[tree, node]
            node = np.where(lft < 0, node, np.where(go_left, lft, self.right[tree, node]))
        return self.value[tree, node].mean(axis=1)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"feature": self.feature, "threshold": self.threshold, "left": self.left, "right": self.right,
                "value": self.value, "depth": np.array(self.depth), "quantiles": np.array(self.quantiles)}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> "CompiledForest":
        return cls(a["feature"], a["threshold"], a["left"], a["right"], a["value"], int(a["depth"]),
                   tuple(float(q) for q in a["quantiles"]))


_MEMO: dict[str, CompiledForest] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("SLOGYM_CACHE_DIR", Path.home() / ".cache" / "slogym")) / "qrf"


def _key(x: np.ndarray, y: np.ndarray, cfg: QRFConfig) -> str:
    h = hashlib.sha256()
    h.update(repr(sorted(asdict(cfg).items())).encode())
    h.update(np.ascontiguousarray(x).tobytes())
    h.update(np.ascontiguousarray(y).tobytes())
    return h.hexdigest()[:24]


class QRFLengthPredictor:
    """Upper bounds on the total output length of requests, refined by the tokens generated so far.

    ``fit(history)`` trains (or loads from the cache) the forest on a training slice; ``predict(features,
    generated, q)`` returns total-length quantiles for many requests at once, never below ``generated + 1``.
    """

    def __init__(self, forest: CompiledForest, cfg: QRFConfig) -> None:
        self.forest = forest
        self.cfg = cfg

    @classmethod
    def fit(cls, history: Workload, cfg: QRFConfig = QRFConfig(), cache: bool = True) -> "QRFLengthPredictor":
        if len(history) == 0:
            raise ValueError("QRFLengthPredictor.fit needs a non-empty training workload")
        x, y = _training_rows(history, cfg)
        key = _key(x, y, cfg)
        forest = _MEMO.get(key)
        path = _cache_dir() / f"{key}.npz"
        if forest is None and cache and path.is_file():
            with np.load(path) as z:
                forest = CompiledForest.from_arrays(dict(z))
        if forest is None:
            from quantile_forest import RandomForestQuantileRegressor  # optional dependency, imported lazily

            model = RandomForestQuantileRegressor(
                n_estimators=cfg.n_estimators, max_depth=cfg.max_depth, min_samples_leaf=cfg.min_samples_leaf,
                max_features=cfg.max_features, bootstrap=False, random_state=cfg.seed, n_jobs=1)
            model.fit(x, y)
            forest = CompiledForest.from_forest(model, x, y, cfg.quantiles)
            if cache:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
                np.savez(tmp, **forest.arrays())
                os.replace(tmp, path)
        _MEMO[key] = forest
        return cls(forest, cfg)

    def bucket(self, generated: np.ndarray) -> np.ndarray:
        """The refresh point a prediction at ``generated`` tokens uses (a multiple of ``refresh_tokens``)."""
        return (np.asarray(generated, np.int64) // self.cfg.refresh_tokens) * self.cfg.refresh_tokens

    def predict(self, features: np.ndarray, generated: np.ndarray, q: float) -> np.ndarray:
        """Quantile ``q`` (one of ``cfg.quantiles``) of the total output length, given ``features`` ``(n, 3)``
        (:func:`request_features`) and the output tokens generated so far."""
        j = self.cfg.quantiles.index(q)
        gen = np.asarray(generated, np.int64)
        x = np.column_stack([features, self.bucket(gen).astype(np.float64)])
        return np.maximum(self.forest.predict(x)[:, j], gen + 1)

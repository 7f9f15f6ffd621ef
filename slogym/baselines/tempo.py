"""Tempo (Zhang et al. 2025): SLO-aware scheduling that maximizes service gain with imprecise request information.

The whole algorithm (Alg. 1) as a slogym token-budget scheduler (iteration-level batching with chunked prefills,
like Sarathi-Serve), ordered by Largest Service Density First instead of FCFS:

* **Request Analyzer (§4.1)** -- an output-length upper bound from a quantile regression forest, refreshed every
  ``refresh_tokens`` generated tokens (:mod:`slogym.workloads.qrf`); for collective requests, super-node DAG
  matching against history of the same application splits the end-to-end deadline into stage deadlines
  (:mod:`slogym.workloads.dag`).
* **LSDF (§4.2, Eq. 4)** -- every candidate (running or waiting) gets ``density = projected gain / remaining
  time budget``; candidates take tokens (one for a decode, a chunk for a prefill) in density order within the
  token budget, the sequence limit and free KV.
* **Cost-aware preemption (§4.2)** -- a running request is switched out for a waiting one only at a quantum
  boundary (``quantum`` iterations after the previous switch on the instance) and only if the density gained over
  the next quantum exceeds the service lost while the victim's KV is recomputed.
* **Reserve and fairness (§4.3)** -- a ``reserve`` share of the token budget and of the sequence slots goes to
  SLO-insensitive (best-effort) requests in FCFS order, backfilled by SLO requests when unused; the priority may
  be blended as ``(1 - f) * density + f * fair`` with a least-attained-service-per-app fairness score.

Reconstructed symbols (the text is ambiguous or the formula is lost), per request ``r`` at time ``now``:

* ``U`` output-length upper bound (QRF quantile ``quantile``), ``R = max(U - generated, 1)`` tokens left;
  ``P`` prompt tokens still to (re)compute; ``tau`` the instance's last iteration time (the online token-speed
  profile, §4.2 "token processing speed ... can be profiled"); remaining processing time
  ``T = (ceil(P / token_budget) + R) * tau``. A collective request uses the max ``T`` over the live requests of
  its stage (Alg. 1 line 17-18).
* deadline ``D``: TTLT requests ``arrival + ttlt``; collective requests their stage deadline; latency-sensitive
  requests the deadline-line time of their estimated last token ``t_ref + ttft + (k_last) * tpot``.
* projected gain ``G``: Eq. 2 ``(w_i L_i + w_o (generated + R)) * f`` for TTLT / collective requests, the
  not-yet-earned part of Eq. 3 ``(w_i L_i [if still in prefill] + w_o R) * f`` for latency-sensitive ones, with
  ``f = min{1, ((D - t_ref) / (now + T - t_ref))^alpha}`` -- Eq. 4 prints the ratio inverted; we use the
  decreasing form of Eq. 2.
* remaining time budget (Eq. 4's ``Estimated_TTLT - processed_time``): ``B = max(D - now, T)`` -- the time the
  request may take under its SLO, or the time it needs if that is longer; ``density = G / B``. Requests with
  slack yield bandwidth ("just enough bandwidth", §4.2); hopeless ones decay through ``f``.
* switch test: ``(p_w - sum p_v) * quantum * tau > sum_v p_v * ceil(computed_v / token_budget) * tau``.

Variants: ``tempo`` (QRF bound + DAG matching), ``tempo-precise`` (true lengths and true DAGs), ``tempo-sjf``
(shortest predicted remaining time first, QRF median), ``tempo-no-graph`` (collective requests aim at the
end-to-end deadline), ``tempo-no-predictor`` (one history-wide mean length for every request; Fig. 15).

Deviations: prompt-content features are unavailable (see :mod:`slogym.workloads.qrf`); preemption is by
recompute (no swap); preemptions forced by KV growth of running decodes (vLLM's rule) ignore the quantum, the
quantum governs the voluntary switches; the history of graphs is the training slice (no online additions).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from slogym.baselines.common import (BatchBuilder, TokenBudgetScheduler, batch_of, make_room_for_decodes,
                                     split_running, unstick)
from slogym.core.batch import Batch
from slogym.core.instance import Instance
from slogym.core.policy import Policy
from slogym.core.request import StageKind, Workload
from slogym.core.state import Status
from slogym.workloads.dag import GraphHistory, SuperGraph, graphs_of, stage_deadline
from slogym.workloads.qrf import QRFConfig, QRFLengthPredictor, request_features

if TYPE_CHECKING:
    from slogym.core.simulator import Simulator

PREDICTORS = ("qrf", "oracle", "none")
GRAPHS = ("match", "oracle", "none")
ORDERS = ("lsdf", "sjf")
_TTLT, _LINE, _NONE = 0, 1, 2


def default_history(w: Workload, n_requests: int, seed: int) -> Workload:
    """The training slice: a fresh seeded draw of the same scenario when ``w`` names one (held out from the
    served requests), otherwise the first ``n_requests`` requests of ``w`` (a trace's past)."""
    from slogym.workloads.scenarios import SCENARIOS, make_workload

    if w.name in SCENARIOS:
        return make_workload(w.name, n_requests=n_requests, seed=seed + 1_000_003)
    return w.subset(np.arange(min(n_requests, len(w))), name=f"{w.name}-history")


class TempoScheduler(TokenBudgetScheduler):
    """LSDF token-budget scheduler with Tempo's analyzer, preemption quanta, reserve and fairness (see module)."""

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256, predictor: str = "qrf",
                 graph: str = "match", order: str = "lsdf", quantile: float = 0.9, quantum: int = 20,
                 reserve: float = 0.1, fairness: float = 0.0, refresh_tokens: int = 128,
                 history: Workload | None = None, history_requests: int = 1500, seed: int = 0) -> None:
        super().__init__(token_budget, max_num_seqs)
        for name, v, ok in (("predictor", predictor, PREDICTORS), ("graph", graph, GRAPHS), ("order", order, ORDERS)):
            if v not in ok:
                raise ValueError(f"{name}={v!r}; expected one of {ok}")
        if not (0 < quantile < 1 and quantum >= 1 and 0 <= reserve < 1 and 0 <= fairness <= 1
                and refresh_tokens >= 1 and history_requests >= 1):
            raise ValueError(f"invalid Tempo parameters: quantile={quantile} (0, 1), quantum={quantum} >= 1, "
                             f"reserve={reserve} [0, 1), fairness={fairness} [0, 1], refresh_tokens="
                             f"{refresh_tokens} >= 1, history_requests={history_requests} >= 1")
        self.predictor, self.graph, self.order = predictor, graph, order
        self.quantile, self.quantum, self.reserve, self.fairness = quantile, quantum, reserve, fairness
        self.refresh_tokens, self.history, self.history_requests, self.seed = (
            refresh_tokens, history, history_requests, seed)

    # ------------------------------------------------------------------ setup
    def reset(self, sim: "Simulator") -> None:
        w = sim.w
        self.sim, self.w, self.rs = sim, w, sim.rs
        hist = self.history if self.history is not None else default_history(w, self.history_requests, self.seed)
        self.wi, self.wo = sim.sg_weights
        self.alpha = sim.sg_alpha
        n = len(w)
        self.slo = np.where(np.isfinite(w.ttlt), _TTLT,
                            np.where(np.isfinite(w.first_ttft) | np.isfinite(w.min_tpot), _LINE, _NONE))
        self.slo[w.best_effort] = _NONE
        # history app codes by name, so that a history drawn separately lines up with this workload
        code = {a: i for i, a in enumerate(hist.app_names)}
        app_map = np.array([code.get(a, -1) for a in w.app_names], np.float64)
        self.features = request_features(w)
        self.features[:, 0] = app_map[w.app]
        self.ub = np.zeros(n)
        self.ub_at = np.full(n, -1, np.int64)
        if self.predictor == "qrf":
            qs = tuple(sorted({0.5, 0.9, self.quantile}))
            self.qrf = QRFLengthPredictor.fit(hist, QRFConfig(quantiles=qs, refresh_tokens=self.refresh_tokens,
                                                              seed=self.seed))
        self.mean_len = float(hist.output_tokens.mean()) if len(hist) else 1.0
        # collective stages: one id per (group, stage), members in CSR, stage ids of each group in stage order
        grp = np.flatnonzero(w.group >= 0)
        keys = w.group[grp] * (int(w.group_stage.max(initial=0)) + 1) + w.group_stage[grp]
        uniq, inv = np.unique(keys, return_inverse=True)
        self.sid = np.full(n, -1, np.int64)
        self.sid[grp] = inv
        order = np.argsort(inv, kind="stable")
        self.members = np.split(grp[order], np.cumsum(np.bincount(inv, minlength=uniq.size))[:-1]) if grp.size else []
        self.group_sids: dict[int, list[int]] = {}
        for s, m in enumerate(self.members):
            self.group_sids.setdefault(int(w.group[m[0]]), []).append(s)
        self.stage_dl = np.full(uniq.size, np.nan)
        if self.graph == "match":
            self.graphs = GraphHistory.from_workload(hist, self.token_budget)
        elif self.graph == "oracle":
            self.true_graphs = graphs_of(w, self.token_budget)
        self.last_switch: dict[int, int] = {}
        self.switches: list[tuple[int, int]] = []  # (instance, iteration) of every voluntary switch
        self.served = np.zeros(len(w.app_names))

    # ------------------------------------------------------------------ Request Analyzer (§4.1)
    def upper_bound(self, idx: np.ndarray) -> np.ndarray:
        """Estimated total output length of requests ``idx`` given what they generated so far."""
        gen = self.rs.generated[idx]
        if self.predictor == "oracle":
            return self.w.output_tokens[idx].astype(np.float64)
        if self.predictor == "none":
            return np.maximum(self.mean_len, gen + self.refresh_tokens).astype(np.float64)
        at = self.qrf.bucket(gen)
        stale = self.ub_at[idx] != at
        if stale.any():
            s = idx[stale]
            self.ub[s] = self.qrf.predict(self.features[s], at[stale], self.quantile)
            self.ub_at[s] = at[stale]
        return np.maximum(self.ub[idx], gen + 1)

    def _stage_deadline(self, sid: int) -> float:
        """Deadline of collective stage ``sid``: its share of the group's end-to-end budget (§4.1)."""
        if not np.isnan(self.stage_dl[sid]):
            return float(self.stage_dl[sid])
        w, rs = self.w, self.rs
        m = self.members[sid]
        first = int(m[0])
        g, s = int(w.group[first]), int(w.group_stage[first])
        end = float(w.arrival[first] + w.ttlt[first])
        start = float(rs.ready[first])
        ratios = None
        if self.graph == "oracle":
            ratios = self.true_graphs[g][1].time
        elif self.graph == "match":
            sids = self.group_sids[g][: s + 1]
            node = np.array([rs.generated[self.members[j]].sum() for j in sids[:-1]]
                            + [self.upper_bound(m).sum()], np.float64)
            edge = np.array([w.input_tokens[self.members[j]].sum() for j in sids], np.float64)
            best = self.graphs.match(w.app_names[w.app[first]], SuperGraph(node, edge))
            ratios = None if best is None else best.time
        dl = end if ratios is None else stage_deadline(ratios, s, start, end)
        self.stage_dl[sid] = dl
        return dl

    # ------------------------------------------------------------------ LSDF (§4.2, Eq. 4)
    def _remaining_time(self, idx: np.ndarray, tau: float) -> tuple[np.ndarray, np.ndarray]:
        """(remaining output tokens ``R``, remaining processing time ``T``) of requests ``idx``."""
        rs = self.rs
        rem = rs.num_tokens[idx] - rs.num_computed[idx]
        prefill = np.where(rem > 1, rem, 0)
        r_out = np.maximum(self.upper_bound(idx) - rs.generated[idx], 1.0)
        return r_out, (-(-prefill // self.token_budget) + r_out) * tau

    def priority(self, idx: np.ndarray, inst: Instance, now: float) -> np.ndarray:
        """Priority of candidates ``idx``: service density (or 1/T for SJF), blended with fairness."""
        w, rs = self.w, self.rs
        tau = max(inst.last_dt, 1e-4)
        r_out, t_rem = self._remaining_time(idx, tau)
        sid = self.sid[idx]
        coll = sid >= 0
        if self.order == "sjf":
            p = 1.0 / t_rem
        else:
            if coll.any():  # Alg. 1 line 17-18: the stage's slowest live request sets the time
                sids, pos = np.unique(sid[coll], return_inverse=True)
                m = np.concatenate([self.members[s] for s in sids.tolist()])
                owner = np.repeat(np.arange(sids.size), [self.members[s].size for s in sids.tolist()])
                live = rs.status[m] != Status.DONE
                stage_t = np.zeros(sids.size)
                np.maximum.at(stage_t, owner[live], self._remaining_time(m[live], tau)[1])
                t_rem = np.where(coll, 0.0, t_rem)
                t_rem[coll] = stage_t[pos]
            p = self._density(idx, r_out, t_rem, sid, now)
        if self.fairness > 0:
            top = p.max(initial=0.0)
            att = self.served[w.app[idx]]
            fair = 1.0 - att / max(self.served.max(), 1.0)
            p = (1 - self.fairness) * (p / top if top > 0 else p) + self.fairness * fair
        return p

    def _density(self, idx: np.ndarray, r_out: np.ndarray, t_rem: np.ndarray, sid: np.ndarray,
                 now: float) -> np.ndarray:
        w, rs = self.w, self.rs
        slo = self.slo[idx]
        stage = rs.stage[idx]
        in_decode = w.stage_kind[stage] == StageKind.DECODE
        l_in = w.input_tokens[idx]
        gen = rs.generated[idx]
        ttlt_dl = w.arrival[idx] + w.ttlt[idx]
        coll = np.flatnonzero(sid >= 0)
        if coll.size:
            ttlt_dl[coll] = [self._stage_deadline(s) for s in sid[coll].tolist()]
        with np.errstate(invalid="ignore"):  # a TPOT of inf times a last-token index of 0: no line, inf
            line_dl = np.where(in_decode, rs.dl_base[idx] + (rs.gen_in_stage[idx] + r_out - 1) * rs.tpot[idx],
                               rs.ready[idx] + w.stage_ttft[stage] + (r_out - 1) * w.min_tpot[idx])
        line_dl = np.where(np.isnan(line_dl), np.inf, line_dl)
        is_ttlt = slo == _TTLT
        dl = np.where(is_ttlt, ttlt_dl, line_dl)
        t_ref = np.where(is_ttlt & (sid < 0), w.arrival[idx], rs.ready[idx])
        gain = np.where(is_ttlt, self.wi * l_in + self.wo * (gen + r_out),
                        self.wo * r_out + np.where(in_decode, 0.0, self.wi * l_in))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = np.where(np.isfinite(dl), (dl - t_ref) / np.maximum(now + t_rem - t_ref, 1e-9), np.inf)
            f = self.sim._decay(np.maximum(ratio, 0.0))
            budget = np.maximum(dl - now, t_rem)
            dens = np.where(np.isfinite(budget), gain * f / budget, 0.0)
        return np.where(slo == _NONE, 0.0, dens)

    # ------------------------------------------------------------------ Schedule (Alg. 1 lines 6-12)
    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        rs = self.rs
        cands = np.array(inst.running + inst.waiting, dtype=np.int64)
        prio = dict(zip(cands.tolist(), self.priority(cands, inst, now).tolist()))
        victims: list[int] = []
        if dec.size:
            dec, victims, _ = make_room_for_decodes(inst, dec, lambda r: -prio[r])
        free = inst.free_blocks + sum(int(rs.kv_blocks[v]) for v in victims)
        insensitive = (self.slo[cands] == _NONE) | rs.be[cands]
        slo_c = [r for r in cands[~insensitive][np.argsort(-np.array([prio[r] for r in cands[~insensitive]]),
                                                            kind="stable")].tolist() if r not in victims]
        switched = self._switch(inst, slo_c, prio, victims, free)
        if switched:
            free += sum(int(rs.kv_blocks[v]) for v in switched)
            victims += switched
            slo_c = [r for r in slo_c if r not in switched]
        be_c = [r for r in cands[insensitive].tolist() if r not in victims]
        be_c.sort(key=lambda r: self.w.arrival[r])
        res_tok = math.ceil(self.reserve * self.token_budget) if be_c else 0
        res_seq = math.ceil(self.reserve * self.max_num_seqs) if be_c else 0
        b = _Builder(inst, self.token_budget - res_tok, free, self.max_num_seqs - res_seq, cands)
        taken: set[int] = set()
        for group, release in ((slo_c, False), (be_c, True), (slo_c, False)):
            if release:  # the reserve opens to SLO-insensitive requests, FCFS; backfilled by SLO requests after
                b.budget += res_tok
                b.max_seqs += res_seq
            for r in group:
                if b.full:
                    break
                if r not in taken and b.take(r):
                    taken.add(r)
        if not b.reqs and not victims:
            return unstick(inst, lambda r: -prio[r])
        if self.fairness > 0:
            np.add.at(self.served, self.w.app[b.reqs], b.toks)
        steady = (self.fairness == 0 and not victims and not inst.waiting and not pre.size
                  and len(b.reqs) == len(inst.running) and all(t == 1 for t in b.toks))
        return batch_of(b.reqs, b.toks, victims, steady=steady)

    def _switch(self, inst: Instance, slo_c: list[int], prio: dict[int, float], victims: list[int],
                free: int) -> list[int]:
        """Cost-aware preemption (§4.2): at most one switch per quantum, for the densest waiting SLO request
        whose next chunk does not fit in free KV, if the gain over a quantum beats the recompute stall loss."""
        if inst.iterations - self.last_switch.get(inst.id, -self.quantum) < self.quantum:
            return []
        rs = self.rs
        waiting = set(inst.waiting)
        top = next((r for r in slo_c if r in waiting), None)
        if top is None:
            return []
        chunk = min(int(inst.remaining([top])[0]), self.token_budget)
        need = int(inst.blocks_needed([top], chunk)[0])
        if need <= free:
            return []
        tau = max(inst.last_dt, 1e-4)
        pool = sorted((r for r in inst.running if r not in victims and prio[r] < prio[top]), key=lambda r: prio[r])
        chosen: list[int] = []
        for v in pool:
            if free >= need:
                break
            chosen.append(v)
            free += int(rs.kv_blocks[v])
        if free < need:
            return []
        p_v = np.array([prio[v] for v in chosen])
        stall = -(-rs.num_computed[chosen] // self.token_budget) * tau
        if (prio[top] - p_v.sum()) * self.quantum * tau <= float((p_v * stall).sum()):
            return []
        self.last_switch[inst.id] = inst.iterations
        self.switches.append((inst.id, inst.iterations))
        return chosen


class _Builder(BatchBuilder):
    """:class:`BatchBuilder` with the decode test and KV growth of all candidates computed in one call."""

    def __init__(self, inst: Instance, budget: int, free: int, max_seqs: int, cands: np.ndarray) -> None:
        super().__init__(inst, budget, free, max_seqs)
        keys = cands.tolist()
        self._decode = dict(zip(keys, (inst.remaining(cands) == 1).tolist()))
        self._need = dict(zip(keys, inst.blocks_needed(cands, 1).tolist()))

    def is_decode(self, r: int) -> bool:
        return self._decode[r]

    def decode_need(self, r: int) -> int:
        return self._need[r]


# ---------------------------------------------------------------------------------------------- registry
VARIANTS: dict[str, dict[str, Any]] = {
    "tempo": {},
    "tempo-precise": {"predictor": "oracle", "graph": "oracle"},
    "tempo-sjf": {"order": "sjf", "quantile": 0.5},
    "tempo-no-graph": {"graph": "none"},
    "tempo-no-predictor": {"predictor": "none"},
}

DESCRIPTIONS: dict[str, str] = {
    "tempo": "Tempo LSDF with QRF length bounds and DAG matching (Zhang et al. 2025)",
    "tempo-precise": "Tempo with oracle output lengths and DAGs (Tempo-Precise, Fig. 12)",
    "tempo-sjf": "shortest predicted job first with Tempo's analyzer (Tempo-SJF baseline)",
    "tempo-no-graph": "Tempo without DAG matching (Fig. 15 ablation)",
    "tempo-no-predictor": "Tempo without the QRF length predictor (Fig. 15 ablation)",
}


def _factory(name: str) -> Callable[..., Policy]:
    def make(engine: Any = None, **params: Any) -> Policy:
        kw = ({"max_num_seqs": int(engine.max_num_seqs)} if engine is not None else {}) | VARIANTS[name] | params
        sched = TempoScheduler(**kw)
        shown = {k: v for k, v in vars(sched).items() if not k.startswith("_") and k != "history"}
        return Policy(name=name, scheduler=sched, params={"scheduler": "TempoScheduler"} | shown)

    make.__doc__ = DESCRIPTIONS[name]
    return make


POLICIES: dict[str, Callable[..., Policy]] = {name: _factory(name) for name in VARIANTS}

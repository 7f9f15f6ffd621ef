"""Tempo (Zhang et al. 2025): SLO-aware scheduling that maximizes service gain with imprecise request information.

The whole algorithm (Alg. 1) as a slogym scheduler on vLLM's chunked-prefill substrate (§5: Tempo is a policy
engine inside vLLM "preserving chunked-prefill execution efficiency"): every running decode takes its token
first, the token budget left goes to prefill chunks -- running (partial) prefills, then waiting requests -- and
Largest Service Density First replaces FCFS in every ordering decision: admission, KV-forced eviction, switches.

* **Request Analyzer (§4.1)** -- an output-length upper bound from a quantile regression forest, refreshed every
  ``refresh_tokens`` generated tokens (:mod:`slogym.workloads.qrf`); for collective requests, super-node DAG
  matching against history of the same application splits the end-to-end deadline into stage deadlines
  (:mod:`slogym.workloads.dag`). The live graph is what is known when a stage starts (Fig. 7, "matching N+1
  stage ratio over whole graph with N stage"): the outputs of the completed stages and the inputs of those and
  of the starting stage, matched against historical graphs with more stages than completed; the length bound
  takes no part in matching (Alg. 1 lines 2-3 keep PredictLength and GraphMatching apart).
* **LSDF (§4.2, Alg. 1 lines 6-12, Eq. 4)** -- every candidate (running or waiting) gets a service density;
  prefill candidates take chunks in density order within the token budget, the sequence limit and free KV (a
  candidate that does not fit is skipped, Alg. 1 line 9-10); running decodes that cannot all grow evict the
  least dense running requests (vLLM's rule in LSDF order).
* **Cost-aware preemption (§4.2)** -- the densest waiting request that lacks KV or a sequence slot switches out
  less dense running requests only at a quantum boundary (``quantum`` iterations after the previous switch on
  the instance) and only if the density gained over the next quantum exceeds the service lost while the
  victims' KV is recomputed. Between switches the running set is never reordered: the quantum is what keeps
  the batch stable (a running request is only paused by eviction, as in vLLM).
* **Reserve and fairness (§4.3)** -- a ``reserve`` share of the token budget and of the sequence slots goes to
  SLO-insensitive (best-effort) prefills in FCFS order, backfilled by SLO requests when unused; the priority may
  be blended as ``(1 - f) * density + f * fair`` with a least-attained-service-per-app fairness score.

Reconstructed symbols (the text is ambiguous or the formula is lost), per request ``r`` at time ``now``:

* ``U`` output-length upper bound (QRF quantile ``quantile``), ``R = max(U - generated, 1)`` tokens left;
  ``P`` prompt tokens still to (re)compute; ``tau`` the instance's last iteration time (the online token-speed
  profile, §4.2 "token processing speed ... can be profiled"); remaining prefill time
  ``T_p = ceil(P / token_budget) * tau``, remaining processing time ``T = T_p + R * tau``. A collective request
  uses the max ``T`` over the live requests of its stage (Alg. 1 line 17-18).
* one density term per SLO (Eq. 4): ``term(G, D, t_ref, T) = G * f / T`` -- the projected gain ``G * f`` per unit
  of *remaining process time* ``T`` (Alg. 1 line 16 ``remain_process_time = Estimated_TTLT - processed_time``
  with ``Estimated_TTLT = processed_time + T``; Eq. 4's denominator "Potential Remain Process Time"; §4.2
  "service density by potential_service_gain / potential_remain_process_time"), with §3.1's decay
  ``f = min{1, ((D - t_ref) / (now + T - t_ref))^alpha}`` of the estimated metric ``now + T - t_ref`` against
  the SLO ``D - t_ref`` (Alg. 1 line 19 ``ComputeService(SLO, Estimated_Metrics)``, the "projected service
  gain"). Eq. 4 prints the ratio inverted, ``(Estimated_TTLT / SLO)^alpha``, which is not §3.1's decreasing
  ``f``; we keep §3.1's (docs/baselines/tempo.md gives the measured effect of both). So the deadline acts
  through ``f`` only: a request projected to miss it (its stage's share, for a collective call) loses
  density, one with slack keeps its full gain rate. An earlier version divided by ``max(D - now, T)``, a
  reconstruction of a "paced" Estimated_TTLT that the text does not define.
* throughput-intensive and collective requests (Eq. 2): one term, ``G = w_i L_i + w_o (generated + R)``,
  ``D = arrival + ttlt`` (``t_ref`` arrival) or the stage deadline (``t_ref`` the stage's start).
* latency-sensitive requests (Eq. 3, whose two sums have their own SLOs): the sum of a TTFT term
  ``term(w_i L_prompt, ready + ttft, ready, T_p)`` while the prompt is being prefilled and a TBT term
  ``term(w_o R, line(last token), ready, T)`` with ``line(k) = first-token deadline + k * tpot`` (the expected
  output progression of §3.1).
* switch test: ``(p_w - sum p_v) * quantum * tau > sum_v p_v * ceil(computed_v / token_budget) * tau``.

Variants: ``tempo`` (QRF bound + DAG matching), ``tempo-precise`` (true lengths and true DAGs), ``tempo-sjf``
(shortest predicted remaining time first, QRF median), ``tempo-no-graph`` (every collective stage aims at the
end-to-end deadline: the path ``tempo`` itself takes when an application has no history to match, since without
a graph no stage split is known), ``tempo-no-predictor`` (Fig. 15: the prediction model removed, nothing else --
one history-wide length bound at Tempo's own ``quantile`` for every request, raised to ``generated +
refresh_tokens`` as generation passes it; §4.1's conservative upper-bound strategy stays, only the model that
conditions it on the request goes). The paper does not say what replaces the model; ``predictor="mean"`` (the
history-wide mean, the variant's definition until 2026-11-22) is kept as a parameter for the sensitivity that
docs/baselines/tempo.md reports: a mean is not an upper bound, so it removes the conservative strategy too.

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
from slogym.workloads.profiling import default_history
from slogym.workloads.qrf import QRFConfig, QRFLengthPredictor, request_features

if TYPE_CHECKING:
    from slogym.core.simulator import Simulator

PREDICTORS = ("qrf", "oracle", "none", "mean")
GRAPHS = ("match", "oracle", "none")
ORDERS = ("lsdf", "sjf")
_TTLT, _LINE, _NONE = 0, 1, 2


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
        # no prediction model (Fig. 15 ablation): one length for every request, Tempo's quantile or the mean
        lens = hist.output_tokens if len(hist) else np.ones(1)
        self.flat_len = float(np.mean(lens) if self.predictor == "mean" else np.quantile(lens, self.quantile))
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
        if self.graph == "match":  # node and edge kernels kept apart: the live graph has one node fewer
            self.graph_nodes, self.graph_edges = GraphHistory(beta=1.0), GraphHistory(beta=0.0)
            self.graph_list: dict[str, list[SuperGraph]] = {}
            for app, g in graphs_of(hist, self.token_budget).values():
                name = hist.app_names[app]
                self.graph_nodes.add(name, g)
                self.graph_edges.add(name, g)
                self.graph_list.setdefault(name, []).append(g)
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
        if self.predictor in ("none", "mean"):
            return np.maximum(self.flat_len, gen + self.refresh_tokens).astype(np.float64)
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
            done = np.array([rs.generated[self.members[j]].sum() for j in sids[:-1]], np.float64)
            edge = np.array([w.input_tokens[self.members[j]].sum() for j in sids], np.float64)
            ratios = self._match(w.app_names[w.app[first]], done, edge)
        dl = end if ratios is None else stage_deadline(ratios, s, start, end)
        self.stage_dl[sid] = dl
        return dl

    def _match(self, app: str, done: np.ndarray, edge: np.ndarray) -> np.ndarray | None:
        """Stage times of the historical graph of ``app`` most similar to a live collective (§4.1, Fig. 7: its
        ``N = len(done)`` completed stages predict stage ``N + 1``), or None without history. Similarity is
        :class:`GraphHistory`'s ``0.5 * node + 0.5 * edge`` Gaussian kernels, the node term over the completed
        stages' outputs ``done``, the edge term over the inputs ``edge`` of those and of the starting stage
        (known at its submission), among historical graphs with more than ``N`` stages; at ``N = 0`` the edge
        term alone. Reconstructed: the paper does not say whether the starting stage's inputs are matched."""
        graphs = self.graph_list.get(app)
        if graphs is None:
            return None
        score = self.graph_edges.similarity(app, SuperGraph(np.ones_like(edge), edge))  # -inf: too few stages
        if done.size:
            score = 0.5 * score + 0.5 * self.graph_nodes.similarity(app, SuperGraph(done, edge[:-1]))
        best = int(np.argmax(score))
        return graphs[best].time if np.isfinite(score[best]) else None

    def _stage_deadlines(self, sids: np.ndarray) -> np.ndarray:
        """Deadlines of collective stages ``sids``, matching each stage once (cached in ``stage_dl``)."""
        dl = self.stage_dl[sids]
        missing = np.isnan(dl)
        if missing.any():
            for s in np.unique(sids[missing]).tolist():
                self._stage_deadline(s)
            dl = self.stage_dl[sids]
        return dl

    # ------------------------------------------------------------------ LSDF (§4.2, Eq. 4)
    def _remaining_time(self, idx: np.ndarray, tau: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(remaining output tokens ``R``, remaining prefill time, remaining processing time ``T``) of ``idx``."""
        rs = self.rs
        rem = rs.num_tokens[idx] - rs.num_computed[idx]
        t_pre = -(-np.where(rem > 1, rem, 0) // self.token_budget) * tau
        r_out = np.maximum(self.upper_bound(idx) - rs.generated[idx], 1.0)
        return r_out, t_pre, t_pre + r_out * tau

    def priority(self, idx: np.ndarray, inst: Instance, now: float) -> np.ndarray:
        """Priority of candidates ``idx``: service density (or 1/T for SJF), blended with fairness."""
        w, rs = self.w, self.rs
        tau = max(inst.last_dt, 1e-4)
        sid = self.sid[idx]
        coll = sid >= 0
        if self.order == "sjf" or not coll.any():
            r_out, t_pre, t_rem = self._remaining_time(idx, tau)
        else:  # Alg. 1 line 17-18: the stage's slowest live request sets the time
            sids, pos = np.unique(sid[coll], return_inverse=True)
            parts = [self.members[s] for s in sids.tolist()]
            m = np.concatenate(parts)
            live = rs.status[m] != Status.DONE
            owner = np.repeat(np.arange(sids.size), [x.size for x in parts])[live]
            r_out, t_pre, t_all = self._remaining_time(np.concatenate([idx, m[live]]), tau)  # one QRF call
            n = idx.size
            r_out, t_pre, t_rem = r_out[:n], t_pre[:n], t_all[:n].copy()
            stage_t = np.zeros(sids.size)
            np.maximum.at(stage_t, owner, t_all[n:])
            t_rem[coll] = stage_t[pos]
        p = 1.0 / t_rem if self.order == "sjf" else self._density(idx, r_out, t_pre, t_rem, sid, now)
        if self.fairness > 0:
            top = p.max(initial=0.0)
            att = self.served[w.app[idx]]
            fair = 1.0 - att / max(self.served.max(), 1.0)
            p = (1 - self.fairness) * (p / top if top > 0 else p) + self.fairness * fair
        return p

    def _term(self, gain: np.ndarray, dl: np.ndarray, t_ref: np.ndarray, t_need: np.ndarray,
              now: float) -> np.ndarray:
        """Density of one SLO term (Eq. 4, Alg. 1 lines 15-19): projected gain ``gain * f`` over the remaining
        process time ``t_need``, with ``f = min{1, ((dl - t_ref) / (now + t_need - t_ref))^alpha}`` (§3.1's
        decay of the estimated metric against its SLO); 0 without a deadline."""
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = (dl - t_ref) / np.maximum(now + t_need - t_ref, 1e-9)
            f = self.sim._decay(np.maximum(np.where(np.isfinite(dl), ratio, 1.0), 0.0))
            return np.where(np.isfinite(dl), gain * f / np.maximum(t_need, 1e-9), 0.0)

    def _density(self, idx: np.ndarray, r_out: np.ndarray, t_pre: np.ndarray, t_rem: np.ndarray,
                 sid: np.ndarray, now: float) -> np.ndarray:
        """Service density (Eq. 4) per SLO type: TTLT and collective requests one Eq. 2 term against their
        (stage) deadline over the remaining time ``t_rem``; latency-sensitive ones the two Eq. 3 terms -- the
        prompt against the TTFT deadline over the remaining prefill time while it is being prefilled, the
        remaining output against the deadline line of its last token over ``t_rem``."""
        w, rs = self.w, self.rs
        slo = self.slo[idx]
        stage = rs.stage[idx]
        in_decode = w.stage_kind[stage] == StageKind.DECODE
        gen, ready = rs.generated[idx], rs.ready[idx]
        # throughput-intensive / collective (Eq. 2)
        ttlt_dl = w.arrival[idx] + w.ttlt[idx]
        coll = np.flatnonzero(sid >= 0)
        if coll.size:
            ttlt_dl[coll] = self._stage_deadlines(sid[coll])
        t_ref = np.where(sid < 0, w.arrival[idx], ready)
        ttlt = self._term(self.wi * w.input_tokens[idx] + self.wo * (gen + r_out), ttlt_dl, t_ref, t_rem, now)
        # latency-sensitive (Eq. 3): TTFT term while prefilling, TBT term over the remaining output
        ttft_dl = np.where(in_decode, np.inf, ready + w.stage_ttft[stage])
        first = self._term(self.wi * w.stage_tokens[stage], ttft_dl, ready, t_pre, now)
        with np.errstate(invalid="ignore"):  # a TPOT of inf times a last-token index of 0: no line, inf
            line_dl = np.where(in_decode, rs.dl_base[idx] + (rs.gen_in_stage[idx] + r_out - 1) * rs.tpot[idx],
                               ready + w.stage_ttft[stage] + (r_out - 1) * w.min_tpot[idx])
        line_dl = np.where(np.isnan(line_dl), np.inf, line_dl)
        tbt = self._term(self.wo * r_out, line_dl, ready, t_rem, now)
        return np.select([slo == _TTLT, slo == _LINE], [ttlt, first + tbt], 0.0)

    # ------------------------------------------------------------------ Schedule (Alg. 1 lines 6-12)
    def next_batch(self, inst: Instance, now: float) -> Batch | None:
        dec, pre = split_running(inst)
        if not (dec.size or pre.size or inst.waiting):
            return None
        rs = self.rs
        cands = np.array(inst.running + inst.waiting, dtype=np.int64)
        p = self.priority(cands, inst, now)
        prio = dict(zip(cands.tolist(), p.tolist()))
        victims: list[int] = []
        free = inst.free_blocks
        if dec.size:  # running decodes must grow: evict the least dense (vLLM's rule, LSDF order)
            dec, victims, free = make_room_for_decodes(inst, dec, -p[:len(inst.running)])
        ranked = [r for r in cands[np.argsort(-p, kind="stable")].tolist() if r not in victims]
        insensitive = set(cands[(self.slo[cands] == _NONE) | rs.be[cands]].tolist())
        switched, free = self._switch(inst, ranked, prio, insensitive, dec, free, len(victims))
        if switched:
            gone = set(switched)
            dec = np.array([r for r in dec.tolist() if r not in gone], dtype=np.int64)
            ranked = [r for r in ranked if r not in gone]
            victims += switched
        # vLLM's chunked-prefill substrate: every running decode first, then prefill chunks -- running
        # (partial) prefills before waiting requests, each in LSDF order; SLO-insensitive requests FCFS
        is_dec = set(dec.tolist())
        running = set(inst.running)
        slo_pre = ([r for r in ranked if r in running and r not in is_dec and r not in insensitive]
                   + [r for r in ranked if r not in running and r not in insensitive])
        be_pre = sorted((r for r in ranked if r in insensitive and r not in is_dec),
                        key=lambda r: (r not in running, self.w.arrival[r]))
        res_tok = math.ceil(self.reserve * self.token_budget) if be_pre else 0
        res_seq = math.ceil(self.reserve * self.max_num_seqs) if be_pre else 0
        b = BatchBuilder(inst, self.token_budget - dec.size - res_tok, free, self.max_num_seqs - dec.size - res_seq)
        taken: set[int] = set()
        for group, release in ((slo_pre, False), (be_pre, True), (slo_pre, False)):
            if release:  # the reserve opens to SLO-insensitive requests, FCFS; backfilled by SLO requests after
                b.budget += res_tok
                b.max_seqs += res_seq
            for r in group:
                if b.full:
                    break
                if r not in taken and b.take(r):
                    taken.add(r)
        if not dec.size and not b.reqs and not victims:
            return unstick(inst, lambda r: -prio[r])
        reqs = dec.tolist() + b.reqs
        toks = [1] * dec.size + b.toks
        if self.fairness > 0:
            np.add.at(self.served, self.w.app[reqs], toks)
        steady = (self.fairness == 0 and not victims and not inst.waiting and not pre.size
                  and dec.size == len(inst.running))
        return batch_of(reqs, toks, victims, steady=steady)

    def _switch(self, inst: Instance, ranked: list[int], prio: dict[int, float], insensitive: set[int],
                dec: np.ndarray, free: int, n_evicted: int) -> tuple[list[int], int]:
        """Cost-aware preemption (§4.2): at most one switch per ``quantum`` iterations. The densest waiting SLO
        request, if its first chunk lacks free KV or a sequence slot, evicts running requests of lower density
        (least dense first) when the density gained over a quantum beats the service lost while the victims'
        KV is recomputed. ``ranked`` are the candidates left after KV-forced evictions (``n_evicted`` of them);
        returns the victims and the free KV blocks after the switch."""
        if inst.iterations - self.last_switch.get(inst.id, -self.quantum) < self.quantum:
            return [], free
        rs = self.rs
        waiting = set(inst.waiting)
        top = next((r for r in ranked if r in waiting and r not in insensitive), None)
        if top is None:
            return [], free
        chunk = min(int(inst.remaining([top])[0]), max(self.token_budget - dec.size, 1))
        need = int(inst.blocks_needed([top], chunk)[0])
        seats = self.max_num_seqs - (len(inst.running) - n_evicted)
        if need <= free and seats >= 1:
            return [], free
        growth = dict(zip(dec.tolist(), inst.blocks_needed(dec, 1).tolist()))  # reserved out of ``free``
        pool = [r for r in reversed(ranked) if r not in waiting and prio[r] < prio[top]]  # least dense first
        chosen: list[int] = []
        room = free
        for v in pool:
            if room >= need and seats >= 1:
                break
            chosen.append(v)
            room += int(rs.kv_blocks[v]) + growth.get(v, 0)
            seats += 1
        if room < need or seats < 1:
            return [], free
        tau = max(inst.last_dt, 1e-4)
        p_v = np.array([prio[v] for v in chosen])
        stall = -(-rs.num_computed[chosen] // self.token_budget) * tau
        if (prio[top] - p_v.sum()) * self.quantum * tau <= float((p_v * stall).sum()):
            return [], free
        self.last_switch[inst.id] = inst.iterations
        self.switches.append((inst.id, inst.iterations))
        return chosen, room


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

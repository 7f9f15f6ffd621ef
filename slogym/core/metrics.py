"""Per-request records and run summaries.

A request meets its SLO only if it was served (outcome ``finished`` or ``best_effort``) and, in the run's mode:

* ``strict``     every prefill stage within its TTFT and every inter-token gap within its stage's TPOT
* ``dslo``       every output token before its deadline line ``t_ref + ttft + k * tpot`` (PolyServe's DSLO,
                 SLOs-Serve's lines); a prefill not followed by a decode is judged by its TTFT
* ``mean_tpot``  every TTFT met and each decode stage's mean gap within its TPOT
* ``ttlt``       finished before ``arrival + ttlt`` (or, without a TTLT, before its last token's deadline)

and, in every mode, within its TTLT/end-to-end deadline when it has one. Comparisons allow 1 ns of float slack.
Requests flagged ``best_effort`` in the workload have no SLO: they count as met when served and are left out of
attainment. Tempo's service gain (Eq. 1-3): requests with a TTLT SLO get ``(w_i L_i + w_o L_o) f(SLO, TTLT)``;
others ``w_i L_i f(SLO_TTFT, TTFT) + w_o sum_k f_k``, with ``f = min{1, (SLO/metric)^alpha}``; ``alpha -> inf``
reduces Eq. 2 to goodput. The per-token terms ``f_k`` are accumulated while tokens are emitted
(``core/kernels.py``, ``RequestState.sg_out``). §3.1 defines them against the expected *progression*: "TBT and
SLO_TBT represent the actual and expected output progression ... If the request is paused or lags behind, such
that the actual number of generated tokens falls short of the expected length, the service gain of subsequent
tokens during that interval is penalized" -- every token behind the deadline line ``D_k = t_ref + ttft + k
tpot`` (the expected delivery timeline of Andes [65], which §3.1 follows) decays by
``f(D_k - t_ref, t_k - t_ref)``; a token on or ahead of it earns ``w_o`` (``kernels._emit_one``, with
``t_ref`` the ready time of the prefill that opened the decode stages, ``RequestState.line_ref``).
Tempo's unit is the *user* request: a collective (a DAG of LLM calls sharing one end-to-end deadline) is one
request of Eq. 2, its whole input and output weighted by ``f(SLO_TTLT, TTLT)`` with the TTLT from its arrival to
its last call's finish, meeting its SLO when that TTLT is within the deadline. The summary's ``service_gain``,
``goodput`` and ``attainment`` score every call (an early call of a collective that misses still counts as met);
``user_service_gain``, ``user_goodput`` and ``user_attainment`` score each collective once (equal to the per-call
figures on workloads without collectives).
The SA objective (SA paper Eq. 2) is attainment divided by the mean end-to-end latency of served requests.
Cost: ``cost_instance_seconds`` sums every instance's life, cold start included (HyperFlexis' cost unit, §3
Eq. 3 and §8: cumulative instance time); ``cost_per_request`` divides it by the served requests (finished or
best-effort), the per-request cost PolyServe reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from numba import njit

from slogym.core.instance import Role
from slogym.core.state import OUTCOME_NAMES, Outcome

if TYPE_CHECKING:
    from slogym.core.simulator import Simulator

EPS = 1e-9
PERCENTILES = (50, 90, 99)
FINISHED, BEST_EFFORT = int(Outcome.FINISHED), int(Outcome.BEST_EFFORT)


MODES = ("strict", "dslo", "mean_tpot", "ttlt")
"""Attainment modes, in the order :func:`verdict` numbers them."""


@njit(cache=True, nogil=True)
def verdict(r: int, mode: int, outcome: np.ndarray, arrival: np.ndarray, ttlt: np.ndarray, finish: np.ndarray,
            ttft_slack: np.ndarray, tpot_slack: np.ndarray, dslo_slack: np.ndarray, mean_slack: np.ndarray,
            final_deadline: np.ndarray, no_slo: np.ndarray) -> bool:
    """Whether request ``r`` met its SLO in mode ``MODES[mode]`` (the rules of the module docstring); the
    arrays are :func:`verdict_arrays`' (compiled: the env judges the requests finished since its last step)."""
    if outcome[r] != FINISHED and outcome[r] != BEST_EFFORT:
        return False
    if no_slo[r]:
        return True
    if not finish[r] - arrival[r] <= ttlt[r] + EPS:
        return False
    if mode == 3:  # ttlt: the TTLT, or without one the last token's deadline
        implied = arrival[r] + ttlt[r] if np.isfinite(ttlt[r]) else final_deadline[r]
        return finish[r] <= implied + EPS
    if not ttft_slack[r] >= -EPS:
        return False
    if mode == 0:
        return tpot_slack[r] >= -EPS
    if mode == 1:
        return dslo_slack[r] >= -EPS
    return mean_slack[r] >= -EPS


@njit(cache=True, nogil=True)
def _verdicts_into(idx: np.ndarray, modes: np.ndarray, outcome: np.ndarray, arrival: np.ndarray, ttlt: np.ndarray,
                   finish: np.ndarray, ttft_slack: np.ndarray, tpot_slack: np.ndarray, dslo_slack: np.ndarray,
                   mean_slack: np.ndarray, final_deadline: np.ndarray, no_slo: np.ndarray, out: np.ndarray) -> None:
    for k in range(modes.size):
        for j in range(idx.size):
            out[k, j] = verdict(idx[j], modes[k], outcome, arrival, ttlt, finish, ttft_slack, tpot_slack,
                                dslo_slack, mean_slack, final_deadline, no_slo)


def verdict_arrays(sim: "Simulator") -> tuple[np.ndarray, ...]:
    """The per-request arrays :func:`verdict` reads, in its argument order (fixed for a simulator's run)."""
    rs, w = sim.rs, sim.w
    return (rs.outcome, w.arrival, w.ttlt, rs.finish, rs.ttft_slack, rs.tpot_slack, rs.dslo_slack, rs.mean_slack,
            rs.final_deadline, w.best_effort)


def slo_verdicts(sim: "Simulator", idx: np.ndarray | None = None,
                 modes: tuple[str, ...] = MODES) -> dict[str, np.ndarray]:
    """Boolean SLO verdict per request (all, or those in ``idx``) in each of ``modes`` (default: all)."""
    idx = np.arange(len(sim.w)) if idx is None else np.asarray(idx, dtype=np.int64).reshape(-1)
    codes = np.array([MODES.index(m) for m in modes], np.int64)
    out = np.empty((len(modes), idx.size), np.bool_)
    _verdicts_into(idx, codes, *verdict_arrays(sim), out)
    return dict(zip(modes, out))


def service_gain(sim: "Simulator", idx: np.ndarray | None = None) -> np.ndarray:
    """Tempo service gain per request (Eq. 1-3); 0 for requests not served."""
    rs, w = sim.rs, sim.w
    sel = slice(None) if idx is None else idx
    wi, wo = sim.sg_weights
    outcome = rs.outcome[sel]
    served = (outcome == Outcome.FINISHED) | (outcome == Outcome.BEST_EFFORT)
    ttlt = w.ttlt[sel]
    has_ttlt = np.isfinite(ttlt)
    e2e = rs.finish[sel] - w.arrival[sel]
    with np.errstate(divide="ignore", invalid="ignore"):
        f_ttlt = sim._decay(np.where(has_ttlt, ttlt / e2e, np.inf))
    full = (wi * w.input_tokens[sel] + wo * rs.generated[sel]) * f_ttlt
    per_token = rs.sg_in[sel] + wo * rs.sg_out[sel]
    return np.where(served, np.where(has_ttlt, full, per_token), 0.0)


def user_request_scores(sim: "Simulator", met: np.ndarray, gain: np.ndarray) -> dict[str, float]:
    """With each collective as one request (Tempo §3.1 Eq. 2; see the module docstring): the service gain, the
    requests meeting their SLO (``met``; best-effort ones count when served, as in ``goodput``), those of them
    with an SLO (``met_scored``) and the requests with an SLO (``n``); ``met``/``gain``: per-call verdicts and
    gains. A collective arrives with its earliest call and takes that call's end-to-end deadline and best-effort
    flag (the generators give every call of a group the same). It meets its SLO when every call was served
    (finished or best-effort) and its last call finished within the deadline (the per-call verdicts' 1 ns
    slack); its gain is Eq. 2 with that TTLT, and 0 when a call was not served (rejected, dropped, failed)."""
    w, rs = sim.w, sim.rs
    single = w.group < 0
    scored = ~w.best_effort
    out = {"gain": float(gain[single].sum()), "met": int(met[single].sum()),
           "met_scored": int((met & scored)[single].sum()), "n": int(scored[single].sum())}
    calls = np.flatnonzero(~single)
    if not calls.size:
        return out
    calls = calls[np.lexsort((w.arrival[calls], w.group[calls]))]  # by group, its earliest call first
    new = np.r_[True, w.group[calls][1:] != w.group[calls][:-1]]
    g = np.cumsum(new) - 1  # each call's group number
    head = calls[new]
    outcome = rs.outcome[calls]
    all_served = np.bincount(g, (outcome != Outcome.FINISHED) & (outcome != Outcome.BEST_EFFORT),
                             minlength=head.size) == 0
    finish = np.full(head.size, -np.inf)
    np.maximum.at(finish, g, rs.finish[calls])
    wi, wo = sim.sg_weights
    tokens = np.bincount(g, wi * w.input_tokens[calls] + wo * rs.generated[calls], minlength=head.size)
    ttlt, deadline, be = finish - w.arrival[head], w.ttlt[head], w.best_effort[head]
    made = all_served & (be | (ttlt <= deadline + EPS))
    with np.errstate(divide="ignore", invalid="ignore"):
        out["gain"] += float(np.where(all_served, tokens * sim._decay(deadline / ttlt), 0.0).sum())
    out["met"] += int(made.sum())
    out["met_scored"] += int((made & ~be).sum())
    out["n"] += int((~be).sum())
    return out


def _pct(x: np.ndarray, prefix: str) -> dict[str, float]:
    x = x[np.isfinite(x)]
    if not x.size:
        return {f"{prefix}_p{p}": float("nan") for p in PERCENTILES} | {f"{prefix}_mean": float("nan")}
    out = {f"{prefix}_p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(x, PERCENTILES))}
    out[f"{prefix}_mean"] = float(x.mean())
    return out


@dataclass
class RunResult:
    """A finished run: ``records`` (one row per request) and ``summary`` (a plain dict)."""

    records: pd.DataFrame
    summary: dict[str, Any]
    events: list[tuple[float, str, int, int, int]] = field(default_factory=list)

    @classmethod
    def from_simulator(cls, sim: "Simulator") -> "RunResult":
        return cls(request_records(sim), run_summary(sim), list(sim.events))

    def to_parquet(self, path: str) -> None:
        self.records.to_parquet(path, index=False)


def _served(rs: Any) -> np.ndarray:
    return (rs.outcome == Outcome.FINISHED) | (rs.outcome == Outcome.BEST_EFFORT)


def _mean_tpot(rs: Any) -> np.ndarray:
    """Mean gap between a request's output tokens (NaN below two tokens)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rs.generated > 1, (rs.last_token - rs.first_token) / (rs.generated - 1), np.nan)


def request_records(sim: "Simulator") -> pd.DataFrame:
    rs, w = sim.rs, sim.w
    verdicts = slo_verdicts(sim)
    served = _served(rs)
    names = np.array([OUTCOME_NAMES[Outcome(o)] for o in range(len(Outcome))])
    df = pd.DataFrame({
        "request_id": np.arange(len(w)),
        "app": np.array(w.app_names, dtype=object)[w.app],
        "tier": np.array(w.tier_names, dtype=object)[w.tier],
        "arrival": w.arrival,
        "ttft": rs.first_token - w.arrival,
        "max_tpot": np.where(rs.generated > 1, rs.max_gap, np.nan),
        "mean_tpot": _mean_tpot(rs),
        "ttlt": np.where(served, rs.finish - w.arrival, np.nan),
        "slo_met": verdicts[sim.attainment],
        "outcome": names[rs.outcome],
        "service_gain": service_gain(sim),
        "instance": rs.instance,
        "input_tokens": w.input_tokens,
        "output_tokens": w.output_tokens,
        "generated_tokens": rs.generated,
        "computed_tokens": rs.computed_total,
        "recomputed_tokens": rs.recomputed,
        "n_preemptions": rs.n_preempt,
        "best_effort": rs.be,
        "priority": w.priority,
        "group": w.group,
        "ttft_slo": w.first_ttft,
        "tpot_slo": w.min_tpot,
        "ttlt_slo": w.ttlt,
    })
    for m, v in verdicts.items():
        df[f"slo_met_{m}"] = v
    return df


def instance_seconds(sim: "Simulator") -> list[float]:
    """Each instance's cost in instance-seconds (HyperFlexis Eq. 3 with a unit cost of 1 per second): from its
    start request (cold start included) to its stop, or to the end of the run (its last outcome) while alive; an
    instance asked for, or stopped, after that is charged up to it only."""
    end = sim.end_time
    return [max(min(end if i.stopped_at is None else i.stopped_at, end) - i.started_at, 0.0) for i in sim.instances]


def _nanmean(x: np.ndarray) -> float:
    """Mean of the non-NaN entries (NaN if none), summed as pandas' ``Series.mean`` sums: NaNs replaced by 0,
    then NumPy's pairwise sum over the whole array."""
    nan = np.isnan(x)
    n = x.size - int(nan.sum())
    return float(np.where(nan, 0.0, x).sum() / n) if n else float("nan")


def _attainment(met: np.ndarray, group: np.ndarray, names: list[str]) -> dict[str, float]:
    """Attainment per group (codes ``group`` into ``names``), groups with requests only, sorted by name."""
    hits = np.bincount(group, weights=met, minlength=len(names))
    counts = np.bincount(group, minlength=len(names))
    return {str(names[g]): float(hits[g] / counts[g]) for g in sorted(np.flatnonzero(counts), key=lambda g: names[g])}


def pd_split_used(sim: Simulator) -> list[int] | None:
    """The prefill/decode split ``[P, D]`` the run used: ``Simulator(pd=...)``'s, or the roles a policy gave a
    colocated cluster itself (DistServe, PolyServe's PD variants, RR-PD, HyperFlexis P/D; counted at the end of the
    run); ``None`` for a colocated run."""
    if sim.pd is not None:
        return list(sim.pd)
    roles = [i.role for i in sim.instances]
    if all(r == Role.COLOCATED for r in roles):
        return None
    return [sum(r == Role.PREFILL for r in roles), sum(r == Role.DECODE for r in roles)]


def run_summary(sim: "Simulator") -> dict[str, Any]:
    """The run's summary, computed from the simulator's arrays (no per-request table: the env's terminal step
    builds one per episode). Means and sums are taken as the ``records`` table's pandas ones would be."""
    w, rs = sim.w, sim.rs
    verdicts = slo_verdicts(sim)
    met = verdicts[sim.attainment]
    has_slo = ~w.best_effort
    n_scored = int(has_slo.sum())
    t0 = float(w.arrival[0]) if len(w) else 0.0
    span = max(sim.end_time - t0, 1e-9)
    served = _served(rs)
    n_served = int(served.sum())
    attainment = float(met[has_slo].sum() / n_scored) if n_scored else float("nan")
    ttlt = (rs.finish - w.arrival)[served]
    mean_latency = _nanmean(ttlt) if n_served else float("nan")
    inst_seconds = instance_seconds(sim)
    gain = service_gain(sim)
    gain_total = float(np.where(np.isnan(gain), 0.0, gain).sum())
    outcome_counts = np.bincount(rs.outcome, minlength=len(Outcome))
    user = user_request_scores(sim, met, np.where(np.isnan(gain), 0.0, gain))
    summary: dict[str, Any] = {
        "workload": w.name,
        "policy": sim.policy.name,
        "engine": sorted({i.engine.name for i in sim.instances}),
        "n_instances": len(sim.instances),
        "pd": pd_split_used(sim),
        "seed": sim.seed,
        "attainment_mode": sim.attainment,
        "n_requests": len(w),
        "attainment": attainment,
        "attainment_by_app": _attainment(met[has_slo], w.app[has_slo], list(w.app_names)),
        "attainment_by_tier": _attainment(met[has_slo], w.tier[has_slo], list(w.tier_names)),
        "attainment_modes": {m: float(v[has_slo].sum() / n_scored) if n_scored else float("nan")
                             for m, v in verdicts.items()},
        "slo_met": int(met.sum()),
        "goodput": int(met.sum()) / span,
        "throughput": float(n_served) / span,
        "token_throughput": float(rs.generated.sum()) / span,
        "service_gain": gain_total,
        "service_gain_rate": gain_total / span,
        "sa_objective": attainment / mean_latency if mean_latency > 0 else float("nan"),
        "user_requests": user["n"],
        "user_attainment": user["met_scored"] / user["n"] if user["n"] else float("nan"),
        "user_slo_met": user["met"],
        "user_goodput": user["met"] / span,
        "user_service_gain": user["gain"],
        "user_service_gain_rate": user["gain"] / span,
        "cost_instance_seconds": float(sum(inst_seconds)),
        "cost_per_request": float(sum(inst_seconds)) / n_served if n_served else float("nan"),
        "kv_transfers": int(sim.kv_transfers),
        "utilization": float(sum(i.busy_time for i in sim.instances) / max(sum(inst_seconds), 1e-9)),
        "outcomes": {OUTCOME_NAMES[o]: int(outcome_counts[o]) for o in Outcome if o != Outcome.NONE},
        "dropped_reasons": dict(sorted(sim.dropped_reasons.items())),
        "preemptions": int(rs.n_preempt.sum()),
        "recomputed_tokens": int(rs.recomputed.sum()),
        "iterations": int(sum(i.iterations for i in sim.instances)),
        "ff_iterations": int(sim.ff_iterations),
        "pilot_iterations": int(sim.pilot_iterations),
        "sim_seconds": float(sim.end_time),
        "wall_seconds": float(sim.wall_seconds),
    }
    summary.update(_pct((rs.first_token - w.arrival)[served], "ttft"))
    summary.update(_pct(_mean_tpot(rs)[served], "tpot"))
    summary.update(_pct(ttlt, "ttlt"))
    summary["requests_per_wall_second"] = len(w) / summary["wall_seconds"] if summary["wall_seconds"] else None
    return {k: float(v) if isinstance(v, np.floating) else v for k, v in summary.items()}

"""PolyServe's compiled loops (slogym.baselines.polyserve_kernels) against their NumPy / Python definitions: the
profile table and its inverse, the fleet row refresh and insertion, the future KV peak, the deadline order, the
one-pass routing rule, the PD prefill queue replay; and fast-forwarding once the fleet is settled changes no result."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import FF_FIELDS, assert_runs_equal
from slogym.baselines import make_policy
from slogym.baselines import polyserve_kernels as pk
from slogym.baselines.polyserve import POLICIES, ProfileTable, prefill_profile_table, profile_table
from slogym.core.policy import DEFER
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.core.state import I_GEN, I_NC, I_NT
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload

ENGINE = get_engine("llama3-8b-h200")
TABLE = profile_table(ENGINE)


# ---------------------------------------------------------------------------------------------- profile table
def test_table_time_and_budget_equal_their_numpy_definitions_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    on_grid = max(TABLE.tokens.size, TABLE.kv.size)  # exact grid points of both axes
    tok = np.concatenate((rng.integers(0, 20_000, 2000), np.resize(TABLE.tokens, on_grid), [0, 1, 10**6]))
    kv = np.concatenate((rng.integers(0, 1_500_000, 2000), np.resize(TABLE.kv, on_grid), [0, 0, 10**7]))
    ref = TABLE.time(tok, kv)
    got = np.array([pk.table_time(TABLE.tokens, TABLE.kv, TABLE.times, float(t), float(k)) for t, k in zip(tok, kv)])
    assert np.array_equal(got, ref)
    assert [TABLE.time_one(int(t), int(k)) for t, k in zip(tok[:50], kv[:50])] == ref[:50].tolist()
    for tpot in (0.02, 0.05, 0.1, 0.037, np.inf):  # tiers, a TPOT between tiers, no TPOT
        grid, curve = TABLE.budget_curve(tpot)
        x = np.concatenate((kv.astype(np.float64), grid, [-1.0, grid[-1] + 1.0]))
        assert np.array_equal(np.array([pk.interp(v, grid, curve) for v in x]), np.interp(x, grid, curve))
        assert [TABLE.token_budget_one(int(k), tpot) for k in kv[:300]] == TABLE.token_budget(kv[:300], tpot).tolist()


# ---------------------------------------------------------------------------------------------- fleet rows
def _state(rng: np.random.Generator, n_req: int) -> np.ndarray:
    I = np.zeros((n_req, 8), np.int64)
    I[:, I_NT] = rng.integers(1, 5000, n_req)
    I[:, I_NC] = np.where(rng.random(n_req) < 0.7, I[:, I_NT] - 1, rng.integers(0, I[:, I_NT]))
    I[:, I_GEN] = rng.integers(0, 400, n_req)
    return I


def _brute_peak(rem: list[int], ctx: list[int], c0: int, r0: int) -> int:
    """Step the future iterations one by one: each resident holds c + k tokens while k < its remaining."""
    rs, cs = rem + [r0], ctx + [c0]
    return max(sum(c + k for r, c in zip(rs, cs) if r > k) for k in range(max(rs)))


def test_observe_row_equals_the_numpy_refresh_and_place_row_keeps_it_sorted() -> None:
    rng = np.random.default_rng(1)
    n_req, tiers = 3000, 4
    # predicted remaining output by tokens generated: the paper's (average 150 minus generated) and an arbitrary
    # curve (the residual mode's shape is data-dependent; the sort must hold for any values >= 1)
    curves = [np.maximum(150 - np.arange(151), 1), rng.integers(1, 700, 300)]
    I = _state(rng, n_req)
    rtier = rng.integers(0, tiers + 1, n_req)
    rtpot = rng.choice([0.02, 0.03, 0.05, 0.1, np.inf], n_req)
    be = rng.random(n_req) < 0.1
    shape = (3, 8)
    rem, csum, pb, sa = (np.zeros(shape, np.int64) for _ in range(4))
    n_res, kv_now, q_pre, q_slo, tight = (np.zeros(3, np.int64) for _ in range(5))
    for trial in range(200):
        res = rng.choice(n_req, int(rng.integers(0, 8)), replace=False)
        resid = curves[trial % 2].astype(np.int64)
        got = pk.observe_row(I, res, rtier, rtpot, be, resid, rem, csum, pb, sa, n_res, kv_now, q_pre, q_slo, tight,
                             1, tiers + 1)
        left = resid[np.minimum(I[res, I_GEN], resid.size - 1)]
        order = np.argsort(-left, kind="stable")
        n = res.size
        assert rem[1, :n].tolist() == left[order].tolist()
        assert csum[1, :n].tolist() == np.cumsum(I[res, I_NT][order]).tolist()
        todo = I[res, I_NT] - I[res, I_NC]
        assert (n_res[1], kv_now[1], q_pre[1]) == (n, I[res, I_NT].sum(), todo.sum())
        assert q_slo[1] == todo[~be[res]].sum()  # best-effort prompts run last: not ahead of a new SLO prompt
        # a demoted (best-effort) resident counts at the best-effort tier, whatever its TPOT tier
        assert tight[1] == (np.where(be[res], tiers, rtier[res]).min() if n else tiers + 1)
        assert got == float(np.where(be[res], np.inf, rtpot[res]).min()) if n else got == np.inf
        # a placement inserts into the sorted row; the maxima it keeps give the stepped future KV peak
        if n < shape[1] - 1:
            r0, ctx = int(rng.integers(1, 300)), int(rng.integers(1, 3000))
            pk.place_row(rem, csum, pb, sa, 1, n, r0, ctx)
            lens = np.append(I[res, I_NT][order], ctx)
            rems = np.append(left[order], r0)
            again = np.argsort(-rems, kind="stable")
            assert rem[1, :n + 1].tolist() == rems[again].tolist()
            assert csum[1, :n + 1].tolist() == np.cumsum(lens[again]).tolist()
            c0, r1 = int(rng.integers(1, 3000)), int(rng.integers(1, 300))
            peak = pk.future_kv_peak_one(rem, csum, pb, sa, 1, n + 1, c0, r1)
            assert peak == _brute_peak(rem[1, :n + 1].tolist(), lens[again].tolist(), c0, r1)


def test_deadline_order_equals_lexsort() -> None:
    rng = np.random.default_rng(2)
    n_req = 500
    ready = rng.choice([0.0, 0.5, 1.0, 2.0], n_req)   # ties on purpose
    arrival = rng.choice([0.0, 0.25, 0.5], n_req)
    stage = rng.integers(0, 3, n_req)
    ttft = np.array([0.3, 1.0, np.inf])
    be = rng.random(n_req) < 0.2
    for size in (2, 3, 7, 64, 300):
        c = rng.choice(n_req, size, replace=False)
        dl = np.where(be[c], np.inf, ready[c] + ttft[stage[c]])
        ref = c[np.lexsort((arrival[c], dl))]
        assert pk.deadline_order(c, ready, stage, ttft, be, arrival).tolist() == ref.tolist()


# ---------------------------------------------------------------------------------------------- routing
def _python_rule(router: object, req: int, now: float) -> tuple[int, bool]:
    """Steps 1-3 written out over the vectorized admission: the candidates (hosting labels, then scale-up),
    the nearest admitting host tier, then the highest load (first on ties); scale-up only if no host admits."""
    fleet = router.core.fleet
    t = int(fleet.rtier[req])
    rank = fleet.host_rank[t][fleet.label]
    up = np.zeros(fleet.label.size, bool)
    if t < fleet.n_tiers:
        up = fleet.idle_label[fleet.label] & (fleet.res_tight >= t)
    j = np.flatnonzero((rank < pk.NO_HOST) | up)
    if not j.size:
        return -1, False
    tpot = np.where(up[j], fleet.tiers[min(t, fleet.n_tiers - 1)], fleet.label_tpot[fleet.label[j]])
    v = router.admission(j, req, now, tpot)
    own = v.ok & ~up[j]
    if own.any():
        sel = own & (rank[j] == rank[j][own].min())
        return int(j[np.argmax(np.where(sel, v.load, -1.0))]), False
    if (v.ok & up[j]).any():
        return int(j[np.argmax(np.where(v.ok & up[j], v.load, -1.0))]), True
    return -1, False


def test_one_pass_routing_equals_the_rule_over_admission_verdicts() -> None:
    rng = np.random.default_rng(3)
    tiers = (0.02, 0.03, 0.05, 0.1)
    reqs = [Request(0.0, [prefill(int(rng.integers(50, 3000)), float(rng.choice([0.3, 0.5, 1.0]))),
                          decode(int(rng.integers(2, 400)), float(rng.choice(tiers)))]) for _ in range(600)]
    w = Workload.from_requests(reqs)
    checked = 0
    for trial in range(30):
        pol = POLICIES["polyserve-co"](ENGINE)
        sim = Simulator(w, ENGINE, pol, n_instances=12)
        pol.reset(sim)
        sim.rs.num_tokens[:] = sim.rs.stage_len
        fleet, router = pol.router.core.fleet, pol.router
        fleet.label[:] = rng.choice([0, 1, 2, 3, fleet.POOL, fleet.PENDING], fleet.label.size)
        nxt = iter(range(100, 600))
        for j in range(fleet.label.size):
            for _ in range(int(rng.integers(0, 40))):
                r = next(nxt)
                fleet.place(j, r, int(sim.rs.num_tokens[r]), int(rng.integers(0, 2)) * int(sim.rs.num_tokens[r]))
        fleet.busy_until[:] = rng.uniform(0.0, 0.3, fleet.label.size)

        def place(req: int, now: float, memo: tuple[np.ndarray, np.ndarray]) -> tuple[int, bool]:
            t = int(fleet.rtier[req])
            ctx, prompt, r0, deadline, xfer = router._request(req, False)
            got = pk.place(t, fleet.n_tiers, fleet.label, fleet.host_rank[t], fleet.idle_label, fleet.res_tight,
                           False, fleet.engine_of, xfer, fleet.grid, fleet.curves, fleet.row_tpot, fleet.rem,
                           fleet.csum, fleet.pb, fleet.sa, fleet.n_res, fleet.q_slo, fleet.kv_now,
                           fleet.busy_until, fleet.cap, fleet.max_seqs, fleet.table.tokens, fleet.table.kv,
                           fleet.table.times, fleet.ptable.tokens, fleet.ptable.kv, fleet.ptable.times, *memo, ctx,
                           prompt, r0, now, deadline)
            return int(got[0]), bool(got[1]) if got[0] >= 0 else False

        memo = (fleet.admit_key, fleet.admit_val)  # shared by every call below, as in a run
        for now in (0.0, 0.1, 0.0):  # the same requests again: the memo answers, at other times too
            for req in range(40):
                ref = _python_rule(router, req, now)
                assert place(req, now, memo) == ref
                checked += ref[0] >= 0
            # a row that changes (one more resident) is evaluated afresh
            fleet.place(int(rng.integers(fleet.label.size)), 599 - trial, 50, 50)
    assert checked > 300  # most requests found an instance: the comparison covered real choices


# ---------------------------------------------------------------------------------------------- fast-forward
@pytest.mark.parametrize("name", ["polyserve-co", "polyserve-co-minimal", "polyserve-pd"])
def test_steady_only_once_settled_and_fast_forward_changes_nothing(name: str) -> None:
    """PD: a decode side of 4 (one instance per tier) with batches of at most 16, so hand-offs pend."""
    w = make_workload("polyserve-tiers", rate=60.0, n_requests=300, seed=4, engine=ENGINE)
    pd = name.startswith("polyserve-pd")
    cluster = {"pd": (2, 4)} if pd else {"n_instances": 4}
    runs = {}
    for ff in (True, False):
        pol = make_policy(name, ENGINE, **({"max_num_seqs": 16} if pd else {}))
        inner = pol.scheduler.next_batch
        seen: list[tuple[bool, bool]] = []

        def next_batch(inst: object, now: float, inner=inner, pol=pol, seen=seen) -> object:
            batch = inner(inst, now)
            fleet = pol.router.core.fleet
            all_routed = fleet.routed.all() and not fleet.sim.global_queue
            seen.append((batch is not None and batch.steady, all_routed))
            return batch

        pol.scheduler.next_batch = next_batch
        deferred: list[int] = []
        if pd:
            def route_decode(req: int, sim: object, now: float, inner=pol.router.route_decode) -> int:
                i = inner(req, sim, now)
                deferred.extend([req] if i == DEFER else [])
                return i

            pol.router.route_decode = route_decode
        sim = Simulator(w, ENGINE, pol, fast_forward=ff, **cluster)
        sim.run()
        runs[ff] = sim.result()
        if pd:
            assert deferred and sim.kv_transfers == len(w) and not sim.dropped_reasons
        steady = [s for s, _ in seen if s]
        assert all(routed for s, routed in seen if s), "a steady batch before every request was routed"
        assert steady, "no batch was steady after the fleet settled"
        if ff:
            assert sim.ff_iterations > 0
    assert_runs_equal(runs[True], runs[False], ignore=FF_FIELDS)


# ---------------------------------------------------------------------------------------------- PD prefill queue
def _prefill_ends(left: list[int], past: list[int], budget: int, max_seqs: int, t0: float,
                  pt: ProfileTable) -> list[float]:
    """Iteration by iteration, as ``PolyScheduler._prefill_batch`` forms them: prompts in order, each taking
    ``dynamic_chunk`` of the budget left, at most ``max_seqs`` per iteration; timed at the chunks' mean past."""
    rem, done, ends, t = list(left), list(past), [t0 if x == 0 else None for x in left], t0
    while any(e is None for e in ends):
        b, chunks = budget, []
        for m, r in enumerate(rem):
            if b <= 0 or len(chunks) >= max_seqs:
                break
            if r:
                c, b = pk.dynamic_chunk(r, b)
                chunks.append((m, c))
        tokens = sum(c for _, c in chunks)
        t += pt.time_one(tokens, sum(c * done[m] for m, c in chunks) / tokens)
        for m, c in chunks:
            rem[m] -= c
            done[m] += c
            if not rem[m]:
                ends[m] = t
    return ends


PT = prefill_profile_table(ENGINE)


def test_prefill_finish_forms_the_schedulers_iterations() -> None:
    rng = np.random.default_rng(5)
    for _ in range(100):
        n = int(rng.integers(1, 9))
        left = rng.integers(0, 5000, n) * (rng.random(n) < 0.9)
        past = rng.integers(0, 3000, n)
        budget, seqs = int(rng.choice([256, 1024])), int(rng.integers(1, 4))
        fin = np.full(n, -1.0)
        pk.prefill_finish(left.astype(np.int64), past.astype(np.int64), budget, seqs, 0.5, PT.tokens, PT.kv,
                          PT.times, fin)
        np.testing.assert_allclose(fin, _prefill_ends(left.tolist(), past.tolist(), budget, seqs, 0.5, PT),
                                   rtol=1e-12)

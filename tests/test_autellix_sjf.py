"""SJF / LAS / Autellix PLAS: priority order on constructed states, clean end-to-end runs (one outcome per request,
determinism, fast-forward identity) and SJF's mean-TTLT advantage over FCFS on a mixed-length workload."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ToyEngine
from helpers import FF_FIELDS, assert_runs_equal
from slogym.baselines import make_policy
from slogym.baselines.autellix import POLICIES as AUTELLIX
from slogym.baselines.sjf import POLICIES as SJF
from slogym.core.request import Request, Workload, decode, prefill
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome, Status
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload

POLICIES = SJF | AUTELLIX
ENGINE = get_engine("llama3-8b-h100")


def _run(w, name, engine=ENGINE, fast_forward=True, **params):
    pol = POLICIES[name](engine, **params) if name in POLICIES else make_policy(name, engine, **params)
    return Simulator(w, engine, pol, seed=3, fast_forward=fast_forward).run()


def _fresh(w, name, **params):
    """A simulator whose policy is reset but not run: request state can be set by hand."""
    pol = POLICIES[name](ToyEngine(), **params)
    sim = Simulator(w, ToyEngine(), pol)
    pol.reset(sim)
    return sim, pol.scheduler


def _order(sched, sim, reqs, now=0.0):
    level, key = sched.priorities(sim.instances[0], np.array(reqs, np.int64), now)
    return [reqs[j] for j in np.lexsort((reqs, key, level))]


def test_sjf_orders_by_predicted_output_length():
    reqs = [Request(0.0, [prefill(10), decode(n)], app=a) for n, a in ((300, "long"), (10, "short"), (80, "mid"))]
    w = Workload.from_requests(reqs * 3)  # 9 requests; the history (first third) sees each app once
    sim, sched = _fresh(w, "sjf", history_fraction=1 / 3)
    assert _order(sched, sim, [0, 1, 2]) == [1, 2, 0]
    sim, sched = _fresh(w, "sjf-oracle")
    assert _order(sched, sim, [3, 4, 5]) == [4, 5, 3]


def test_sjf_admits_shortest_first_when_slots_are_scarce():
    """One sequence slot: after the blocker, the queued requests start shortest (predicted) first."""
    long_, short, mid = ([prefill(10), decode(n)] for n in (300, 5, 60))
    w = Workload.from_requests([Request(0.0, [prefill(10), decode(20)], app="blocker"),
                                Request(0.001, long_, app="long"), Request(0.002, short, app="short"),
                                Request(0.003, mid, app="mid")])
    sim = _run(w, "sjf-oracle", ToyEngine(max_num_seqs=1))
    start = sim.rs.first_scheduled
    assert start[0] < start[2] < start[3] < start[1]


def _collective_state(name, **params):
    """Program 0 = group 0: requests 0, 1 (stage 0, done, 600 tokens each) and 2 (stage 1, a fresh call);
    standalone 3 (900 tokens) and 4 (100 tokens)."""
    stage = [prefill(10), decode(10)]
    w = Workload.from_requests([Request(0.0, stage, group=0, group_stage=0),
                                Request(0.0, stage, group=0, group_stage=0),
                                Request(0.0, stage, group=0, group_stage=1),
                                Request(0.1, stage), Request(0.2, stage)])
    sim, sched = _fresh(w, name, quantum=256, **params)
    rs = sim.rs
    rs.computed_total[:] = [600, 600, 0, 900, 100]
    rs.status[:] = [Status.DONE, Status.DONE, Status.WAITING, Status.WAITING, Status.WAITING]
    return sim, sched


def test_plas_charges_a_program_for_the_service_of_all_its_requests():
    sim, sched = _collective_state("autellix")
    # program 0 has attained 1200 tokens: its fresh call 2 goes after 3 (900) and 4 (100)
    assert sched.program_service(sim.instances[0], np.array([2, 3, 4])).tolist() == [1200, 900, 100]
    assert _order(sched, sim, [2, 3, 4]) == [4, 3, 2]
    sim, sched = _collective_state("las")  # per-request LAS: the fresh call has attained nothing
    assert _order(sched, sim, [2, 3, 4]) == [2, 4, 3]


def test_plas_promotes_a_starving_program():
    sim, sched = _collective_state("autellix", starvation_ratio=2.0)
    served, waited = sched.served, sched.waited
    served[int(sched.program[2])] = 10**10                 # program 0 ran 10 s and waited 1 s: not starving
    served[int(sched.program[3])] = 10**9                  # request 3 ran 1 s and has waited 2.9 s by t = 1
    waited[int(sched.program[3])] = 2 * 10**9
    level, _ = sched.priorities(sim.instances[0], np.array([2, 3, 4]), 1.0)
    assert level.tolist() == [3, 0, 0]                     # 3 promoted from queue 2; 4 is in queue 0 anyway
    assert _order(sched, sim, [2, 3, 4], 1.0) == [3, 4, 2]  # FCFS within the top queue


@pytest.mark.parametrize("scenario,n", [("tempo-mix", 48), ("chatbot", 80)])
@pytest.mark.parametrize("name", list(POLICIES))
def test_end_to_end_clean_deterministic_and_fast_forward_exact(scenario, n, name):
    w = make_workload(scenario, n_requests=n, seed=2, engine=ENGINE)
    a, b, step = _run(w, name), _run(w, name), _run(w, name, fast_forward=False)
    assert (a.rs.outcome == Outcome.FINISHED).all()
    ra = a.result()
    assert len(ra.records) == len(w) and ra.records["outcome"].eq("finished").all()
    assert_runs_equal(ra, b.result())
    assert_runs_equal(ra, step.result(), ignore=FF_FIELDS)
    assert a.ff_iterations > 0 and step.ff_iterations == 0


def _short_long(n: int, rate: float, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    app = rng.integers(0, 2, n)
    out = np.where(app == 0, rng.integers(5, 20, n), rng.integers(200, 400, n))
    return Workload.two_stage(np.cumsum(rng.exponential(1 / rate, n)), rng.integers(20, 100, n), out,
                              ttft=np.inf, tpot=np.inf, app=app, app_names=["short", "long"])


def test_sjf_lowers_mean_ttlt_versus_fcfs_on_mixed_lengths():
    eng = ToyEngine(max_num_seqs=8)  # queueing at moderate load: 8 sequence slots
    w = _short_long(300, 8.0)
    ttlt = {name: _run(w, name, eng).result().records["ttlt"].mean() for name in ("vllm", "sjf", "sjf-oracle")}
    assert ttlt["sjf"] < 0.8 * ttlt["vllm"], ttlt
    assert ttlt["sjf-oracle"] < 0.8 * ttlt["vllm"], ttlt

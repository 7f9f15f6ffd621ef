"""DistServe baseline: SLOs-Serve Appendix A ratio formula, static P:D split, FCFS per pool (prefill instances
only prefill, decode instances only decode), exact fast-forward, the ratio sweep, and the CLI's --pd."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from helpers import FF_FIELDS, assert_runs_equal
from slogym.baselines import make_policy
from slogym.baselines.distserve import (batch_time_line, optimal_goodput, optimal_pd_ratio, pd_split, pd_split_for,
                                        ratio_sweep)
from slogym.cli import main
from slogym.core.instance import Role
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload

ENGINE = get_engine("llama3-8b-h100")


def test_appendix_a_ratio_and_goodput():
    assert optimal_pd_ratio(800.0, 200.0) == pytest.approx(4.0)
    assert optimal_pd_ratio(800.0, 200.0, tpot=0.1, overhead=0.01) == pytest.approx(0.9 * 4.0)
    # at the optimal ratio the prefill bound and the decode bound of App. A give the same goodput g*
    tpt, e_i, e_o, tpot, oh = 40000.0, 800.0, 200.0, 0.05, 0.01
    r = optimal_pd_ratio(e_i, e_o, tpot, oh)
    n_p, n_d = r, 1.0
    g_prefill = tpt * (n_p / e_i) / (n_p + n_d)
    g_decode = tpt * ((tpot - oh) / tpot) * (n_d / e_o) / (n_p + n_d)
    assert g_prefill == pytest.approx(g_decode)
    assert optimal_goodput(tpt, e_i, e_o, tpot, oh) == pytest.approx(g_prefill)
    with pytest.raises(ValueError, match="overhead"):
        optimal_pd_ratio(800.0, 200.0, tpot=0.01, overhead=0.02)
    with pytest.raises(ValueError, match="mean_output"):
        optimal_pd_ratio(800.0, 0.0)


def test_pd_split_rounds_to_the_closest_ratio():
    assert pd_split(4, 3.0) == (3, 1) and pd_split(4, 1.0) == (2, 2) and pd_split(2, 10.0) == (1, 1)
    assert pd_split(5, 0.25) == (1, 4)
    tpt, overhead = batch_time_line(ENGINE)
    assert tpt > 1000 and 0 <= overhead < 0.05
    assert math.isfinite(tpt)


class RoleRecorder(Simulator):
    """Records the integer features of every iteration by the role of the instance running it."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.by_role: dict[Role, list] = {Role.PREFILL: [], Role.DECODE: [], Role.COLOCATED: []}

    def iteration_time(self, inst, idx, tok, spec, features) -> float:
        self.by_role[inst.role].append(features)
        return super().iteration_time(inst, idx, tok, spec, features)


def test_each_pool_runs_only_its_phase_and_every_request_finishes():
    w = make_workload("chatbot", n_requests=120, seed=2, engine=ENGINE)
    sim = RoleRecorder(w, ENGINE, make_policy("distserve", ENGINE), pd=(1, 2), seed=0).run()
    rs = sim.rs
    assert (rs.outcome == Outcome.FINISHED).all() and rs.n_preempt.sum() == 0
    assert sim.by_role[Role.PREFILL] and sim.by_role[Role.DECODE]
    assert all(f.decode_seqs == 0 for f in sim.by_role[Role.PREFILL]), "a prefill instance ran a decode step"
    assert all(f.prefill_tokens == 0 for f in sim.by_role[Role.DECODE]), "a decode instance ran a prefill"
    multi = rs.generated > 1
    assert sim.kv_transfers == int(multi.sum())
    # every multi-token request ends on a decode instance; TTFT is recorded at the prefill instance
    assert set(rs.instance[multi].tolist()) <= {1, 2}
    assert sim.result().summary["pd"] == [1, 2]


def test_distserve_splits_a_colocated_cluster_and_fast_forward_is_exact():
    w = make_workload("coder", n_requests=100, seed=3, engine=ENGINE)
    runs = []
    for ff in (True, False):
        sim = Simulator(w, ENGINE, make_policy("distserve", ENGINE), 4, seed=1, fast_forward=ff).run()
        runs.append(sim)
    p, d = pd_split_for(w, ENGINE, 4)
    assert [i.role for i in runs[0].instances] == [Role.PREFILL] * p + [Role.DECODE] * d
    assert runs[0].ff_iterations > 0
    assert_runs_equal(runs[0].result(), runs[1].result(), ignore=FF_FIELDS)
    given = Simulator(w, ENGINE, make_policy("distserve", ENGINE, pd=(1, 3)), 4).run()
    assert [i.role for i in given.instances] == [Role.PREFILL] + [Role.DECODE] * 3
    with pytest.raises(ValueError, match="does not split"):
        Simulator(w, ENGINE, make_policy("distserve", ENGINE, pd=(1, 1)), 4).run()


def test_ratio_sweep_covers_every_split():
    w = make_workload("chatbot", n_requests=40, seed=4, engine=ENGINE)
    rows = ratio_sweep(w, ENGINE, 3)
    assert [r["pd"] for r in rows] == [(1, 2), (2, 1)]
    assert all(0.0 <= r["attainment"] <= 1.0 and r["kv_transfers"] > 0 for r in rows)


def test_cli_pd_split(capsys):
    assert main(["simulate", "--pd", "1:1", "--requests", "20", "--json", "--policy", "vllm"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["pd"] == [1, 1] and s["n_instances"] == 2 and s["kv_transfers"] > 0
    assert s["cost_per_request"] == pytest.approx(s["cost_instance_seconds"] / s["outcomes"]["finished"])
    assert main(["simulate", "--pd", "1:1", "--instances", "3", "--requests", "5"]) == 2
    assert "disagrees" in capsys.readouterr().err
    assert main(["simulate", "--instances", "2", "--requests", "10", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["pd"] is None and s["kv_transfers"] == 0 and s["n_instances"] == 2
    # a policy that splits a colocated cluster itself: the summary reports the split it used
    assert main(["simulate", "--instances", "2", "--requests", "10", "--json", "--policy", "distserve"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["pd"] == [1, 1] and s["kv_transfers"] > 0
    assert np.isfinite(s["cost_per_request"])

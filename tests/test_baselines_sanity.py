"""Qualitative sanity of the baselines on the chatbot preset (SLOs-Serve ChatBot) with llama3-8b-h100:
Sarathi-Serve's stall-free chunked batching protects TPOT near saturation; vLLM's prefill-first FCFS gives the
lower TTFT at low load (whole prompts in one iteration, no chunking)."""

from __future__ import annotations

import pytest

from slogym.baselines import make_policy
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import make_workload

ENGINE = get_engine("llama3-8b-h100")


def _run(policy, rate, n=300):
    w = make_workload("chatbot", rate=rate, n_requests=n, seed=3, engine=ENGINE)
    return Simulator(w, ENGINE, make_policy(policy, ENGINE), attainment="strict").run().result()


def test_sarathi_has_fewer_tpot_violations_near_saturation():
    sar, vll = _run("sarathi", 28.0), _run("vllm", 28.0)
    assert 0.5 <= sar.summary["attainment"] <= 0.9, sar.summary["attainment"]  # near saturation
    viol = {name: int((r.records["max_tpot"] > r.records["tpot_slo"]).sum()) for name, r in
            (("sarathi", sar), ("vllm", vll))}
    assert viol["sarathi"] < viol["vllm"], viol
    assert vll.summary["attainment"] < sar.summary["attainment"]


def test_vllm_has_lower_ttft_at_low_load():
    sar, vll = _run("sarathi", 2.0, n=150), _run("vllm", 2.0, n=150)
    assert sar.summary["attainment"] > 0.95 and vll.summary["attainment"] > 0.95  # low load indeed
    assert vll.summary["ttft_p50"] < sar.summary["ttft_p50"]


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "edf"])
def test_attainment_falls_with_load(policy):
    lo, hi = _run(policy, 4.0, n=200), _run(policy, 40.0, n=200)
    assert lo.summary["attainment"] > hi.summary["attainment"]
    assert lo.summary["ttft_p90"] < hi.summary["ttft_p90"]


@pytest.mark.parametrize("policy,params", [("vllm", {"max_num_batched_tokens": float("nan")}),
                                           ("vllm", {"watermark": float("nan")}), ("vllm", {"max_num_seqs": 2.5}),
                                           ("sa", {"max_batch_size": float("nan")}),
                                           ("sa", {"max_num_batched_tokens": 0})])
def test_numeric_parameters_refuse_nan_and_non_integers(policy, params):
    with pytest.raises(ValueError, match=next(iter(params))):
        make_policy(policy, None, **params)

"""Side-by-side comparison of policies on one scenario: the job ``make run`` runs.

    python -m slogym.compare [--scenario chatbot] [--policies vllm,sarathi,edf] [--rate R] [--requests N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import pandas as pd

from slogym.baselines import make_policy
from slogym.core.simulator import Simulator
from slogym.engines.registry import get_engine
from slogym.workloads.scenarios import SCENARIOS, make_workload

DEFAULT_POLICIES = ("vllm", "sarathi", "edf")
COLUMNS = ("attainment", "goodput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "ttlt_p50",
           "service_gain", "preemptions", "requests_per_wall_second")


def compare(scenario: str = "chatbot", policies: Sequence[str] = DEFAULT_POLICIES, rate: float | None = None,
            n_requests: int | None = None, engine: str = "llama3-8b-h100", seed: int = 0,
            attainment: str = "dslo") -> pd.DataFrame:
    """One row per policy: the run summary's headline metrics on the same workload."""
    eng = get_engine(engine)
    w = make_workload(scenario, rate=rate, n_requests=n_requests, seed=seed, engine=eng)
    rows = []
    for name in policies:
        sim = Simulator(w, eng, make_policy(name, eng), seed=seed, attainment=attainment).run()
        s = sim.result().summary
        rows.append({"policy": name} | {c: s[c] for c in COLUMNS})
    return pd.DataFrame(rows).set_index("policy")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slogym.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="chatbot", choices=sorted(SCENARIOS))
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: the scenario's)")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--engine", default="llama3-8b-h100")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attainment", default="dslo")
    a = ap.parse_args(argv)
    spec = SCENARIOS[a.scenario]
    df = compare(a.scenario, a.policies.split(","), a.rate, a.requests, a.engine, a.seed, a.attainment)
    rate = a.rate if a.rate is not None else spec.default_rate
    print(f"scenario {a.scenario} ({spec.description}) at {rate} req/s on {a.engine}, seed {a.seed}, "
          f"attainment mode {a.attainment}")
    with pd.option_context("display.float_format", "{:.3f}".format, "display.width", 160):
        print(df.to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Leaderboard: sweeps, serving-capacity search, tables and plots (local processes or Ray)."""

from __future__ import annotations

from slogym.leaderboard.board import BoardConfig, build, run_board
from slogym.leaderboard.capacity import CapacitySearch, bisect_capacity
from slogym.leaderboard.sweep import InputFingerprints, RunCache, Runner, RunSpec, code_version, execute


QUICK_SCENARIOS = ["chatbot", "coder", "mixed", "tempo-mix"]
"""The ``--quick`` board's scenarios (one of each workload shape; the full board runs every preset)."""


QUICK_POLICIES = ["vllm", "sarathi", "edf", "sa", "sjf", "autellix", "tempo", "slos-serve", "hyperflexis"]
"""The ``--quick`` board's policies: one per family (the full board adds oracles, ablations and variants)."""


def shipped_agents() -> list[str]:
    """``agent:<name>`` for every shipped learned agent (none when the ``rl`` extra is missing)."""
    try:
        from slogym import agents

        return [f"agent:{n}" for n in agents.available()]
    except ImportError:
        return []


def default_policies() -> list[str]:
    """Every registered scheduling policy (routers only matter with several instances) and every shipped
    learned agent."""
    from slogym.baselines import REFERENCE_ONLY, ROUTERS, list_policies

    return [p for p in list_policies() if p not in ROUTERS and p not in REFERENCE_ONLY] + shipped_agents()


__all__ = ["shipped_agents", "QUICK_POLICIES", "QUICK_SCENARIOS", "BoardConfig", "CapacitySearch", "InputFingerprints",
           "RunCache", "RunSpec", "Runner", "bisect_capacity", "build", "code_version", "default_policies", "execute",
           "run_board"]

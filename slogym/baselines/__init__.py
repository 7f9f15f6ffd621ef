"""Baseline policies, by the names of DESIGN.md ("Names and schemas").

``make_policy(name, engine=None, router=None, **params)`` builds a :class:`~slogym.core.policy.Policy`;
``list_policies()`` lists the names. Router-only names (``round-robin``, ``random``, ``least-load``) pair the
router with the vLLM FCFS scheduler; ``router=`` overrides the router of any policy.
"""

from __future__ import annotations

from typing import Any, Callable

from slogym.baselines.edf import EDFScheduler
from slogym.baselines.routers import LeastLoadRouter, RandomRouter, RoundRobinRouter
from slogym.baselines.sarathi import SarathiScheduler
from slogym.baselines.vllm import VLLMScheduler
from slogym.core.policy import Policy, Router, Scheduler

ROUTERS: dict[str, Callable[[], Router]] = {
    "round-robin": RoundRobinRouter,
    "random": RandomRouter,
    "least-load": LeastLoadRouter,
}


def _engine_defaults(engine: Any) -> dict[str, int]:
    if engine is None:
        return {}
    return {"max_num_seqs": int(engine.max_num_seqs), "max_num_batched_tokens": int(engine.max_num_batched_tokens)}


def _vllm(engine: Any, **kw: Any) -> Scheduler:
    return VLLMScheduler(**(_engine_defaults(engine) | kw))


def _sarathi(engine: Any, **kw: Any) -> Scheduler:
    d = _engine_defaults(engine)
    d.pop("max_num_batched_tokens", None)
    return SarathiScheduler(**(d | kw))


def _edf(engine: Any, **kw: Any) -> Scheduler:
    d = _engine_defaults(engine)
    d.pop("max_num_batched_tokens", None)
    return EDFScheduler(**(d | kw))


SCHEDULERS: dict[str, Callable[..., Scheduler]] = {"vllm": _vllm, "sarathi": _sarathi, "edf": _edf}

POLICY_DESCRIPTIONS: dict[str, str] = {
    "vllm": "vLLM FCFS, prefill-first, whole prompts (Kwon et al. 2023)",
    "sarathi": "Sarathi-Serve chunked prefill, decode-first token budget (Agrawal et al. 2024)",
    "edf": "earliest deadline first on SLO deadline lines, token budget",
    "round-robin": "round-robin router + vLLM FCFS",
    "random": "random router + vLLM FCFS",
    "least-load": "least-outstanding-tokens router + vLLM FCFS",
}


def list_policies() -> list[str]:
    return list(POLICY_DESCRIPTIONS)


def make_policy(name: str, engine: Any = None, router: str | Router | None = None, **params: Any) -> Policy:
    """Build the named policy; ``params`` go to its scheduler (e.g. ``token_budget=256``)."""
    if name in SCHEDULERS:
        sched = SCHEDULERS[name](engine, **params)
        rname = router
    elif name in ROUTERS:
        sched = _vllm(engine, **params)
        rname = router or name
    else:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(list_policies())}")
    if isinstance(rname, Router):
        rt = rname
    elif rname is None:
        rt = RoundRobinRouter()
    elif rname in ROUTERS:
        rt = ROUTERS[rname]()
    else:
        raise ValueError(f"unknown router {rname!r}; known: {', '.join(ROUTERS)}")
    full = {"scheduler": type(sched).__name__, "router": type(rt).__name__} | {
        k: v for k, v in vars(sched).items() if not k.startswith("_")}
    return Policy(name=name, scheduler=sched, router=rt, params=full)

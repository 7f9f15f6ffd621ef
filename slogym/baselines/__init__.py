"""Baseline policies, by the names of DESIGN.md ("Names and schemas").

``make_policy(name, engine=None, router=None, **params)`` builds a :class:`~slogym.core.policy.Policy`;
``list_policies()`` lists the names, ``policy_params(name)`` the ``params`` keys a name accepts. Router-only
names (``round-robin``, ``random``, ``least-load``) pair the router with the vLLM FCFS scheduler; ``router=``
overrides the router of any policy. Paper baselines live one module each and expose ``POLICIES`` (name ->
factory); they are imported when first used.
"""

from __future__ import annotations

import inspect
from importlib import import_module
from types import ModuleType
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


def _engine_defaults(engine: Any, budget_loop: bool = False) -> dict[str, int]:
    if engine is None:
        return {}
    d = {"max_num_seqs": int(engine.max_num_seqs)}
    if not budget_loop:
        d["max_num_batched_tokens"] = int(engine.max_num_batched_tokens)
    return d


SCHEDULER_CLASSES: dict[str, type[Scheduler]] = {
    "vllm": VLLMScheduler, "sarathi": SarathiScheduler, "edf": EDFScheduler}
"""The class each :data:`SCHEDULERS` factory passes its ``**params`` to (:func:`policy_params` reads it)."""

SCHEDULERS: dict[str, Callable[..., Scheduler]] = {
    "vllm": lambda engine, **kw: VLLMScheduler(**(_engine_defaults(engine) | kw)),
    "sarathi": lambda engine, **kw: SarathiScheduler(**(_engine_defaults(engine, True) | kw)),
    "edf": lambda engine, **kw: EDFScheduler(**(_engine_defaults(engine, True) | kw)),
}

PAPER_POLICIES: dict[str, str] = {
    "sa": "slogym.baselines.sa",
    "sa-exhaustive": "slogym.baselines.sa",
    "autellix": "slogym.baselines.autellix",
    "sjf": "slogym.baselines.sjf",
    "sjf-oracle": "slogym.baselines.sjf",
    "las": "slogym.baselines.sjf",
    "distserve": "slogym.baselines.distserve",
    **{name: "slogym.baselines.tempo" for name in
       ("tempo", "tempo-precise", "tempo-sjf", "tempo-no-graph", "tempo-no-predictor")},
    **{name: "slogym.baselines.slos_serve" for name in
       ("slos-serve", "slos-serve-no-spec", "slos-serve-no-dbs", "slos-serve-no-admission")},
    **{name: "slogym.baselines.polyserve" for name in
       ("polyserve-co", "polyserve-pd", "polyserve-co-random", "polyserve-co-minimal", "polyserve-co-chunk",
        "polyserve-pd-random", "polyserve-pd-minimal")},
    **{name: "slogym.baselines.hyperflexis" for name in
       ("hyperflexis", "hyperflexis-pm", "hyperflexis-scaling", "hyperflexis-pd", "hyperflexis-pd-scaling", "rr-pd")},
}
"""Policies built by a paper module's ``POLICIES`` factories (``f(engine, **params) -> Policy``)."""

REFERENCE_ONLY = {"sa-exhaustive"}
"""Reference implementations for tests and reproduction at small sizes; not leaderboard entries."""

MIN_INSTANCES: dict[str, int] = {
    "distserve": 2, "rr-pd": 2, "hyperflexis-pd": 2, "hyperflexis-pd-scaling": 2,
    **{name: 2 for name in PAPER_POLICIES if name.startswith("polyserve-")},
}
"""Cluster-level policies (P/D disaggregation, tier pools) and the replicas they need to be themselves; on fewer
they run their documented colocated fallback. The leaderboard runs them on a cluster."""

POLICY_DESCRIPTIONS: dict[str, str] = {
    "vllm": "vLLM FCFS, prefill-first, whole prompts (Kwon et al. 2023)",
    "sarathi": "Sarathi-Serve chunked prefill, decode-first token budget (Agrawal et al. 2024)",
    "distserve": "DistServe prefill/decode disaggregation, static P:D ratio, FCFS per pool (Zhong et al. 2024)",
    "edf": "earliest deadline first on SLO deadline lines, token budget",
    "sa": "simulated-annealing SLO-aware priority + batch sizes, memory round-robin (Huang et al. 2025)",
    "sa-exhaustive": "exhaustive-search reference of the SA scheduler (small N only)",
    "autellix": "Autellix PLAS: program-level least attained service (Luo et al. 2025; reconstructed)",
    "sjf": "shortest job first on the predicted output length (per-app history median)",
    "sjf-oracle": "shortest job first on the true output length (oracle)",
    "las": "least attained service per request",
    "tempo": "Tempo LSDF with QRF length bounds and DAG matching (Zhang et al. 2025)",
    "tempo-precise": "Tempo with oracle output lengths and DAGs (Tempo-Precise, Fig. 12)",
    "tempo-sjf": "shortest predicted job first with Tempo's analyzer (Tempo-SJF baseline)",
    "tempo-no-graph": "Tempo without DAG matching (Fig. 15 ablation)",
    "tempo-no-predictor": "Tempo without the QRF length predictor (Fig. 15 ablation)",
    "slos-serve": ("SLOs-Serve multi-SLO DP admission, dynamic batches, adaptive speculation, routing "
                   "(Chen et al. 2025)"),
    "slos-serve-no-spec": "SLOs-Serve without speculative decoding (Fig. 14 ablation)",
    "slos-serve-no-dbs": "SLOs-Serve without dynamic batch sizing: fixed tightest-TPOT batches (Fig. 14 ablation)",
    "slos-serve-no-admission": "SLOs-Serve admitting every request (Fig. 14 ablation)",
    "polyserve-co": "PolyServe co-located: TPOT tiers, highest-load attainable routing, lazy promotion, "
                    "tier autoscaling, profile-table admission (Zhu et al. 2025)",
    "polyserve-pd": "PolyServe prefill-decode disaggregated (Zhu et al. 2025)",
    "polyserve-co-random": "PolyServe's CO-Random baseline: random instance, profile token budget",
    "polyserve-co-minimal": "PolyServe's CO-Minimal baseline: lowest predicted cycle time instance",
    "polyserve-co-chunk": "PolyServe's CO-Chunk baseline: static token budget, lowest cycle time instance",
    "polyserve-pd-random": "PolyServe's PD-Random baseline: random prefill and decode instances",
    "polyserve-pd-minimal": "PolyServe's PD-Minimal baseline: lowest cycle time prefill and decode instances",
    "hyperflexis": "HyperFlexis maturity-time dispatcher, Eq. 5 token budget, TTFT-probability admission (2025)",
    "hyperflexis-pm": "HyperFlexis with priority-based SLO mapping over sliding windows (HyperFlexis-PM, §5.2)",
    "hyperflexis-scaling": "HyperFlexis + threshold scaler with fast (D2D) scaling (HyperFlexis-Scaling, §6)",
    "hyperflexis-pd": "HyperFlexis P/D: prefill dispatcher + per-iteration decode migrator (HyperFlexis-PD)",
    "hyperflexis-pd-scaling": "HyperFlexis P/D + scaler with role switching (HyperFlexis-PD-Scaling)",
    "rr-pd": "RR-PD: round-robin prefill and decode workers, DistServe's FCFS workers (HyperFlexis §8.1.2)",
    "round-robin": "round-robin router + vLLM FCFS",
    "random": "random router + vLLM FCFS",
    "least-load": "least-outstanding-tokens router + vLLM FCFS",
}


def list_policies() -> list[str]:
    return list(POLICY_DESCRIPTIONS)


def _router(spec: str | Router | None) -> Router | None:
    if spec is None or isinstance(spec, Router):
        return spec
    if spec not in ROUTERS:
        raise ValueError(f"unknown router {spec!r}; known: {', '.join(ROUTERS)}")
    return ROUTERS[spec]()


def make_policy(name: str, engine: Any = None, router: str | Router | None = None, **params: Any) -> Policy:
    """Build the named policy; ``params`` go to its scheduler (e.g. ``token_budget=256``)."""
    if name in PAPER_POLICIES:
        policy = import_module(PAPER_POLICIES[name]).POLICIES[name](engine, **params)
        rt = _router(router)
        if rt is not None:
            policy.router = rt
        return policy
    if name in SCHEDULERS:
        sched = SCHEDULERS[name](engine, **params)
        rt = _router(router) or RoundRobinRouter()
    elif name in ROUTERS:
        sched = SCHEDULERS["vllm"](engine, **params)
        rt = _router(router or name)
    else:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(list_policies())}")
    full = {"scheduler": type(sched).__name__, "router": type(rt).__name__} | {
        k: v for k, v in vars(sched).items() if not k.startswith("_")}
    return Policy(name=name, scheduler=sched, router=rt, params=full)


def _keywords(target: Callable[..., Any]) -> list[str]:
    """The named parameters of a callable or class, less ``self``, ``engine``, ``router`` and ``*``/``**``."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(target).parameters.values()
            if p.kind in kinds and p.name not in ("self", "engine", "router")]


def _forwarded(module: ModuleType, factory: Callable[..., Any]) -> list[str]:
    """The keys a paper module's ``POLICIES`` factory takes from its ``**params`` besides its named parameters:
    what it forwards them to, or the keys it pops from them (the variant switches of the factory's closure decide
    which, as in the factory)."""
    closure = inspect.getclosurevars(factory).nonlocals
    name = module.__name__.rsplit(".", 1)[1]
    if name == "sa":  # _policy: the router's eta, the rest to SAScheduler
        return ["eta", *_keywords(module.SAScheduler)]
    if name in ("sjf", "autellix"):  # sjf.policy_factory: scheduler(**params)
        return _keywords(closure["scheduler"])
    if name == "distserve":  # make_distserve: DistServeScheduler(**params)
        return _keywords(module.DistServeScheduler)
    if name == "tempo":
        return _keywords(module.TempoScheduler)
    if name == "slos_serve":  # SLOsServeConfig(**params)
        return _keywords(module.SLOsServeConfig)
    if name == "polyserve":  # _make pops these; token_budget only when static, interval only with the scaler
        return ["max_num_seqs", "tiers", "avg_decode_len", "prefill_budget", "remaining", "min_chunk",
                *(["token_budget"] if closure["static"] else []), *(["interval"] if closure["polyserve"] else [])]
    if name == "hyperflexis":
        if factory is module._rr_pd:  # the P/D split's prefill_fraction, the rest to VLLMScheduler
            return ["prefill_fraction", *_keywords(VLLMScheduler)]
        return [*module._STATE_DEFAULTS, "max_num_seqs", "prefill_fraction",
                *(module._SCALER_DEFAULTS if closure["scaling"] else [])]
    raise NotImplementedError(f"policy_params: no rule for the factories of {module.__name__}")


def policy_params(name: str) -> list[str]:
    """The ``params`` keys ``make_policy(name, engine, **params)`` accepts, from the factory the params go to
    (its named parameters, then what it forwards ``**params`` to); ``router`` is :func:`make_policy`'s own."""
    if name in PAPER_POLICIES:
        module = import_module(PAPER_POLICIES[name])
        factory = module.POLICIES[name]
        keys = _keywords(factory)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(factory).parameters.values()):
            keys += _forwarded(module, factory)
    elif name in SCHEDULERS or name in ROUTERS:
        keys = _keywords(SCHEDULER_CLASSES.get(name, VLLMScheduler))
    else:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(list_policies())}")
    return list(dict.fromkeys(keys))

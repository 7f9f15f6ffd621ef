"""Shared machinery of the slogym environments: episodes over trace windows, reward credit, features.

An environment owns a *pool* of requests (a scenario preset generated once, or a user trace with the scenario's
SLO assignment) and plays one window of it per episode: ``reset`` picks a random window start (from the
environment's seeded ``np_random``) inside the chosen ``split`` -- ``"train"`` is the first 80% of the pool,
``"test"`` the last 20% (held out), ``"all"`` everything -- and replays it on a fresh simulator. The agent
makes one kind of decision; the baseline named by ``policy=`` makes all the others.

Rewards are credited when an outcome becomes known: the step during which a request finishes (or is
rejected or dropped) receives that request's contribution, so a decision's consequences arrive later.

* ``goodput``       +1 for each request that finishes within its SLO
* ``attainment``    +1/N for each of the episode's N requests that finishes within its SLO (episode sum =
                    attainment)
* ``service_gain``  Tempo's service gain (Eq. 1-3) of each finished request, in thousands of weighted tokens
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from slogym.baselines import list_policies, make_policy
from slogym.core.batch import BatchFeatures
from slogym.core.cluster import KVTransfer
from slogym.core.instance import Instance
from slogym.core.metrics import MODES, run_summary, service_gain, verdict_arrays
from slogym.core.request import StageKind, Workload
from slogym.core.simulator import Simulator
from slogym.core.state import Status
from slogym.engines.base import EngineSpec
from slogym.engines.registry import get_engine
from slogym.envs import kernels
from slogym.workloads.predictors import EmpiricalLengthPredictor
from slogym.workloads.scenarios import SCENARIOS, make_workload

REWARDS = ("goodput", "attainment", "service_gain")
SPLITS = ("train", "test", "all")
TRAIN_FRACTION = 0.8
WINDOW_TRIES = 1000
"""Draws of a time-based episode window before ``reset`` gives up on finding one that holds a request."""
CLIP = 10.0
DECODE = int(StageKind.DECODE)
DONE, WAITING, RUNNING = int(Status.DONE), int(Status.WAITING), int(Status.RUNNING)
SCAN_MAX = 8192
"""Longest stretch of requests (arrived, not all done before it) the arrival observation scans for the instances'
queues; beyond it, it gathers the instances' lists."""
INSTANCE_FEATURES = ("queue_tokens", "waiting", "running", "kv_utilization", "iteration_time")
"""Per-instance load features (see :meth:`ServingEnv._instance_features`)."""
N_COEF = 11
"""Coefficients of the compiled perf model (:func:`slogym.engines.perf_models.analytic_time`)."""
_EMPTY32 = np.zeros(0, np.float32)
_NO_PLACED = np.zeros(0, np.int64)


def drive(steps: Generator[tuple, float, Any]) -> Any:
    """Run an env stepper to its end, timing any deferred iteration with the scalar perf-model path."""
    try:
        msg = next(steps)
        while True:
            _, inst, f = msg
            msg = steps.send(inst.time_one(f))
    except StopIteration as stop:
        return stop.value


def _box(*shape: int, low: float = -CLIP, high: float = CLIP) -> spaces.Box:
    return spaces.Box(low=low, high=high, shape=shape, dtype=np.float32)


def _is_int(x: Any) -> bool:
    """A Python or NumPy integer (bools excluded)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def log_tokens(x: Any) -> Any:
    """Token counts on a log scale: log1p(x) / log1p(32768), ~[0, 1] for realistic lengths."""
    return np.log1p(x) / np.log1p(32768.0)


_LOG_TABLE = log_tokens(np.arange(1 << 16))


def log_token_table(size: int) -> np.ndarray:
    """``log_tokens(x)`` for the integers ``0 <= x < size`` at least (compiled features look counts up here;
    the values are log_tokens' own, bit for bit). Shared by every env, grown by doubling."""
    global _LOG_TABLE
    if _LOG_TABLE.size < size:
        _LOG_TABLE = log_tokens(np.arange(max(int(size), 2 * _LOG_TABLE.size)))
    return _LOG_TABLE


class ServingEnv(gym.Env):
    """Base of the decision environments; subclasses define spaces, ``_observe`` and ``_to_sim_action``.

    Keyword arguments (all environments):
        scenario     scenario preset name (``slogym scenarios``)
        trace        path of a trace file (Azure, BurstGPT, Mooncake, length table) replayed with the scenario's
                     SLO assignment; default: the generated preset
        rate_scale   arrival-rate multiplier (> 0)
        engine       engine preset name or JSON path
        n_instances  replicas in the cluster
        pd           ``(P, D)``: a prefill/decode-disaggregated cluster of P + D instances (overrides
                     ``n_instances``; needs a PD-aware policy's router, e.g. ``distserve``; docs/cluster.md)
        policy       baseline making every decision the agent does not (``slogym policies``)
        reward       ``goodput`` | ``attainment`` | ``service_gain``
        episode      requests per episode (int) or seconds of trace (float)
        split        ``train`` | ``test`` | ``all`` -- which part of the pool episodes are drawn from
        seed         seeds the pool and the default episode sequence
        attainment   SLO judging mode (``dslo``, ``strict``, ``mean_tpot``, ``ttlt``)
        pool_requests  size of a generated pool (default: max(4000, 10 x episode))
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}
    decision: ClassVar[str]

    def __init__(self, scenario: str = "chatbot", trace: str | None = None, rate_scale: float = 1.0,
                 engine: str = "llama3-8b-h100", n_instances: int = 1, policy: str = "sarathi",
                 reward: str = "goodput", episode: int | float = 256, split: str = "all", seed: int | None = None,
                 attainment: str = "dslo", pool_requests: int | None = None, render_mode: str | None = None,
                 pd: tuple[int, int] | None = None, kv_gbps: float = 100.0) -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(sorted(SCENARIOS))}")
        if not (isinstance(rate_scale, (int, float)) and rate_scale > 0 and np.isfinite(rate_scale)):
            raise ValueError(f"rate_scale={rate_scale!r}; must be a positive number")
        if not (_is_int(n_instances) and n_instances >= 1):
            raise ValueError(f"n_instances={n_instances!r}; must be an integer >= 1")
        if isinstance(kv_gbps, bool) or not (isinstance(kv_gbps, (int, float)) and kv_gbps > 0):
            raise ValueError(f"kv_gbps={kv_gbps!r}; must be a positive number (KV-transfer link, Gb/s)")
        if not (seed is None or _is_int(seed)):
            raise ValueError(f"seed={seed!r}; must be an integer or None")
        if not (pool_requests is None or _is_int(pool_requests) and pool_requests >= 1):
            raise ValueError(f"pool_requests={pool_requests!r}; must be an integer >= 1 or None")
        if policy not in list_policies():
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(list_policies())}")
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}; known: {', '.join(REWARDS)}")
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
        if isinstance(episode, bool) or not isinstance(episode, (int, float, np.integer, np.floating)) or not (
                0 < episode < np.inf):
            raise ValueError(f"episode={episode!r}; must be a positive request count or number of seconds")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode={render_mode!r}; known: {self.metadata['render_modes']}")
        self.scenario, self.policy_name, self.reward_name = scenario, policy, reward
        self.n_instances, self.episode, self.split = n_instances, episode, split
        self.pd = None if pd is None else (int(pd[0]), int(pd[1]))
        self.transfer = KVTransfer(bandwidth_gbps=float(kv_gbps))
        if self.pd is not None:
            self.n_instances = sum(self.pd)
        self.attainment, self.render_mode = attainment, render_mode
        self.engine: EngineSpec = get_engine(engine)
        pool_seed = 0 if seed is None else int(seed)
        n_pool = pool_requests or max(4000, 10 * int(episode) if isinstance(episode, int) else 4000)
        pool = make_workload(scenario, n_requests=None if trace else n_pool, seed=pool_seed, trace=trace,
                             engine=self.engine)
        self.pool = pool.with_arrivals(pool.arrival / rate_scale) if rate_scale != 1.0 else pool
        cut = int(len(self.pool) * TRAIN_FRACTION)
        self._range = {"train": (0, cut), "test": (cut, len(self.pool)), "all": (0, len(self.pool))}[split]
        self.predictor = EmpiricalLengthPredictor(self.pool.subset(np.arange(max(cut, 1))))
        self.n_apps, self.n_tiers = len(self.pool.app_names), len(self.pool.tier_names)
        self._seed = seed
        self.sim: Simulator | None = None
        self._gen: Generator | None = None
        self._msg: tuple | None = None
        self._history: deque[tuple[float, np.ndarray]] = deque(maxlen=200)
        self._last_obs: Any = None
        # where Admission-v0 / Routing-v0 write their observations: fresh arrays (None), or the rows of a vector
        # env's batch buffers (``SlogymVectorEnv``; every entry is overwritten at each step)
        self.obs_rows: dict[str, np.ndarray] | None = None

    # ------------------------------------------------------------------ episodes
    def _window(self) -> Workload:
        lo, hi = self._range
        arr = self.pool.arrival
        if isinstance(self.episode, (int, np.integer)):
            n = int(self.episode)
            if n > hi - lo:
                raise ValueError(f"episode={n} requests but the {self.split!r} split holds {hi - lo}")
            start = int(self.np_random.integers(lo, hi - n + 1))
            idx = np.arange(start, start + n)
        else:
            t_lo, t_hi = arr[lo], arr[hi - 1]
            if self.episode > t_hi - t_lo:
                raise ValueError(f"episode={self.episode} s but the {self.split!r} split spans {t_hi - t_lo:.1f} s")
            idx = self._time_window(arr, t_lo, t_hi)
        w = self.pool.subset(idx, name=f"{self.scenario}[{idx[0]}:{idx[-1] + 1}]")
        return w.with_arrivals(w.arrival - w.arrival[0])

    def _time_window(self, arr: np.ndarray, t_lo: float, t_hi: float) -> np.ndarray:
        """Indices of the requests arriving in ``[t0, t0 + episode)``, ``t0`` uniform in the split. Bursty
        arrival patterns (``code``) have silences longer than short episodes: an empty window is drawn again
        (the first non-empty draw is kept, so seeds that never drew an empty window are unchanged)."""
        for _ in range(WINDOW_TRIES):
            t0 = float(self.np_random.uniform(t_lo, t_hi - self.episode))
            lo, hi = int(np.searchsorted(arr, t0)), int(np.searchsorted(arr, t0 + self.episode))
            if hi > lo:
                return np.arange(lo, hi)
        raise ValueError(f"episode={self.episode} s: {WINDOW_TRIES} windows drawn in the {self.split!r} split of "
                         f"{self.scenario!r} held no request; use a longer episode or a request count")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        return drive(self._reset_steps(seed))

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        return drive(self._step_steps(action))

    # The episode logic as generators that yield ("time", instance, features) when the simulator defers an
    # iteration's timing (only under the native vector env, which answers many of them in one call).
    def _reset_steps(self, seed: int | None, defer_timing: bool = False) -> Generator[tuple, float, Any]:
        super().reset(seed=self._seed if seed is None and self.sim is None else seed)
        w = self._window()
        pol = make_policy(self.policy_name, self.engine)
        self.sim = Simulator(w, self.engine, pol, self.n_instances, seed=int(self.np_random.integers(2**31)),
                             attainment=self.attainment, pd=self.pd, transfer=self.transfer)
        self.sim.completed = []
        self.sim.defer_timing = defer_timing
        self._configure(self.sim)
        self._bind(self.sim)
        self._history.clear()
        self._gen = self.sim.decisions()
        self._msg = None
        done, _ = yield from self._advance(None)
        if done:
            raise RuntimeError(f"episode window of {len(w)} requests asked for no {self.decision} decision")
        self._last_obs = self._observe()
        return self._last_obs, self._info()

    def _step_steps(self, action: Any) -> Generator[tuple, float, Any]:
        if self._msg is None:
            raise RuntimeError("step() called before reset() or after the episode ended")
        sim_action = self._to_sim_action(action)
        done, reward = yield from self._advance(sim_action)
        info = self._info()
        if done:
            info["summary"] = run_summary(self.sim)
            self._msg = None
        else:
            self._last_obs = self._observe()
        return self._last_obs, reward, done, False, info

    def _advance(self, action: Any) -> Generator[tuple, float, tuple[bool, float]]:
        """Run the simulator to the agent's next decision; return (episode over, reward credited meanwhile)."""
        try:
            msg = self._gen.send(action) if self._msg is not None else next(self._gen)
            while msg[0] == "time":
                msg = self._gen.send((yield msg))
            self._msg = msg
            done = False
        except StopIteration:
            done = True
        return done, self._credit()

    def _credit(self) -> float:
        """Judge the requests that reached an outcome since the last call (compiled: usually 0-2 of them)."""
        sim = self.sim
        done = sim.completed
        if not done:
            return 0.0
        idx = np.array(done, dtype=np.int64)
        done.clear()
        n_met, self._ewma = kernels.credit(idx, self._mode, self._ewma, *self._verdict_args)  # sorts idx by time
        self._n_met += n_met
        if self.reward_name == "goodput":
            return float(n_met)
        if self.reward_name == "attainment":
            return float(n_met) / len(sim.w)
        return float(service_gain(sim, idx).sum()) / 1000.0

    def _info(self) -> dict[str, Any]:
        sim = self.sim
        return {"time": float(sim.now), "done_requests": sim._n_done, "slo_met": self._n_met,
                "attainment_ewma": self._ewma}

    def _recent(self) -> np.ndarray:
        sim = self.sim
        return np.array([self._ewma, sim._n_done / max(len(sim.w), 1)], np.float32)

    # ------------------------------------------------------------------ serving a trained agent outside the env
    def attach(self, sim: Simulator) -> None:
        """Observe ``sim`` (driven by someone else, e.g. ``slogym simulate``) with this env's features."""
        self.sim = sim
        sim.completed = []
        self._bind(sim)

    def _bind(self, sim: Simulator) -> None:
        """Start observing a fresh simulator: outcome counters, per-request tables, memos."""
        self._n_met = 0
        self._ewma = 1.0
        self._mode = MODES.index(sim.attainment)
        self._verdict_args = verdict_arrays(sim)
        # per instance id: compiled perf-model coefficients; (running count, context) of the last decode-step
        # time computed in Python, and that time (see _grow_tables)
        self._coef = np.zeros((0, N_COEF))
        self._memo_nc = np.full((0, 2), -1, np.int64)
        self._memo_t = np.zeros(0)
        self._stale = np.zeros((0, 3), np.int64)  # scratch: instances whose decode-step time the kernel left
        # _resident_inputs: requests before _lo are all done; its buffers, and (n_wait, n_run, free blocks, total
        # blocks, max_num_seqs, id) per instance
        self._lo = 0
        self._wait_buf, self._run_buf = np.empty(len(sim.w), np.int64), np.empty(len(sim.w), np.int64)
        self._shape = self._pos = np.zeros(0, np.int64)
        w = sim.w
        q = self.predictor.predict(w.app)
        # the request part of arrival observations depends on the request alone: one row per request
        self._request_rows = np.column_stack([
            log_tokens(w.input_tokens), log_tokens(q[:, 0]), log_tokens(q[:, 1]), np.minimum(w.first_ttft, CLIP),
            np.minimum(w.min_tpot / 0.1, CLIP), np.minimum(w.ttlt / 30.0, CLIP), w.best_effort.astype(np.float64),
            w.priority / 4.0,
        ]).astype(np.float32)

    def observe(self, msg: tuple) -> Any:
        """The observation this env would give for decision ``msg`` (``("route", req, now)`` or
        ``("schedule", instance, now)``) of the attached simulator; outcomes since the last call update the
        recent-attainment features first."""
        self._msg = msg
        self._credit()
        return self._observe()

    def _decision(self) -> tuple:
        """The pending decision message (``action_masks`` / ``expert_action`` answer it); raises outside an
        episode."""
        if self._msg is None:
            raise RuntimeError("no decision is pending: call reset() first (or again, after the episode ended)")
        return self._msg

    # ------------------------------------------------------------------ subclass hooks
    def _configure(self, sim: Simulator) -> None:
        raise NotImplementedError

    def _observe(self) -> Any:
        raise NotImplementedError

    def _to_sim_action(self, action: Any) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ rendering
    def render(self) -> str | np.ndarray | None:
        if self.render_mode is None or self.sim is None:
            return None
        sim = self.sim
        loads = [(len(i.waiting), len(i.running), i.kv_utilization) for i in sim.instances]
        self._history.append((sim.now, np.array(loads, dtype=np.float64)))
        if self.render_mode == "ansi":
            inst = " ".join(f"[{w}w {r}r kv{u:.0%}]" for w, r, u in loads)
            label = getattr(self, "render_label", self.decision)
            return (f"t={sim.now:9.3f}s {label:8s} done={sim._n_done}/{len(sim.w)} "
                    f"met={self._n_met} {inst}")
        return self._render_rgb()

    def _render_rgb(self) -> np.ndarray:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = np.array([h[0] for h in self._history])
        # the cluster may have grown (Scaling-v0): instances that did not exist yet are NaN (not drawn)
        n = max((len(h[1]) for h in self._history), default=self.n_instances)
        loads = np.full((len(self._history), n, 3), np.nan)
        for k, (_, row) in enumerate(self._history):
            loads[k, : len(row)] = row
        fig, axes = plt.subplots(2, 1, figsize=(5, 3.2), dpi=80, sharex=True)
        for i in range(n):
            axes[0].plot(t, loads[:, i, 0], label=f"waiting {i}")
            axes[0].plot(t, loads[:, i, 1], "--", label=f"running {i}")
            axes[1].plot(t, loads[:, i, 2], label=f"KV {i}")
        axes[0].set_ylabel("requests")
        axes[1].set_ylabel("KV used")
        axes[1].set_xlabel("simulated time (s)")
        axes[0].legend(fontsize=6, loc="upper left")
        fig.tight_layout()
        fig.canvas.draw()
        img = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
        plt.close(fig)
        return img

    # ------------------------------------------------------------------ shared observation parts
    def _arrival_obs(self, r: int, now: float, placed: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Observation of an arrival decision on request ``r`` (see :mod:`slogym.envs.arrival`; with
        ``placed_since`` from the placement counts ``placed`` if given, see ``RoutingEnv._placed``), built by one
        compiled call (:func:`slogym.envs.kernels.arrival_observation`)."""
        sim = self.sim
        w, rs = sim.w, sim.rs
        insts = sim.instances
        if len(insts) != self.n_instances:
            raise RuntimeError(f"policy {self.policy_name!r} resized the cluster to {len(insts)} instances; this env's "
                               f"spaces are for n_instances={self.n_instances} (scaling: slogym/Scaling-v0)")
        run, wait, shape = self._resident_inputs(insts)
        f32 = np.float32
        obs = self.obs_rows
        if obs is None or obs["instances"].shape[0] != len(insts):
            obs = {"request": np.empty(8, f32), "app": np.empty(self.n_apps, f32), "tier": np.empty(self.n_tiers, f32),
                   "instances": np.empty((len(insts), len(INSTANCE_FEATURES)), f32),
                   "slack": np.empty((len(insts), self.n_tiers), f32), "recent": np.empty(2, f32)}
            if placed is not None:
                obs["placed_since"] = np.empty(placed.size - 1, f32)
        if placed is None:
            placed, out_since = _NO_PLACED, _EMPTY32
        else:
            out_since = obs["placed_since"]
        if n := kernels.arrival_observation(
                r, self._request_rows, w.app, w.tier, self._ewma, sim._n_done / max(len(w), 1), rs.I, rs.F, rs.stage,
                rs.ready, w.stage_kind, w.stage_ttft, DECODE, rs.slot, run, wait, shape, self._coef, self._memo_nc,
                self._memo_t, now, CLIP, placed, obs["request"], obs["app"], obs["tier"], obs["recent"],
                obs["instances"], obs["slack"], out_since, self._stale):
            self._time_stale(insts, obs["instances"], n)
        return obs

    def _resident_inputs(self, insts: list[Instance]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_load_inputs` for every instance of the simulator, found by one compiled scan of the requests that
        have arrived and not all finished before them (:func:`slogym.envs.kernels.resident`; gathering the
        instances' lists instead costs more than the scan while that stretch holds up to ``SCAN_MAX`` requests,
        beyond which it gathers, until the stretch's start finishes)."""
        sim = self.sim
        shape = self._shape
        if shape.size != 6 * len(insts):
            shape = self._shape = np.array([(0, 0, 0, i.total_blocks, i.engine.max_num_seqs, i.id) for i in insts],
                                           np.int64).reshape(-1)
            self._pos = np.zeros(2 * len(insts), np.int64)
            if self._memo_t.size < len(insts):
                self._grow_tables()
        shape[2::6] = sim.free_blocks()
        rs = sim.rs
        self._lo, n_wait, n_run = kernels.resident(rs.status, rs.I, self._lo, sim._na, SCAN_MAX, DONE, WAITING,
                                                   RUNNING, shape, self._wait_buf, self._run_buf, self._pos)
        if n_wait < 0:
            return self._load_inputs(insts)
        return self._run_buf[:n_run], self._wait_buf[:n_wait], shape

    def _load_inputs(self, insts: list[Instance]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What :func:`slogym.envs.kernels.instance_load` reads about ``insts``: their running requests and
        their waiting requests (each concatenated in instance order) and, flat, per instance ``(waiting,
        running, free KV blocks, total KV blocks, max_num_seqs, id)``. Sizes the per-instance tables."""
        flat: list[int] = []
        if len(insts) == 1:
            i = insts[0]
            run, waiting = i.running_array(), i.waiting
            flat += (len(waiting), run.size, i.free_blocks, i.total_blocks, i.engine.max_num_seqs, i.id)
        else:
            runs: list[np.ndarray] = []
            waiting = []
            for i in insts:
                r = i.running_array()
                runs.append(r)
                waiting += i.waiting
                flat += (len(i.waiting), r.size, i.free_blocks, i.total_blocks, i.engine.max_num_seqs, i.id)
            run = np.concatenate(runs)
        shape = np.array(flat, np.int64)
        if self._memo_t.size < len(self.sim.instances):
            self._grow_tables()
        return run, np.array(waiting, np.int64), shape

    def _grow_tables(self) -> None:
        """Rows for the simulator's new instances (by id): decode-step time memo, compiled perf-model
        coefficients (``Instance.time_coef``, NaN where there are none), and the stale scratch."""
        insts = self.sim.instances
        old, n_ids = self._memo_t.size, len(insts)
        coef = np.full((n_ids - old, N_COEF), np.nan)
        for k, inst in enumerate(insts[old:]):
            c = getattr(inst, "time_coef", None)
            if c is not None:
                coef[k] = c
        self._coef = np.concatenate((self._coef, coef))
        self._memo_nc = np.concatenate((self._memo_nc, np.full((n_ids - old, 2), -1, np.int64)))
        self._memo_t = np.concatenate((self._memo_t, np.zeros(n_ids - old)))
        self._stale = np.zeros((n_ids, 3), np.int64)

    def _time_stale(self, insts: list[Instance], out: np.ndarray, n: int) -> None:
        """Time a decode step of every running request on the ``n`` instances the kernel listed in ``_stale``
        and write it to ``out[:, 4]`` (clipping before or after the float32 cast gives the same value)."""
        for k, n_run, ctx in self._stale[:n].tolist():
            inst = insts[k]
            t = inst.time_one(BatchFeatures(0, 0, 0, 0, n_run, n_run, ctx, ctx, 0))
            self._memo_t[inst.id] = t
            out[k, 4] = min(max(t / 0.1, -CLIP), CLIP)

    def _instance_features(self, insts: list[Instance]) -> np.ndarray:
        """``(len(insts), 5)`` load features, clipped: waiting prefill tokens / 8192, waiting count / 64,
        running / max_num_seqs, KV utilization, predicted time of a decode step of every running request /
        100 ms (recomputed only when the instance's running count or context changed: the perf model is a pure
        function of those features)."""
        run, wait, shape = self._load_inputs(insts)
        out = np.empty((len(insts), len(INSTANCE_FEATURES)), np.float32)
        if n := kernels.instance_load(self.sim.rs.I, run, wait, shape, self._coef, self._memo_nc, self._memo_t,
                                      CLIP, out, self._stale):
            self._time_stale(insts, out, n)
        return out

    def _arrival_space(self) -> spaces.Dict:
        return spaces.Dict({
            "request": _box(8), "app": _box(self.n_apps, low=0.0, high=1.0),
            "tier": _box(self.n_tiers, low=0.0, high=1.0),
            "instances": _box(self.n_instances, len(INSTANCE_FEATURES)),
            "slack": _box(self.n_instances, self.n_tiers), "recent": _box(2, low=0.0, high=1.0),
        })

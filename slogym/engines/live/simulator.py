"""The live backend: the simulator's event loop with every iteration executed on a real vLLM engine.

:class:`LiveSimulator` is a :class:`~slogym.core.simulator.Simulator` whose ``iteration_time`` hook sends the
batch the slogym policy chose to a :class:`~slogym.engines.live.client.VLLMEngine` and returns the measured
time, so request lifecycle, token accounting, SLO bookkeeping and per-request records are the simulator's own
(the records are schema-identical to a simulated run's by construction). KV residency is mirrored through the
``on_kv_freed`` hook: a request the simulator preempted is preempted (recompute) in vLLM before the next step,
one it dropped is aborted. Before every step the engine checks that its computed/known token counts of each
planned request equal the simulator's, so the two ledgers cannot drift silently.

Clocks: ``afap`` (as fast as possible) keeps arrivals virtual and advances the clock by measured iteration
times only (wall, CPU or normalized CPU time of the engine step, per ``EngineConfig.timing``); ``real`` sleeps
until each iteration's start time has come on the wall clock (arrival offsets from the start of serving: after a
simulated warm-up that compiles the kernels and after the policy's reset), and an iteration's duration is wall
time from its scheduled start to the end of the engine step, so policy and IPC overhead and any lateness count as
they would in a real server. ``real`` takes one engine: engines are stepped one after another, so a real-time
clock would charge each the others' steps.

What the live backend cannot express (raises :class:`UnsupportedOnLiveEngine` naming the value): speculative
decoding (``Batch.spec``), tool calls and later prefill stages (``external`` stages: vLLM cannot append prompt
tokens to a live request), contexts beyond the engine's ``max_model_len``, batches over its ``max_num_seqs`` /
``max_num_batched_tokens``, P/D disaggregation (``pd=``, ``switch_role`` to a P/D role) and scaling (a policy with
a scaler, ``add_instance``): one colocated engine per instance, given at construction.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from slogym.core.batch import BatchFeatures
from slogym.core.errors import EngineError, SchedulerError
from slogym.core.instance import Instance, Role
from slogym.core.policy import Policy
from slogym.core.request import StageKind, Workload
from slogym.core.simulator import Simulator
from slogym.core.state import Outcome, Status
from slogym.engines.base import EngineSpec, PerfModel
from slogym.engines.live.client import EngineConfig, VLLMEngine, batch_kind
from slogym.engines.perf_models import QuadraticPerf

CLOCKS = ("afap", "real")
WARMUP_REQUESTS = 16  # requests a real-clock run first replays in simulation to compile kernels (_warm_up)

# HyperFlexis Eq. 1-2 (quadratic family) fitted to the default tiny model on the 2-core CPU machine: the profile
# of `scripts/fidelity.py --timing cpu` (App. A grid within 32 sequences / 1024 tokens, 3 passes, per-composition
# medians; held-out MAPE 16 %). Only a planning aid for policies that predict batch times: the live backend's own
# iteration times are always measured.
TINY_CPU_QUADRATIC = {"c0": 2.07e-3, "c_prefill_tok": 1.45e-5, "c_prefill_sq": 2.8e-10, "c_prefill_attn": 0.0,
                      "c_decode_tok": 6.6e-5, "c_decode_ctx": 2.2e-7}


class UnsupportedOnLiveEngine(SchedulerError):
    """A batch or workload feature the live vLLM backend cannot execute (names what and the value)."""


def live_spec(config: EngineConfig, perf: PerfModel | EngineSpec | None = None) -> EngineSpec:
    """The engine preset a policy sees for a live engine: its KV pool, block size and batch limits, and a perf
    model for policies that plan with one (``perf``, default :data:`TINY_CPU_QUADRATIC`)."""
    if isinstance(perf, EngineSpec):
        perf = perf.perf
    model = perf if perf is not None else QuadraticPerf(**TINY_CPU_QUADRATIC)
    return EngineSpec(name=f"vllm-live:{config.model}", model=str(config.model), gpu="cpu", tp=1, perf=model,
                      kv_capacity_tokens=config.num_blocks * config.block_size, block_size=config.block_size,
                      max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                      provenance={"source": "live vLLM engine", "perf": "given" if perf is not None else
                                  "TINY_CPU_QUADRATIC (planning only)"})


class LiveSimulator(Simulator):
    """Replays ``workload`` under ``policy`` with each instance's iterations run on a live vLLM engine.

    engines   one :class:`VLLMEngine` per instance (the caller owns and closes them)
    perf      perf model / preset that planning policies see (see :func:`live_spec`)
    clock     ``afap`` or ``real`` (module doc)

    After a run, :meth:`iteration_records` lists every executed batch's features and measured time (the
    profile-record columns). Any exception during the run (an :class:`EngineError`, an unsupported batch, a
    policy's error, ``KeyboardInterrupt``) aborts what every engine still open holds, marks every unfinished
    request ``failed``, is re-raised, and carries the partial :class:`~slogym.core.metrics.RunResult` as
    ``error.result``.
    """

    live = True

    def __init__(self, workload: Workload, engines: VLLMEngine | Sequence[VLLMEngine], policy: Policy, *,
                 perf: PerfModel | EngineSpec | None = None, clock: str = "afap", **kwargs: Any) -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock={clock!r}; expected one of {CLOCKS}")
        self.live_engines = [engines] if isinstance(engines, VLLMEngine) else list(engines)
        if not self.live_engines:
            raise ValueError("LiveSimulator needs at least one VLLMEngine")
        if kwargs.get("pd") is not None:
            raise UnsupportedOnLiveEngine(f"pd={kwargs['pd']!r}: P/D disaggregation is not supported by the live "
                                          "vLLM backend (no KV transfer between engines); every instance is "
                                          "colocated")
        if policy.scaler is not None:
            raise UnsupportedOnLiveEngine(f"policy {policy.name!r} has a scaler ({type(policy.scaler).__name__}): "
                                          "scaling is not supported by the live vLLM backend, which runs one "
                                          "engine per instance, given at construction (no add_instance, no P/D "
                                          "roles)")
        if clock == "real" and len(self.live_engines) > 1:
            # iteration_time blocks on one engine's reply, so engines would step one after another and each
            # iteration's wall-clock duration would include the other engines' steps
            raise UnsupportedOnLiveEngine(f"clock='real' with {len(self.live_engines)} engines: the live backend "
                                          "steps engines one at a time, so a real-time clock would charge each "
                                          "engine the others' steps; use clock='afap' (measured step times) or "
                                          "one engine")
        self.clock = clock
        specs = [live_spec(e.config, perf) for e in self.live_engines]
        _check_expressible(workload, self.live_engines[0].config)
        self._sim_kwargs = {k: v for k, v in kwargs.items() if k not in ("fast_forward", "pilot", "progress")}
        self.warmup_seconds = 0.0
        super().__init__(workload, specs, policy, n_instances=len(specs), **kwargs)

    # ---------------------------------------------------------------- run
    def _reset_state(self) -> None:
        super()._reset_state()
        n = len(self.live_engines)
        self._known: list[set[int]] = [set() for _ in range(n)]      # requests the engine holds
        self._freed: list[set[int]] = [set() for _ in range(n)]      # KV dropped by the simulator since last step
        self._engine_done: list[set[int]] = [set() for _ in range(n)]  # finished by the engine itself
        self._iter_log: list[tuple[int, float, float, float, float, float, float, int, int, BatchFeatures]] = []
        self.error: str | None = None

    def run(self) -> "LiveSimulator":
        self._t0 = time.perf_counter()
        try:
            super().run()
        except BaseException as e:
            self._abandon(e)
            raise
        for i in range(len(self.live_engines)):
            self._check_ledgers(i)
        return self

    def decisions(self) -> Any:
        if not hasattr(self, "_t0"):
            self._t0 = time.perf_counter()
        if self.clock == "real":
            self._warm_up()
        try:
            yield from super().decisions()
        except BaseException as e:  # an agent-driven run (GeneratorExit: the driver abandoned it)
            self._abandon(e)
            raise

    def _warm_up(self, n: int = WARMUP_REQUESTS) -> None:
        """Before a real-clock run: replay the first ``n`` requests under the policy in simulation only (the
        perf model of :func:`live_spec` times the iterations; nothing reaches the engines), so that first-use
        Numba compilation of the simulator's and the policy's kernels happens before the clock starts. Measured
        with a cold ``NUMBA_CACHE_DIR`` (``/tmp/rev_live/h7.py``, sarathi): without it the first three TTFTs were
        1.6-6.1 s and attainment 0.0. The time is kept in ``warmup_seconds``; a warm-up that fails is skipped
        (the live run then meets the same error itself)."""
        t0 = time.perf_counter()
        try:
            Simulator(self.w.subset(np.arange(min(n, len(self.w)))), list(self.engines), self.policy,
                      n_instances=len(self.engines), fast_forward=False, pilot=False, **self._sim_kwargs).run()
        except Exception:  # noqa: BLE001 -- see the docstring
            pass
        self.warmup_seconds = time.perf_counter() - t0

    def _loop(self) -> Any:
        # serving starts: this run owns its engines, which drop whatever an earlier run left in them (an abandoned
        # agent-driven run whose generator is not yet garbage-collected: request ids are workload indices, so its
        # requests would collide with this run's); a late clean-up of that run then leaves the engines alone
        for eng in self.live_engines:
            eng.owner = self
            if not eng.closed:
                eng.abort([], everything=True)
        # the real clock starts now: after the policy's reset (set-up, JIT compilation), the warm-up and the
        # simulator's own set-up, so those never count as lateness of the first requests
        self._t0 = time.perf_counter()
        yield from super()._loop()

    def _abandon(self, e: BaseException) -> None:
        """The run ends with ``e`` (any exception, Ctrl-C included): what the engines hold is aborted, every
        unfinished request is ``failed``, and ``e.result`` is the partial :class:`~slogym.core.metrics.RunResult`
        (first handler only: ``run`` and ``decisions`` both call this)."""
        if self.error is not None:
            return
        try:
            self._fail_unfinished(f"{type(e).__name__}: {e}")
            e.result = self.result()  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 -- the original exception is what the caller must see
            e.add_note(f"LiveSimulator: cleaning up after it failed too: {err!r}")

    def _fail_unfinished(self, reason: str) -> None:
        """Abort everything every engine still open holds for this run (the survivors of a failed engine included;
        not on an engine a later run has taken over), then give every request without an outcome ``failed`` (its
        KV released); the run ends now."""
        self.error = reason
        for i, eng in enumerate(self.live_engines):
            held = sorted(self._known[i])
            self._known[i].clear()
            self._freed[i].clear()
            self._engine_done[i].clear()
            if held and not eng.closed and eng.owner is self:
                try:
                    eng.abort(held)
                except EngineError:  # this engine is gone too; it closed itself
                    pass
        rs = self.rs
        for r in np.flatnonzero(rs.status != Status.DONE).tolist():
            if rs.status[r] == Status.QUEUED:
                self.global_queue.remove(r)
            self._release(r)
            rs.status[r] = Status.DONE
            rs.outcome[r] = Outcome.FAILED
            rs.finish[r] = self.now
        self.dropped_reasons["engine_error"] = int((rs.outcome == Outcome.FAILED).sum())
        for inst in self.instances:
            inst.busy, inst.inflight = False, None
        self._finalize()
        self.wall_seconds = time.perf_counter() - getattr(self, "_wall0", self._t0)

    # ---------------------------------------------------------------- cluster API (one engine per instance)
    def add_instance(self, *args: Any, **kwargs: Any) -> int:
        raise UnsupportedOnLiveEngine("add_instance (scale-out) is not supported by the live vLLM backend: it runs "
                                      f"one engine per instance, the {len(self.live_engines)} given at construction")

    def switch_role(self, i: int, role: Role) -> None:
        if Role(role) != Role.COLOCATED:
            raise UnsupportedOnLiveEngine(f"switch_role({i}, {Role(role).name}): P/D roles are not supported by "
                                          "the live vLLM backend (no KV transfer between engines)")
        super().switch_role(i, role)

    # ---------------------------------------------------------------- hooks
    def on_kv_freed(self, r: int, inst: Instance) -> None:
        self._freed[inst.id].add(r)

    def iteration_time(self, inst: Instance, idx: np.ndarray, tok: np.ndarray, spec: np.ndarray | None,
                       features: BatchFeatures) -> float:
        """Run this batch on ``inst``'s engine; returns its measured time (module doc: clocks)."""
        i = inst.id
        if i >= len(self.live_engines):
            raise UnsupportedOnLiveEngine(f"instance {i} has no live engine ({len(self.live_engines)} given); "
                                          "scaling out is not supported by the live backend")
        eng = self.live_engines[i]
        if spec is not None and spec.any():
            raise UnsupportedOnLiveEngine(f"instance {i}: speculative decoding (spec={spec.tolist()}) is not "
                                          "supported by the live vLLM backend")
        cfg = eng.config
        n_tok = int(tok.sum())
        if idx.size > cfg.max_num_seqs or n_tok > cfg.max_num_batched_tokens:
            raise UnsupportedOnLiveEngine(f"instance {i}: batch of {idx.size} requests / {n_tok} tokens exceeds "
                                          f"the engine's max_num_seqs={cfg.max_num_seqs} / "
                                          f"max_num_batched_tokens={cfg.max_num_batched_tokens}")
        preempt, abort = self._resolve_freed(i)
        rs, w = self.rs, self.w
        known = self._known[i]
        add = [(r, int(w.input_tokens[r]), int(w.output_tokens[r])) for r in idx.tolist() if r not in known]
        known.update(r for r, _, _ in add)
        nc, nt = rs.num_computed[idx], rs.num_tokens[idx]
        plan = list(zip(idx.tolist(), tok.tolist(), nc.tolist(), nt.tolist()))
        start = self._t0 + self.now
        if self.clock == "real":
            lag = start - time.perf_counter()
            if lag > 0:
                time.sleep(lag)
        reply = eng.step(plan, add=add, abort=abort, preempt=preempt)
        measured = eng.duration(reply, batch_kind(int(features.prefill_tokens), int(features.decode_seqs)))
        dt = time.perf_counter() - start if self.clock == "real" else measured
        self._engine_done[i].update(reply["finished"])
        if reply["executed"] != {r: n for r, n, _, _ in plan}:
            raise EngineError(f"instance {i}: the engine executed {reply['executed']}, the policy's batch was "
                              f"{ {r: n for r, n, _, _ in plan} }")
        for r, n, c, _ in plan:
            got = reply["state"].get(r)
            if got is not None and got[0] != c + n:
                raise EngineError(f"instance {i}: request {r} has {got[0]} computed tokens in the engine after "
                                  f"the step, the simulator expects {c + n}")
        self._iter_log.append((i, self.now, measured, float(reply["time_s"]), float(reply["cpu_s"]),
                               float(reply["speed"]), float(reply.get("speed_ops", 1.0)),
                               int(reply.get("nivcsw", -1)), int(reply.get("minflt", -1)), features))
        return dt

    def _resolve_freed(self, i: int) -> tuple[list[int], list[int]]:
        """Requests whose KV the simulator dropped since the last step: preempt those waiting again (recompute),
        abort those that are done (unless the engine already finished them)."""
        preempt: list[int] = []
        abort: list[int] = []
        known, done = self._known[i], self._engine_done[i]
        for r in sorted(self._freed[i]):
            if r not in known:
                continue
            if self.rs.status[r] == Status.DONE:
                known.discard(r)
                if r in done:
                    done.discard(r)
                else:
                    abort.append(r)
            elif r not in done:
                preempt.append(r)
        self._freed[i].clear()
        stray = done - {r for r in done if self.rs.status[r] == Status.DONE}
        if stray:
            raise EngineError(f"instance {i}: the engine finished requests {sorted(stray)} that the simulator "
                              "has not finished (token accounting diverged)")
        return preempt, abort

    def _check_ledgers(self, i: int) -> None:
        """End of run: release what the engine still holds; nothing the engine finished may be unfinished here."""
        preempt, abort = self._resolve_freed(i)
        left = sorted(self._known[i] - set(abort))
        if preempt or left:
            eng = self.live_engines[i]
            if not eng.closed:
                eng.abort(left + preempt)

    # ---------------------------------------------------------------- results
    def iteration_records(self) -> pd.DataFrame:
        """One row per executed iteration: ``instance``, ``start`` (sim time), the BatchFeatures columns,
        ``time_s`` (the engine step under the engine's timing; the columns ``slogym profile fit`` reads),
        ``wall_s``, ``cpu_s`` and ``speed`` (the ``norm`` timing's factor; 1.0 under the other timings), and
        ``speed_ops`` (the diagnostic second reference's factor, :class:`~slogym.engines.live.worker.
        OpsReference`), ``nivcsw`` and ``minflt`` (the worker's involuntary context switches and minor page faults
        during the step, from ``getrusage``; -1 where the worker does not report them): what the host did to a
        step that took longer than its batch explains."""
        rows = [{"instance": i, "start": t, **{k: int(v) for k, v in zip(BatchFeatures._fields, f)},
                 "time_s": dt, "wall_s": wall, "cpu_s": cpu, "speed": speed, "speed_ops": ops, "nivcsw": csw,
                 "minflt": flt}
                for i, t, dt, wall, cpu, speed, ops, csw, flt, f in self._iter_log]
        cols = ["instance", "start", *BatchFeatures._fields, "time_s", "wall_s", "cpu_s", "speed", "speed_ops",
                "nivcsw", "minflt"]
        return pd.DataFrame(rows, columns=cols)


def _check_expressible(w: Workload, cfg: EngineConfig) -> None:
    kinds = w.stage_kind
    first = np.zeros(kinds.size, bool)
    first[w.stage_ptr[:-1]] = True
    bad = (kinds == StageKind.EXTERNAL) | ((kinds == StageKind.PREFILL) & ~first)
    if bad.any():
        r = int(np.searchsorted(w.stage_ptr, int(np.flatnonzero(bad)[0]), side="right") - 1)
        raise UnsupportedOnLiveEngine(f"request {r} has a tool call or a second prefill stage; the live vLLM "
                                      "backend supports prefill followed by decode stages only")
    ctx = w.input_tokens + w.output_tokens
    over = ctx > cfg.max_model_len
    if over.any():
        r = int(np.flatnonzero(over)[0])
        raise UnsupportedOnLiveEngine(f"request {r} needs {int(ctx[r])} tokens of context; the live engine's "
                                      f"max_model_len is {cfg.max_model_len}")

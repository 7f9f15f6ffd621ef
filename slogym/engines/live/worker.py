"""The live-engine worker: one vLLM v1 engine driven step by step, in its own process.

Run as a script (``python worker.py``) by :class:`slogym.engines.live.client.VLLMEngine`, usually under the
Python of a separate vLLM environment, so this file imports nothing from slogym. It speaks length-prefixed
pickles on the stdout/stdin pipes it was started with (anything vLLM prints goes to stderr):

``init``   build the engine (in-process EngineCore, no async scheduling, no prefix caching, KV pool of exactly
           ``num_blocks`` usable blocks) with :class:`PlanScheduler` in place of vLLM's scheduler
``step``   add new requests, abort some, then run ONE engine step whose batch is the plan sent with it;
           reply with the wall and CPU time of ``LLMEngine.step()``, the batch vLLM executed, and every planned
           request's token counts after it
``abort``  abort requests (free their KV) without stepping; ``all``: every request the engine holds
``stop``   shut the engine down and exit

``python worker.py tiny-model DIR`` writes a tiny random-weight Llama model (no download) and exits.

The plan is the slogym policy's batch: which requests run, how many tokens each computes (prefill chunk or a
one-token decode step), and which running requests are preempted by recompute first. vLLM's own scheduling
rules (token budget, FCFS order, watermark, its preemption choice) are not consulted.
"""

from __future__ import annotations

import collections
import gc
import math
import os
import pickle
import resource
import statistics
import struct
import sys
import time
import traceback
from typing import Any

_HEADER = struct.Struct(">I")


# ---------------------------------------------------------------------------------------------- framing
def read_msg(f: Any) -> Any:
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("pipe closed")
    n = _HEADER.unpack(head)[0]
    body = f.read(n)
    if len(body) < n:
        raise EOFError("pipe closed mid-message")
    return pickle.loads(body)


def write_msg(f: Any, obj: Any) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(body)) + body)
    f.flush()


# ---------------------------------------------------------------------------------------------- tiny model
def make_tiny_model(out_dir: str, hidden: int = 128, layers: int = 2, heads: int = 4, vocab: int = 512,
                    max_len: int = 4096, seed: int = 0) -> str:
    """Save a random-weight Llama-architecture model built from a config (nothing downloaded).

    ``hidden / heads`` is the attention head_dim; vLLM's CPU attention needs it >= 32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % heads or hidden // heads < 32:
        raise ValueError(f"hidden={hidden}, heads={heads}: head_dim must be an integer >= 32 (vLLM CPU attention)")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max_len, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------- engine
def _plan_scheduler_class() -> type:
    """vLLM's v1 Scheduler with ``schedule()`` replaced by "execute the plan" (imports vLLM lazily)."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    class PlanScheduler(Scheduler):
        """Forms each step's batch from ``self.plan`` = (preempt ids, [(id, tokens, nc, nt), ...]).

        Preemption reuses vLLM's recompute path (blocks freed, ``num_computed_tokens = 0``, back to the front of
        the waiting queue). KV blocks come from vLLM's own manager; the planner sized its pool identically, so an
        allocation failure means the two ledgers diverged and is reported as an error. ``nc``/``nt`` are the
        planner's computed/known token counts, checked against vLLM's before anything runs.
        """

        plan: tuple[list[str], list[tuple[str, int, int, int]]] | None = None
        executed: dict[str, int] = {}  # the last step's num_scheduled_tokens, as handed to the model runner

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.kv_cache_manager.watermark_blocks = 0  # admission headroom is the policy's business

        def schedule(self, throttle_prefills: bool = False) -> Any:
            if self.plan is None:
                raise RuntimeError("engine step without a plan")
            preempt, items = self.plan
            self.plan = None
            self.current_step += 1
            self.kv_cache_manager.new_step_starts()
            now = time.monotonic()
            for rid in preempt:
                req = self.requests[rid]
                self.running.remove(req)
                self._preempt_request(req, now)
            new: list[Any] = []
            resumed: list[Any] = []
            running: list[Any] = []
            blocks: dict[str, Any] = {}
            n_sched: dict[str, int] = {}
            for rid, n, nc, nt in items:
                req = self.requests.get(rid)
                if req is None:
                    raise RuntimeError(f"planned request {rid} is not in the engine")
                if (req.num_computed_tokens, req.num_tokens) != (nc, nt):
                    raise RuntimeError(f"request {rid}: engine has {req.num_computed_tokens} computed of "
                                       f"{req.num_tokens} tokens, planner {nc} of {nt}")
                got = self.kv_cache_manager.allocate_slots(req, n, has_scheduled_reqs=False)
                if got is None:
                    raise RuntimeError(f"request {rid}: no KV blocks for {n} tokens "
                                       f"({self.kv_cache_manager.block_pool.get_num_free_blocks()} free)")
                if req.status == RequestStatus.RUNNING:
                    running.append(req)
                    blocks[rid] = got
                else:
                    self.waiting.remove_request(req)
                    self.running.append(req)
                    (new if req.status == RequestStatus.WAITING else resumed).append(req)
                    req.status = RequestStatus.RUNNING
                    blocks[rid] = self.kv_cache_manager.get_blocks(rid)
                n_sched[rid] = n
            if self.use_v2_model_runner:
                new, resumed = new + resumed, []
                new_data = [NewRequestData.from_request(r, blocks[r.request_id].get_block_ids(), r._all_token_ids,
                                                        uses_mrope=self.model_uses_mrope) for r in new]
            else:
                new_data = [NewRequestData.from_request(r, blocks[r.request_id].get_block_ids(),
                                                        uses_mrope=self.model_uses_mrope) for r in new]
            cached = self._make_cached_request_data(running, resumed, n_sched, {}, blocks)
            if not self.use_v2_model_runner:
                self.prev_step_scheduled_req_ids = set(n_sched)
            out = SchedulerOutput(
                scheduled_new_reqs=new_data, scheduled_cached_reqs=cached, num_scheduled_tokens=n_sched,
                total_num_scheduled_tokens=sum(n_sched.values()), scheduled_spec_decode_tokens={},
                scheduled_encoder_inputs={}, preempted_req_ids=self.reset_preempted_req_ids,
                finished_req_ids=self.finished_req_ids,
                free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
                new_block_ids_to_zero=self._get_new_block_ids_to_zero(),
                ec_manager_metadata=self.encoder_cache_manager.get_manager_metadata())
            self._update_after_schedule(out)
            self.executed = dict(out.num_scheduled_tokens)
            return out

    return PlanScheduler


class SpeedReference:
    """How fast the CPU runs around each engine step relative to the engine's typical speed, from a reference
    kernel.

    On a shared VM the CPU time of an identical engine step drifts by tens of % within seconds with the load of
    other processes and tenants: the step is not descheduled, it runs slower (shared caches, memory bandwidth,
    frequency). The reference is a fixed set of small fp32 GEMMs shaped like one layer of the model (16 tokens:
    QKV, O, gate-up, down), run ``reps`` times per sample and timed in thread CPU time right before and right
    after each step. Measured against 2000 back-to-back repeats of one decode batch on the shared 2-core
    machine: block medians of the step time correlate 0.96 with the kernel's (a pure-Python loop: 0.80).

    ``factor()`` = typical / geometric mean of the last ``window`` samples (this step's two and, at the default
    4, the previous step's two), so ``cpu_s * factor()`` is the step's CPU time at the typical speed. The
    samples are noisy themselves (one pass ~0.3 ms for hidden 256, spreading ~13 %); measured 2026-11-22 at
    load average 3.5-5 (mean |t / median - 1| of identical batches, normalized CPU time; raw CPU time 17.8 /
    12.3 / 11.8 %), computed offline from samples recorded around every step: in a live replay of the fidelity
    trace (17.6k steps) 8.87 % with the previous rule (arithmetic mean of this step's two samples) against
    8.68 % now; in two back-to-back streams 9.1 / 8.6 % against 7.5 / 7.1 %. Rejected on the replay: ``reps=4``
    passes per sample (10.3 % with the window of 4: in served traffic the engine waits between steps, and the
    single pass next to the step catches the cold caches it starts from, which more passes dilute; in
    back-to-back streams it had looked better), longer windows (6-20 samples: 9.0-10.2 %), a median of the
    window (8.9 %) and per-sample weights fitted by regression (no gain).
    ``typical`` is the median kernel time over the engine's first ``calibrate`` steps (a running median until
    then), then frozen: beside engine steps the kernel starts from caches the step evicted, so a start-up
    calibration in isolation would be ~2x too fast. The unit is per engine process: compare normalized times
    of one engine only, after its first ``calibrate`` steps (the profiler's shape warm-up runs 1024)."""

    @staticmethod
    def shapes(hidden: int) -> tuple[tuple[int, int], ...]:
        """The weight shapes of one layer of a ``make_tiny_model`` Llama of this hidden size (intermediate =
        2 x hidden): QKV, O, gate-up, down."""
        return (hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (2 * hidden, hidden)

    def __init__(self, calibrate: int = 500, window: int = 4, hidden: int = 128, reps: int = 1) -> None:
        import torch

        if min(calibrate, reps) < 1 or window < 2:
            raise ValueError(f"SpeedReference(calibrate={calibrate}, window={window}, reps={reps}): calibrate and "
                             "reps must be >= 1, window >= 2 (a step's two bracketing samples)")
        gen = torch.Generator().manual_seed(0)
        shapes = self.shapes(hidden)
        self._w = [torch.randn(k, n, generator=gen) for k, n in shapes]
        self._x = [torch.randn(16, k, generator=gen) for k, _ in shapes]
        self._mm = torch.mm
        self._calib: list[float] = []
        self._need = 2 * calibrate  # two samples per step
        self._reps = reps
        self.typical: float | None = None
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def _kernel(self) -> float:
        t0 = time.thread_time()
        for _ in range(self._reps):
            for x, w in zip(self._x, self._w):
                self._mm(x, w)
        return time.thread_time() - t0

    def sample(self) -> None:
        t = self._kernel()
        self.recent.append(t)
        if self.typical is None:
            self._calib.append(t)
            if len(self._calib) >= self._need:
                self.typical = statistics.median(self._calib)

    def unit(self) -> float:
        return self.typical if self.typical is not None else statistics.median(self._calib)

    def factor(self) -> float:
        return self.unit() / math.exp(sum(map(math.log, self.recent)) / len(self.recent))


class OpsReference(SpeedReference):
    """A second speed reference for diagnosis: many tiny torch ops and Python dict / list work (~0.3 ms), the
    dispatcher- and interpreter-bound kind of work in vLLM's per-step bookkeeping, which dominates a decode step
    of a few requests (the GEMM reference measures arithmetic and weight streaming). Same calibration and
    factor as :class:`SpeedReference`, sampled once per step, right after the GEMM reference's second sample
    (so that one's samples keep their place next to the step); replies carry its factor as ``speed_ops`` (not
    used by any timing)."""

    def __init__(self, calibrate: int = 250, window: int = 4) -> None:
        import torch

        # one sample per step: 2 x 250 samples calibrate over the engine's first 500 steps, like the GEMM one
        super().__init__(calibrate=calibrate, window=window, hidden=32)
        self._t = torch.arange(64, dtype=torch.float32)
        self._idx = torch.arange(0, 64, 2)

    def _kernel(self) -> float:
        t0 = time.thread_time()
        a = self._t
        for _ in range(24):
            a = (a * 1.0001 + 0.5).relu()
            a[self._idx] = a[self._idx] * 0.5
        table = {i: (i, str(i)) for i in range(300)}
        sum(v[0] for k, v in table.items() if k % 3)
        return time.thread_time() - t0


class Worker:
    """Owns the engine and the map from planner ids to vLLM's internal request ids."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        if cfg.get("nice"):  # a measurement aid on shared machines: schedule the engine ahead of other work
            os.setpriority(os.PRIO_PROCESS, 0, int(cfg["nice"]))
        import torch

        torch.set_num_threads(int(cfg.get("threads", 1)))
        from vllm import EngineArgs, LLMEngine, SamplingParams, __version__

        self.SamplingParams = SamplingParams
        bs, nb = int(cfg["block_size"]), int(cfg["num_blocks"])
        args = EngineArgs(model=cfg["model"], skip_tokenizer_init=True, dtype=cfg.get("dtype", "float32"),
                          seed=int(cfg.get("seed", 0)), block_size=bs, num_gpu_blocks_override=nb + 1,
                          max_model_len=int(cfg["max_model_len"]), max_num_seqs=int(cfg["max_num_seqs"]),
                          max_num_batched_tokens=int(cfg["max_num_batched_tokens"]), enable_prefix_caching=False,
                          enable_chunked_prefill=True, async_scheduling=False, enforce_eager=True,
                          gpu_memory_utilization=float(cfg.get("memory_fraction", 0.1)),
                          scheduler_cls=_plan_scheduler_class())
        self.engine = LLMEngine.from_engine_args(args)
        self.sched = self.engine.engine_core.engine_core.scheduler
        self.vocab = int(self.engine.model_config.get_vocab_size())
        self.ids: dict[int, str] = {}
        self.gc_in_step = bool(cfg.get("gc_in_step", True))
        self.speed = (SpeedReference(hidden=int(cfg.get("ref_hidden") or 128), reps=int(cfg.get("ref_reps", 1)),
                                     window=int(cfg.get("ref_window", 4)))
                      if cfg.get("timing") == "norm" else None)
        self.ops = OpsReference() if self.speed is not None else None
        self.exec_s = [0.0, 0.0]  # wall and CPU time inside the model executor during the current step
        executor = self.engine.engine_core.engine_core.model_executor
        for name in ("execute_model", "sample_tokens"):
            setattr(executor, name, self._timed(getattr(executor, name)))
        free = self.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        self.thread_clock = int(cfg.get("threads", 1)) == 1
        rt = int(cfg.get("rt_priority", 0))
        if rt:  # after start-up: only the engine thread (and threads it starts later) runs real-time
            try:
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt))
            except OSError as e:
                raise RuntimeError(f"rt_priority={rt}: the OS refused SCHED_FIFO for the engine thread ({e}); it "
                                   "needs root or CAP_SYS_NICE -- run with rt_priority=0") from None
        self.info = {"ok": True, "num_blocks": free, "block_size": bs, "vllm": __version__, "pid": os.getpid(),
                     "init_s": time.perf_counter() - t0, "sched_policy": os.sched_getscheduler(0)}

    def _timed(self, fn: Any) -> Any:
        """``fn`` (a model-executor call: forward pass or sampling) adding its wall and CPU time to ``exec_s``."""
        def call(*a: Any, **kw: Any) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.exec_s[0] += time.perf_counter() - t0
                self.exec_s[1] += time.thread_time() - c0
        return call

    def _add(self, rid: int, prompt_len: int, max_tokens: int) -> None:
        prompt = [1 + (rid * 7919 + i * 31) % (self.vocab - 2) for i in range(prompt_len)]
        params = self.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                                     temperature=0.0, detokenize=False)
        self.ids[rid] = self.engine.add_request(str(rid), {"prompt_token_ids": prompt}, params)

    def abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        which = list(self.ids) if msg.get("all") else msg.get("abort", ())
        gone = [self.ids.pop(r) for r in which if r in self.ids]
        if gone:
            self.engine.abort_request(gone, internal=True)
        return {"ok": True, "aborted": len(gone),
                "free_blocks": self.sched.kv_cache_manager.block_pool.get_num_free_blocks()}

    def step(self, msg: dict[str, Any]) -> dict[str, Any]:
        for rid, prompt_len, max_tokens in msg.get("add", ()):
            self._add(rid, prompt_len, max_tokens)
        self.abort(msg)
        if not msg["plan"]:
            raise ValueError("a step needs a non-empty plan")
        if msg.get("hang"):  # fault injection for tests: a step that never returns in time
            time.sleep(float(msg["hang"]))
        plan = msg["plan"]
        self.sched.plan = ([self.ids[r] for r in msg.get("preempt", ())],
                           [(self.ids[r], n, nc, nt) for r, n, nc, nt in plan])
        if self.speed is not None:
            self.speed.sample()
        self.exec_s = [0.0, 0.0]
        ru0 = resource.getrusage(resource.RUSAGE_THREAD)
        if not self.gc_in_step:
            gc.disable()
        try:
            c0, th0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
            outs = self.engine.step()
            # read in the reverse order of the starts: the thread's interval nests in the process's, so its CPU
            # time never exceeds the process's
            dt, thread_cpu = time.perf_counter() - t0, time.thread_time() - th0
            proc_cpu = time.process_time() - c0
        finally:
            self.sched.plan = None
            if not self.gc_in_step:
                gc.enable()
        ru1 = resource.getrusage(resource.RUSAGE_THREAD)
        speed, ref = 1.0, None
        speed_ops = 1.0
        if self.speed is not None:  # bracket the step: one sample before, one after
            self.speed.sample()
            self.ops.sample()
            speed, ref = self.speed.factor(), (self.speed.recent[-2], self.speed.recent[-1], self.speed.unit())
            speed_ops = self.ops.factor()
        rev = {v: k for k, v in self.ids.items()}
        executed = {rev[i]: n for i, n in self.sched.executed.items()}
        finished = [int(o.request_id) for o in outs if o.finished]
        for r in finished:
            self.ids.pop(r, None)
        reqs = self.sched.requests
        state = {r: (reqs[self.ids[r]].num_computed_tokens, reqs[self.ids[r]].num_tokens)
                 for r, *_ in plan if r in self.ids}
        # one engine thread: its own CPU time; the process's adds other threads' stray work (vLLM's and gloo's
        # helper threads) that lands in random steps and would not lengthen the step on a dedicated machine
        cpu = thread_cpu if self.thread_clock else proc_cpu
        return {"ok": True, "time_s": dt, "cpu_s": cpu, "process_cpu_s": proc_cpu, "exec_s": self.exec_s[0],
                "minflt": ru1.ru_minflt - ru0.ru_minflt, "nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw,
                "exec_cpu_s": self.exec_s[1], "speed": speed, "speed_ops": speed_ops, "ref_s": ref,
                "finished": finished,
                "state": state, "executed": executed,
                "free_blocks": self.sched.kv_cache_manager.block_pool.get_num_free_blocks()}


def serve(inp: Any, out: Any) -> None:
    worker: Worker | None = None
    while True:
        try:
            msg = read_msg(inp)
        except EOFError:
            return
        cmd = msg.get("cmd")
        try:
            if cmd == "init":
                worker = Worker(msg)
                reply = worker.info
            elif cmd == "step" and worker is not None:
                reply = worker.step(msg)
            elif cmd == "abort" and worker is not None:
                reply = worker.abort(msg)
            elif cmd == "stop":
                write_msg(out, {"ok": True})
                return
            else:
                reply = {"ok": False, "error": f"unexpected command {cmd!r}"}
        except Exception:  # reported to the client, which raises EngineError with it
            reply = {"ok": False, "error": traceback.format_exc(limit=6)}
        write_msg(out, reply)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "tiny-model":
        kw = {k: int(v) for k, v in (a.split("=", 1) for a in argv[2:])}
        make_tiny_model(argv[1], **kw)
        return 0
    # the protocol owns the original stdout; everything printed from here on goes to stderr
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, proto_out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))

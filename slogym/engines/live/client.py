"""Handle on one live vLLM engine process (:class:`VLLMEngine`) and where to find a Python that has vLLM.

The engine runs in a child process (``worker.py``) so that a crash or a hung step can never take the caller down
or block it: every reply is awaited with a deadline, and a dead process, a timeout or an engine exception all
become an :class:`EngineError` naming what happened (with the tail of the engine's log). The child may run
under another Python (``SLOGYM_VLLM_PYTHON`` or a repo-local ``.venv-vllm``), so slogym's own environment
never needs vLLM installed.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from slogym.core.errors import EngineError
from slogym.engines.live import worker as _worker

WORKER = Path(_worker.__file__).resolve()
TIMINGS = ("wall", "cpu", "norm")
BATCH_KINDS = ("prefill", "decode", "mixed")


def batch_kind(prefill_tokens: int, decode_seqs: int) -> str:
    """``prefill`` (prefill-only), ``decode`` (decode-only) or ``mixed``, from a batch's features."""
    return "decode" if prefill_tokens == 0 else ("prefill" if decode_seqs == 0 else "mixed")
REPO_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@lru_cache(maxsize=None)
def find_vllm_python() -> str | None:
    """The first Python that has vLLM: ``$SLOGYM_VLLM_PYTHON``, this one, or ``<repo>/.venv-vllm`` (built and
    verified by ``make vllm-venv``)."""
    env = os.environ.get("SLOGYM_VLLM_PYTHON")
    for cand in ([env] if env else []) + [sys.executable]:
        if cand and Path(cand).exists() and _has_vllm(cand):
            return cand
    # the repo-local environment counts once 'make vllm-venv' has verified that vLLM imports there
    if (REPO_VENV.parents[1] / ".ok").exists() and _has_vllm(str(REPO_VENV)):
        return str(REPO_VENV)
    return None


def vllm_unavailable_reason() -> str | None:
    """None when a vLLM Python was found, else why not (for test skips and CLI errors)."""
    if find_vllm_python() is not None:
        return None
    return ("vLLM is not installed: no Python with vllm found ($SLOGYM_VLLM_PYTHON, this interpreter, "
            f"{REPO_VENV}); build it with 'make vllm-venv' or 'pip install slogym[vllm]'")


# make_tiny_model's architecture arguments -> the config.json keys they set (worker.make_tiny_model's defaults)
TINY_ARCH = {"hidden": ("hidden_size", 128), "layers": ("num_hidden_layers", 2), "heads": ("num_attention_heads", 4),
             "vocab": ("vocab_size", 512), "max_len": ("max_position_embeddings", 4096)}


def make_tiny_model(out_dir: str | Path, python: str | None = None, timeout: float = 300.0, **arch: int) -> Path:
    """Write a tiny random-weight Llama model to ``out_dir`` (no download); ``arch``: hidden, layers, heads,
    vocab, max_len, seed. Reuses an existing model directory when its ``config.json`` has this architecture and
    raises ``ValueError`` (naming the differences) when it has another; an unreadable ``config.json`` is an error
    too. Failures to build raise :class:`EngineError` with the builder's last error line."""
    out = Path(out_dir)
    unknown = set(arch) - set(TINY_ARCH) - {"seed"}
    if unknown:
        raise ValueError(f"make_tiny_model: unknown architecture arguments {sorted(unknown)}; expected "
                         f"{sorted(TINY_ARCH) + ['seed']}")
    if (out / "config.json").exists():
        try:
            have = json.loads((out / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{out}/config.json exists but cannot be read as a model config ({e})") from None
        diff = {key: (have.get(key), int(arch.get(name, default))) for name, (key, default) in TINY_ARCH.items()
                if have.get(key) != int(arch.get(name, default))}
        if diff:
            raise ValueError(f"{out} holds a model of another architecture (config.json vs asked: "
                             + ", ".join(f"{k} {a!r} vs {b}" for k, (a, b) in diff.items())
                             + "); remove it or choose another directory")
        return out
    py = python or find_vllm_python()
    if py is None:
        raise EngineError(vllm_unavailable_reason() or "no vLLM Python")
    cmd = [py, str(WORKER), "tiny-model", str(out)] + [f"{k}={int(v)}" for k, v in arch.items()]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EngineError(f"building the tiny model in {out} timed out after {timeout:g} s") from None
    if res.returncode != 0:
        last = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        raise EngineError(f"building the tiny model in {out} failed: {last[-1].strip() if last else 'no output'}")
    return out


def model_hidden(model: str | Path, default: int = 128) -> int:
    """The hidden size in a local model directory's ``config.json`` (``default`` when there is none)."""
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


@dataclass
class EngineConfig:
    """What the live engine is built with; ``num_blocks * block_size`` KV tokens (the pool the policy sees).

    block_size must be a multiple of 32 for vLLM's CPU attention. ``step_timeout`` bounds every engine step,
    ``init_timeout`` the start-up (import + model load), both in seconds. ``nice`` (negative needs root) sets
    the engine process's scheduling priority. ``timing`` is what an iteration's duration is: ``wall`` (the
    elapsed time of the engine step), ``cpu`` (the CPU time of the engine thread during the step with
    ``threads=1``, of the engine process otherwise -- on a shared, oversubscribed machine the time the step
    would take on a dedicated core, without the periods the OS ran other work) or ``norm`` (that CPU time scaled
    to the machine's quiet speed by a reference loop timed right before and after every step,
    :class:`~slogym.engines.live.worker.SpeedReference`: removes the slow drift of CPU time with other tenants'
    load; ``ref_reps`` passes of the kernel per sample, the factor from the geometric mean of the last
    ``ref_window`` samples -- this step's two and the previous step's; ~0.6 ms of extra wall time per step for
    hidden 256, not counted; ``ref_hidden``: the hidden size its GEMMs are shaped like, default the model's).
    ``norm_elasticity`` ``e`` and
    ``norm_preempt`` ``b`` (batch kind -> exponent; defaults 1 and 0 for every kind) make the ``norm`` time
    ``cpu_s * factor ** e * max(wall_s / cpu_s, 1) ** -b``: how strongly a kind's CPU time follows the
    reference kernel's speed, and what being descheduled inside the step adds to it (cache refills);
    :func:`slogym.engines.profiler.norm_exponents` fits both on repeated profile visits (docs/live_engine.md,
    "Speed elasticity").
    ``rt_priority`` > 0 runs the engine thread under the real-time policy ``SCHED_FIFO`` at that priority
    after start-up (needs root or ``CAP_SYS_NICE``; refused: ``EngineError``): no ordinary process can preempt
    it inside a step, which on the shared 2-core machine took the spread of identical steps from 3.7-5.0 to
    3.0-3.2 % (``norm``, load average 7-10; ``scripts/step_noise.py``, docs/live_engine.md "Scheduling the
    engine thread").
    It holds one core for as long as a step runs (the engine still blocks between steps; the kernel's RT
    throttling leaves others 5 % of that core in any case). ``gc_in_step=False`` disables Python's garbage
    collector inside the step (a diagnosis knob: no measurable effect). The worker raises oneDNN's primitive
    cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, default 8192 here, 1024 in oneDNN) so that a warmed-up engine keeps
    every GEMM shape it has seen.
    """

    model: str
    block_size: int = 32
    num_blocks: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    dtype: str = "float32"
    seed: int = 0
    threads: int = 1
    nice: int = 0
    timing: str = "wall"
    ref_hidden: int | None = None
    ref_reps: int = 1
    ref_window: int = 4
    norm_elasticity: dict[str, float] = field(default_factory=dict)
    norm_preempt: dict[str, float] = field(default_factory=dict)
    gc_in_step: bool = True
    rt_priority: int = 0
    step_timeout: float = 60.0
    init_timeout: float = 600.0
    python: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "threads", "ref_reps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}; must be >= 1")
        if self.max_model_len > self.num_blocks * self.block_size:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the KV pool "
                             f"({self.num_blocks} blocks x {self.block_size} tokens)")
        if not 0 <= int(self.rt_priority) <= 99:
            raise ValueError(f"EngineConfig.rt_priority={self.rt_priority!r}; must be 0 (normal scheduling) or a "
                             "SCHED_FIFO priority 1-99")
        if self.ref_window < 2:
            raise ValueError(f"EngineConfig.ref_window={self.ref_window!r}; must be >= 2 (a step's two samples)")
        for name, top in (("norm_elasticity", 2.0), ("norm_preempt", 1.0)):
            for kind, e in getattr(self, name).items():
                if kind not in BATCH_KINDS or not 0.0 <= float(e) <= top:
                    raise ValueError(f"EngineConfig.{name}[{kind!r}]={e!r}; kinds are {BATCH_KINDS}, "
                                     f"exponents in [0, {top:g}]")
        if self.timing not in TIMINGS:
            raise ValueError(f"EngineConfig.timing={self.timing!r}; expected one of {TIMINGS}")
        if not (self.step_timeout > 0 and self.init_timeout > 0):
            raise ValueError("step_timeout and init_timeout must be > 0")


class VLLMEngine:
    """One live vLLM engine in a child process, stepped with explicit batches.

    ``step(plan, add=, abort=, preempt=)`` runs one engine iteration whose batch is ``plan`` =
    ``[(request, tokens, computed_before, known_tokens), ...]`` and returns the worker's reply: ``time_s`` and
    ``cpu_s`` (wall and CPU time of ``LLMEngine.step()``), ``speed`` (the ``norm`` timing's quiet-speed factor,
    1.0 otherwise), ``executed`` (the batch vLLM ran), ``finished``
    (requests vLLM completed), ``state`` (computed/known tokens after the step). :meth:`duration` picks the
    configured timing. Any failure raises :class:`EngineError` and leaves the engine closed.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        py = config.python or find_vllm_python()
        if py is None:
            raise EngineError(vllm_unavailable_reason() or "no vLLM Python")
        self._log = tempfile.NamedTemporaryFile(prefix="slogym-vllm-", suffix=".log", delete=False)
        env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                            "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": str(config.threads),
                            "PYTHONNOUSERSITE": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8192"} | config.env
        env.pop("PYTHONPATH", None)  # the worker imports only vLLM; never the caller's packages
        self.proc = subprocess.Popen([py, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, cwd=tempfile.gettempdir())
        self.closed = False
        self.failed = False  # closed by an EngineError: the log is kept (the error names it)
        self.iterations = 0
        self.owner: Any = None  # the LiveSimulator run serving on this engine (set when its serving starts)
        cfg = {k: getattr(config, k) for k in ("model", "block_size", "num_blocks", "max_num_seqs",
                                               "max_num_batched_tokens", "max_model_len", "dtype", "seed",
                                               "threads", "nice", "timing", "ref_reps", "ref_window", "gc_in_step",
                                               "rt_priority")}
        cfg["ref_hidden"] = config.ref_hidden or model_hidden(config.model)
        self.info = self._call({"cmd": "init", **cfg}, config.init_timeout, "start-up")
        if int(self.info["num_blocks"]) != config.num_blocks:
            self.close()
            raise EngineError(f"engine has {self.info['num_blocks']} free KV blocks, asked for {config.num_blocks}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    # ---------------------------------------------------------------- protocol
    def _call(self, msg: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        if self.closed:
            raise EngineError(f"engine {what}: the engine is closed (it failed, was interrupted while a call was "
                              "out, or was shut down)")
        try:
            _worker.write_msg(self.proc.stdin, msg)
            reply = self._read(time.monotonic() + timeout, timeout, what)
        except EngineError:
            self._fail()
            raise
        except (OSError, ValueError) as e:  # broken pipe: the process is gone
            self._fail()
            raise EngineError(f"engine {what}: the engine process is gone ({e}){self._log_tail()}") from None
        except BaseException:
            # anything else while the request is out (KeyboardInterrupt, a signal handler's exception): the reply
            # may still arrive and would be read as the answer to the next call, so the engine cannot be reused
            self._fail(keep_log=False)
            raise
        if not reply.get("ok"):
            self._fail()
            raise EngineError(f"engine {what} failed: {reply.get('error', '?').strip()}")
        return reply

    def _read(self, deadline: float, timeout: float, what: str) -> dict[str, Any]:
        fd = self.proc.stdout.fileno()
        buf = b""
        need = _worker._HEADER.size
        header_done = False
        while True:
            while len(buf) < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"engine {what} timed out after {timeout:g} s (engine process "
                                      f"{self.proc.pid} killed){self._log_tail()}")
                ready, _, _ = select.select([fd], [], [], min(left, 1.0))
                if not ready:
                    continue
                chunk = os.read(fd, max(need - len(buf), 65536))
                if not chunk:
                    try:  # the pipe closes a moment before the process can be reaped
                        code = self.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = None
                    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    raise EngineError(f"engine {what}: the engine process {self.proc.pid} died ({how})"
                                      f"{self._log_tail()}")
                buf += chunk
            if header_done:
                return pickle.loads(buf[_worker._HEADER.size:need])
            need = _worker._HEADER.size + _worker._HEADER.unpack(buf[:_worker._HEADER.size])[0]
            header_done = True

    def _log_tail(self, n: int = 1500) -> str:
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if "Warning" not in ln and "WARNING" not in ln]
        tail = "\n".join(lines)[-n:].strip()
        return f"; engine log ({self._log.name}) ends:\n{tail}" if tail else ""

    # ---------------------------------------------------------------- API
    def step(self, plan: list[tuple[int, int, int, int]], add: list[tuple[int, int, int]] = (),
             abort: list[int] = (), preempt: list[int] = (), hang: float = 0.0) -> dict[str, Any]:
        msg = {"cmd": "step", "plan": list(plan), "add": list(add), "abort": list(abort),
               "preempt": list(preempt)}
        if hang:
            msg["hang"] = hang
        reply = self._call(msg, self.config.step_timeout, f"step {self.iterations}")
        self.iterations += 1
        return reply

    def duration(self, reply: dict[str, Any], kind: str = "decode") -> float:
        """The iteration time of a step reply under this engine's ``timing``; ``kind`` (:func:`batch_kind`)
        picks the ``norm`` timing's exponents (``EngineConfig.norm_elasticity`` / ``norm_preempt``)."""
        cfg = self.config
        wall, cpu = float(reply["time_s"]), float(reply["cpu_s"])
        if cfg.timing == "wall":
            return wall
        if cfg.timing == "cpu":
            return cpu
        b = cfg.norm_preempt.get(kind, 0.0)
        return (cpu * float(reply["speed"]) ** cfg.norm_elasticity.get(kind, 1.0)
                * (max(wall / cpu, 1.0) ** -b if b else 1.0))

    def abort(self, requests: list[int], everything: bool = False) -> int:
        """Abort ``requests`` (``everything``: every request the engine holds) without running a step, freeing
        their KV; returns the engine's free KV blocks afterwards."""
        reply = self._call({"cmd": "abort", "abort": list(requests), "all": bool(everything)},
                           self.config.step_timeout, "abort")
        return int(reply["free_blocks"])

    def _fail(self, keep_log: bool = True) -> None:
        """Close after a failure: kill the process, keep its log (the error names it) unless ``keep_log`` is
        false."""
        self.failed = keep_log
        self.close(force=True)

    def close(self, force: bool = False) -> None:
        """Stop the engine process (politely unless ``force``, then by kill); idempotent. The log file is removed
        unless the engine failed (:class:`EngineError` messages name it)."""
        if self.closed:
            return
        self.closed = True
        if not force and self.proc.poll() is None:
            try:
                _worker.write_msg(self.proc.stdin, {"cmd": "stop"})
                self.proc.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._log.close()
        if not self.failed:
            Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close()


"""Live vLLM backend: a real engine executes the batches a slogym policy decides (see docs/live_engine.md).

:class:`VLLMEngine` is one engine process stepped with explicit batches; :class:`LiveSimulator` runs the
simulator's event loop with every iteration executed (and timed) on it. Importing this package never imports
vLLM: the engine runs in a child process, possibly under another Python (:func:`find_vllm_python`).
"""

from slogym.core.errors import EngineError
from slogym.engines.live.client import (EngineConfig, VLLMEngine, find_vllm_python, make_tiny_model,
                                        vllm_unavailable_reason)
from slogym.engines.live.simulator import CLOCKS, LiveSimulator, UnsupportedOnLiveEngine, live_spec

__all__ = ["CLOCKS", "EngineConfig", "EngineError", "LiveSimulator", "UnsupportedOnLiveEngine", "VLLMEngine",
           "find_vllm_python", "live_spec", "make_tiny_model", "vllm_unavailable_reason"]

"""slogym: Gymnasium environments and baselines for multi-SLO LLM serving."""

__version__ = "0.1.0"

from slogym.envs import register_envs as _register_envs  # noqa: E402

_register_envs()

"""slogym: Gymnasium environments and baselines for multi-SLO LLM serving."""

__version__ = "0.1.0"

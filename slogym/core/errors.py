"""Errors raised by the simulator core."""


class SlogymError(Exception):
    """Base class of slogym errors."""


class SchedulerError(SlogymError):
    """A policy returned an impossible decision (names the request, instance and what was wrong)."""


class EngineError(SlogymError):
    """The engine backend failed (exception, timeout, dead process)."""

"""Serving capacity: the highest request rate with attainment >= a threshold (SLOs-Serve's metric), by bisection.

Attainment falls with load, so the search first grows the rate until attainment drops below the threshold
(or a cap is hit), then bisects between the last passing and the first failing rate. A search is a small state
machine (:meth:`CapacitySearch.next_rate` / :meth:`CapacitySearch.update`) so the leaderboard can advance many
searches together, one batch of runs per round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CapacitySearch:
    start: float
    threshold: float = 0.9
    iters: int = 6
    max_expand: int = 4
    lo: float = 0.0
    hi: float | None = None
    history: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.start > 0:
            raise ValueError(f"start={self.start}; must be > 0")
        self._expanded = 0
        self._bisected = 0

    @property
    def done(self) -> bool:
        return self.hi is not None and self._bisected >= self.iters

    @property
    def capacity(self) -> float:
        """Highest rate known to meet the threshold (0 if none did)."""
        return self.lo

    def next_rate(self) -> float:
        if self.hi is None:
            return self.start * 2.0 ** self._expanded
        return (self.lo + self.hi) / 2.0

    def update(self, attainment: float) -> None:
        rate = self.next_rate()
        self.history.append((rate, attainment))
        ok = attainment >= self.threshold
        if self.hi is None:
            if ok:
                self.lo = rate
                self._expanded += 1
                if self._expanded > self.max_expand:  # never failed up to the cap: report the cap
                    self.hi = rate
                    self._bisected = self.iters
            else:
                self.hi = rate
            return
        if ok:
            self.lo = rate
        else:
            self.hi = rate
        self._bisected += 1


def bisect_capacity(attainment_at: Callable[[float], float], start: float, threshold: float = 0.9,
                    iters: int = 6, max_expand: int = 4) -> float:
    """Capacity of one system whose attainment at a rate is ``attainment_at(rate)``."""
    s = CapacitySearch(start, threshold, iters, max_expand)
    while not s.done:
        s.update(attainment_at(s.next_rate()))
    return s.capacity

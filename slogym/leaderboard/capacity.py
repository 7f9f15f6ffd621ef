"""Serving capacity: the highest request rate with attainment >= a threshold (SLOs-Serve's metric), by bisection.

Attainment falls with load, so the search first doubles the rate until attainment drops below the threshold,
then bisects between the last passing and the first failing rate. The doubling stops after ``max_expand``
doublings (rate ``start * 2**max_expand``): if that rate still passes, the capacity is reported as that rate and
marked censored ``"above"`` (a lower bound: the true capacity is at least it). If no rate passes (the start fails
and so does every bisection point down to ``start / 2**iters``), the capacity is reported as 0 and censored
``"below"`` (the true capacity is below :attr:`CapacitySearch.fail_rate`, the lowest rate tried). A search is a
small state machine (:meth:`CapacitySearch.next_rate` / :meth:`CapacitySearch.update`) so the leaderboard can
advance many searches together, one batch of runs per round.
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
        self._capped = False

    @property
    def done(self) -> bool:
        return self._capped or (self.hi is not None and self._bisected >= self.iters)

    @property
    def capacity(self) -> float:
        """Highest rate known to meet the threshold (0 if none did)."""
        return self.lo

    @property
    def fail_rate(self) -> float | None:
        """Lowest rate known to miss the threshold (None if none did)."""
        return self.hi

    @property
    def censored(self) -> str:
        """``"above"``: the top rate of the doubling passed, the capacity is a lower bound; ``"below"``: no rate
        passed, the capacity is below :attr:`fail_rate`; ``""``: bracketed by a passing and a failing rate."""
        if self._capped:
            return "above"
        if self.done and self.lo == 0.0:
            return "below"
        return ""

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
                if self._expanded > self.max_expand:  # never failed up to the cap: report the cap, censored
                    self._capped = True
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

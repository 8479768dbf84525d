"""The waiting queue's drain rate: how fast waiting sequences start, measured while some wait
(the scheduler observes it; admission reads it). Plain Python: no imports of the service."""
from __future__ import annotations

import math

# Seconds over which older observations fade (an exponential decay in wall time).
HORIZON_S = 60.0
# Backlogged seconds observed before the rate is trusted: a burst that has just filled the queue
# says nothing yet about how fast it drains.
MIN_OBSERVED_S = 5.0


class DrainRate:
    """Sequences started per second while some were waiting. Time in which none waited, or in
    which no executor could run them (`pause`), is not counted: an idle or recovering server
    must never look slow."""

    def __init__(self, horizon_s: float = HORIZON_S,
                 min_observed_s: float = MIN_OBSERVED_S) -> None:
        self.horizon_s = horizon_s
        self.min_observed_s = min_observed_s
        self._last: float | None = None
        self._backlogged = False  # whether sequences were left waiting at the last observation
        self._seconds = 0.0  # decayed backlogged seconds
        self._starts = 0.0  # decayed starts in them

    def observe(self, now: float, num_started: int, num_waiting: int) -> None:
        """After a scheduling pass: `num_started` sequences left the queue since the last
        observation, `num_waiting` still wait."""
        if self._last is not None:
            dt = max(now - self._last, 0.0)
            decay = math.exp(-dt / self.horizon_s)
            self._seconds *= decay
            self._starts *= decay
            if self._backlogged:
                self._seconds += dt
                self._starts += num_started
        self._last, self._backlogged = now, num_waiting > 0

    def pause(self) -> None:
        """The queue cannot drain until the next observation (the executor is lost)."""
        self._last = None

    def rate(self) -> float | None:
        """Starts per second, None until MIN_OBSERVED_S of backlog were seen. One start more
        than seen is assumed, so that a queue that has not moved yet is never taken as stuck
        for good."""
        if self._seconds < self.min_observed_s:
            return None
        return (self._starts + 1) / self._seconds

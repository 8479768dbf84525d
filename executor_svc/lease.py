"""The executor's lease: which scheduler's Execute stream owns the runner. Plain Python (no gRPC,
no torch): the servicer maps LeaseRefused to a status.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Hello:
    """The first message of an Execute stream: who asks, at which of its connects."""

    scheduler_id: str
    epoch: int
    takeover: bool = False


class LeaseRefused(Exception):
    """The hello is refused; the message says why, for the refused scheduler's operator."""


@dataclass(frozen=True)
class _Holder:
    hello: Hello
    generation: int
    since: float  # wall clock, for the refusal message
    is_alive: Callable[[], bool]
    supersede: Callable[[], None]


class Lease:
    """One scheduler at a time. `grant` gives the runner to a hello when no live stream holds it,
    when the holder's own scheduler reconnects (a higher epoch), or on an explicit takeover if
    takeovers are allowed (the executor authenticates its callers); it refuses everything else.
    Each grant has a new generation: the runner's state belongs to the current one only."""

    def __init__(self, allow_takeover: bool, clock: Callable[[], float] = time.time) -> None:
        self.allow_takeover = allow_takeover
        self._clock = clock
        self._lock = threading.Lock()
        self._holder: _Holder | None = None
        self._generation = 0

    def grant(self, hello: Hello, is_alive: Callable[[], bool],
              supersede: Callable[[], None]) -> int:
        """The new generation; raises LeaseRefused. `is_alive()` tells whether the new holder's
        stream is still open; `supersede()` is called (once) when a later grant replaces it."""
        with self._lock:
            old = self._holder
            if old is not None and old.is_alive():
                self._check_may_replace(old, hello)
            self._generation += 1
            generation = self._generation
            self._holder = _Holder(hello, generation, self._clock(), is_alive, supersede)
        if old is not None:
            old.supersede()
        return generation

    def _check_may_replace(self, holder: _Holder, hello: Hello) -> None:
        held = holder.hello
        if hello.scheduler_id == held.scheduler_id:
            if hello.epoch <= held.epoch:
                raise LeaseRefused(f"stale hello: scheduler {hello.scheduler_id} already holds "
                                   f"the lease at epoch {held.epoch} (this is epoch {hello.epoch})")
            return
        if hello.takeover and self.allow_takeover:
            return
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.since))
        reason = (f"executor is leased by another scheduler (id {held.scheduler_id}, since "
                  f"{since}); it is refused until that stream ends")
        if hello.takeover:
            reason += " (takeover needs an executor started with an auth token)"
        raise LeaseRefused(reason)

    def release(self, generation: int) -> None:
        """The stream of `generation` ended; a no-op if a later grant replaced it."""
        with self._lock:
            if self._holder is not None and self._holder.generation == generation:
                self._holder = None

    def is_current(self, generation: int) -> bool:
        with self._lock:
            return self._holder is not None and self._holder.generation == generation

    @property
    def holder(self) -> Hello | None:
        with self._lock:
            return None if self._holder is None else self._holder.hello

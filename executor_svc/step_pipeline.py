"""StepPipeline: one Execute stream's plans with up to `max_launched` steps launched and not
finished, so step N+1's host work overlaps step N's GPU work; results in step order. PlanReader
reads plans in a thread so a wait can time out. Plain Python: no gRPC, no torch.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator

_END = object()  # the plan stream ended
_READY = object()  # a watched step's GPU work is done


class StepFailed(Exception):
    """Launching or finishing step `step_id` raised `cause` (also chained as __cause__)."""

    def __init__(self, step_id: int, cause: BaseException) -> None:
        super().__init__(f"step {step_id} failed: {cause!r}")
        self.step_id = step_id
        self.cause = cause


class StepPipeline:
    """`launch(plan) -> pending` queues a step; `finish(pending) -> result` waits for it. A
    pending step has `step_id`, `is_ready()` (finish would not wait) and `wait()` (blocks until
    it is ready). Plans have `step_id`.

    max_launched bounds the steps launched and not finished (the executor's side); the
    scheduler's max_steps_in_flight bounds the plans it has sent and not had answered: a plan
    beyond max_launched waits here, unlaunched, until the oldest step finishes."""

    def __init__(self, launch: Callable, finish: Callable, max_launched: int = 2,
                 on_idle: Callable[[], None] | None = None, idle_after_s: float = 0.5) -> None:
        if max_launched < 1:
            raise ValueError(f"max_launched must be >= 1, got {max_launched}")
        self._launch, self._finish = launch, finish
        self.max_launched = max_launched
        # Called once each time no step is in flight and no plan has come for idle_after_s
        # (the executor then logs its step timing: the steps since the last periodic line
        # would otherwise go unreported at the end of a burst of work).
        self._on_idle, self._idle_after_s = on_idle, idle_after_s

    def run(self, plans: "Iterable | PlanReader") -> Iterator:
        """The results of the plans' steps, in order. A step that fails raises StepFailed, after
        the results of the steps launched before it; an error reading the plans, or one posted by
        PlanReader.interrupt, is raised as is.

        After launching a step, the next plan is launched before the step is finished if the
        step still runs (its plan queued, or arriving meanwhile); a step whose work is done is
        finished, and its result sent, before another is launched, and never waits for a plan
        (the scheduler may be waiting for it to plan). On the CPU backend, whose launch runs the
        whole forward, launching first would hold every result back by a second forward."""
        reader = plans if isinstance(plans, PlanReader) else PlanReader(plans)
        inbox = reader.inbox
        watcher = _Watcher(inbox)
        launched: deque = deque()
        try:
            while True:
                plan = self._next_plan(inbox, launched, watcher)
                if plan is _END:
                    return
                if plan is None:
                    yield self._call(self._finish, launched.popleft())
                    continue
                try:
                    launched.append(self._call(self._launch, plan))
                except StepFailed:
                    while launched:  # the steps launched before it still count
                        yield self._call(self._finish, launched.popleft())
                    raise
        finally:
            watcher.stop()

    def _next_plan(self, inbox: queue.SimpleQueue, launched: deque, watcher: "_Watcher"):
        """The next plan to launch; None to finish the oldest step first; _END when done."""
        ended = False
        while True:
            if ended or len(launched) >= self.max_launched:
                return None if launched else _END
            if launched and launched[0].is_ready():
                return None
            item = _poll(inbox)
            if item is None:
                if launched:
                    watcher.watch(launched[0])
                item = self._wait(inbox, idle=not launched)
            if item is _END:
                ended = True
                inbox.put(_END)  # stays the last item: later calls see it again
            elif isinstance(item, BaseException):
                raise item
            elif item is not _READY:
                return item

    def _wait(self, inbox: queue.SimpleQueue, idle: bool):
        if not idle or self._on_idle is None:
            return inbox.get()
        try:
            return inbox.get(timeout=self._idle_after_s)
        except queue.Empty:
            self._on_idle()
            return inbox.get()

    @staticmethod
    def _call(fn: Callable, arg):
        try:
            return fn(arg)
        except Exception as err:
            raise StepFailed(arg.step_id, err) from err


class PlanReader:
    """Moves a stream's plans to `inbox` in a background thread as they arrive, then _END or the
    stream's error. The consumer (StepPipeline.run, or `first`) waits on the inbox alone, so its
    wait can have a timeout and another thread can end it with `interrupt`."""

    def __init__(self, plans: Iterable) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_read, args=(iter(plans), self.inbox), name="plan-reader",
                         daemon=True).start()

    def first(self, timeout: float):
        """The stream's first plan, or None if it ended without one. Raises TimeoutError when
        none came within `timeout` seconds, the stream's error, or what `interrupt` posted."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no plan within {timeout}s") from None
        if isinstance(item, BaseException):
            raise item
        if item is _END:
            self.inbox.put(_END)  # a later run() sees the end too
            return None
        return item

    def interrupt(self, err: BaseException) -> None:
        """The consumer raises `err` at its next wait for a plan (now, if it is waiting)."""
        self.inbox.put(err)


def _read(plans: Iterator, inbox: queue.SimpleQueue) -> None:
    """Moves plans from the stream to the inbox as they arrive, then _END or the error."""
    try:
        for plan in plans:
            inbox.put(plan)
        inbox.put(_END)
    except BaseException as err:  # the stream broke (cancelled, reset): the loop raises it
        inbox.put(err)


def _poll(inbox: queue.SimpleQueue):
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


class _Watcher:
    """Waits in a background thread for a step's GPU work to end, then posts _READY to the inbox,
    so the loop can wait for "a plan arrived or the oldest step is done" on one queue."""

    def __init__(self, inbox: queue.SimpleQueue) -> None:
        self._inbox = inbox
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._watched = None

    def watch(self, pending) -> None:
        if pending is self._watched:
            return
        self._watched = pending
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="step-watcher", daemon=True)
            self._thread.start()
        self._todo.put(pending)

    def _run(self) -> None:
        while (pending := self._todo.get()) is not None:
            try:
                pending.wait()
            except Exception:  # finish() raises it again, on the loop's thread
                pass
            self._inbox.put(_READY)

    def stop(self) -> None:
        if self._thread is not None:
            self._todo.put(None)

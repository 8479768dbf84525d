"""Several engine requests of one API request (n samples, a batch of prompts) as one stream of
(choice index, event). Closing it aborts every request still running. Plain asyncio.

Until the block manager can fork a sequence (parallel sampling on shared pages), each sample is an
independent engine request; this is the one place that knows.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from scheduler_svc.request import FinishEvent, GenerateSpec, TokenEvent


class Fanout:
    """One task per engine request pumps its events into a shared queue. A request that fails
    (refused at admission, or ended by the engine) ends the whole stream with its error."""

    def __init__(self, engine, specs: list[GenerateSpec]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[int, TokenEvent | FinishEvent]] = []
        self._num_open = len(specs)
        self._tasks = [asyncio.create_task(self._pump(i, engine, spec), name=f"fanout-{i}")
                       for i, spec in enumerate(specs)]

    @property
    def num_choices(self) -> int:
        return len(self._tasks)

    async def _pump(self, index: int, engine, spec: GenerateSpec) -> None:
        try:
            async for event in engine.generate(spec):
                self._queue.put_nowait((index, event))
        except Exception as err:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait((index, err))

    async def started(self) -> None:
        """Returns once every request was admitted and produced its first event; raises the
        first error instead (the caller then closes the fanout, aborting the others)."""
        seen: set[int] = set()
        while len(seen) < len(self._tasks):
            index, event = await self._next()
            self._buffer.append((index, event))
            seen.add(index)

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent | FinishEvent]]:
        """Every event, in arrival order, until each request has finished."""
        buffered, self._buffer = self._buffer, []
        for item in buffered:
            yield item
        while self._num_open:
            yield await self._next()

    async def _next(self) -> tuple[int, TokenEvent | FinishEvent]:
        index, event = await self._queue.get()
        if isinstance(event, Exception):
            raise event
        if isinstance(event, FinishEvent):
            self._num_open -= 1
        return index, event

    def cancel(self) -> None:
        """Aborts the requests still running (their engine streams are closed); no await, so
        it holds inside a cancelled task too."""
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Aborts the requests still running and waits until they are gone."""
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

"""Several engine requests of one API request (a batch of prompts, each with its n samples) as
one stream of (choice index, event). Closing it aborts every request still running. Plain asyncio.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from scheduler_svc.request import FinishEvent, GenerateSpec, TokenEvent


class Fanout:
    """One task per engine request pumps its events into a shared queue. A request that fails
    (refused at admission, or ended by the engine) ends the whole stream with its error. Spec k's
    sample i is choice (the n of the specs before k, added up) + i."""

    def __init__(self, engine, specs: list[GenerateSpec]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[int, TokenEvent | FinishEvent]] = []
        self._num_choices = sum(spec.n for spec in specs)
        self._num_open = self._num_choices
        firsts = [sum(spec.n for spec in specs[:k]) for k in range(len(specs))]
        self._tasks = [asyncio.create_task(self._pump(first, engine, spec),
                                           name=f"fanout-{first}")
                       for first, spec in zip(firsts, specs)]

    @property
    def num_choices(self) -> int:
        return self._num_choices

    async def _pump(self, first: int, engine, spec: GenerateSpec) -> None:
        try:
            async for event in engine.generate(spec):
                self._queue.put_nowait((first + event.sample_index, event))
        except Exception as err:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait((first, err))

    async def started(self) -> None:
        """Returns once every choice (every sample of every request) produced its first event;
        raises the first error instead (the caller then closes the fanout, aborting the others)."""
        seen: set[int] = set()
        while len(seen) < self._num_choices:
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

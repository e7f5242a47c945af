"""Several async streams read at once as one: `(index, item)` in the order items arrive.

Used where one client request fans out into several streams: a scheduler request's `n`
choices (scheduler_svc.frontend.choices). (The HTTP front end's several prompts open their
calls a few at a time instead: http_svc.streaming.) Each stream runs as its own task; the
first error any stream raises is raised to the reader (the other streams are then cancelled,
as they are when the reader stops early). Exits (GeneratorExit, cancellation) are not errors
of a stream.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    queue: asyncio.Queue[tuple[int, T | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
            queue.put_nowait((index, None))
        except Exception as exc:         # the stream's own failure: the reader raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

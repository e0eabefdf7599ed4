"""Several requests answered as one: a /v1/completions batch of prompts, each its own request in
the Engine. They succeed together or not at all: the first to fail cancels the others (which
aborts them in the Engine, as a client disconnect does), and so does the caller's cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from .openai_errors import APIError

T = TypeVar("T")
_END = object()  # a stream's last item in `merged`'s queue


async def all_or_none(work: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, in order; the first exception cancels the rest (awaited to their end, so
    their requests are aborted before this raises)."""
    if len(work) == 1:
        return [await work[0]]
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) of every stream, as each comes. A stream's exception is raised here
    once its earlier items are out; leaving (or failing) closes every stream. The queue holds
    one item per stream: a stream whose items wait is not read further, so its request's
    deltas merge in the SDK meanwhile, as one stream's do when its reader is slow."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - raised again by the reader, in its order
            await queue.put((index, _END, exc))
            return
        await queue.put((index, _END, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def in_batch(exc: APIError, index: int, count: int) -> APIError:
    """`exc` of prompt `index`, naming its place when the request held several prompts."""
    if count == 1:
        return exc
    return APIError(exc.status, f"prompt[{index}]: {exc.message}", exc.param, exc.code, exc.headers)

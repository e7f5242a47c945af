"""Several async streams read as one: every item, tagged with its stream, as they come; a
stream's error reaches the reader and stops the others; a reader that stops early cancels
them."""

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.merge_streams import merge_streams


async def ticks(name: str, count: int, delay: float, fail: bool = False,
                closed: list[str] | None = None) -> AsyncIterator[str]:
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
        if fail:
            raise ValueError(f"{name} failed")
    finally:
        if closed is not None:
            closed.append(name)


def test_every_item_of_every_stream_in_arrival_order() -> None:
    async def run() -> list[tuple[int, str]]:
        return [x async for x in merge_streams([ticks("a", 3, 0.01), ticks("b", 2, 0.025)])]

    got = asyncio.run(run())
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert got[0] == (0, "a0")                   # the faster stream's first item first


def test_an_error_reaches_the_reader_and_stops_the_others() -> None:
    closed: list[str] = []

    async def run() -> list[tuple[int, str]]:
        seen = []
        with pytest.raises(ValueError, match="b failed"):
            async for x in merge_streams([ticks("a", 100, 0.01, closed=closed),
                                          ticks("b", 1, 0.005, fail=True, closed=closed)]):
                seen.append(x)
        return seen

    seen = asyncio.run(run())
    assert (1, "b0") in seen and len(seen) < 100
    assert sorted(closed) == ["a", "b"]          # the long stream was cancelled


def test_a_reader_that_stops_early_cancels_every_stream() -> None:
    closed: list[str] = []

    async def run() -> None:
        merged = merge_streams([ticks("a", 100, 0.01, closed=closed),
                                ticks("b", 100, 0.01, closed=closed)])
        async for _ in merged:
            break
        await merged.aclose()

    asyncio.run(run())
    assert sorted(closed) == ["a", "b"]

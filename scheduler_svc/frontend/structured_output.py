"""What a request's structured output asks for (a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar), checked at the API edge before anything is
compiled.

The servicer turns the gRPC `StructuredOutput` message into a `StructuredOutput` here
(`validate_structured_output`); scheduler_svc.frontend.grammar compiles it into a grammar with
xgrammar and keeps each request's grammar state. This module needs no grammar library, so
the request and validation modules can name the type without loading one.
"""

import enum
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Checked before anything is parsed or compiled. xgrammar's compile time grows about cubically
# with a schema's nesting (measured here: 32 nested objects 0.05 s, 100: 0.7 s, 400: 16 s), and
# with its size; within these an ordinary schema compiles in well under a second, far inside
# the compile budget (--max-grammar-compile-s, scheduler_svc.frontend.grammar_pool).
MAX_SCHEMA_BYTES = 64 << 10      # UTF-8 bytes of one JSON schema
MAX_SCHEMA_DEPTH = 64            # nesting of one JSON schema's objects and arrays (a property
                                 # schema nests two deep: 32 nested object schemas)
MAX_ENUM_ITEMS = 4096            # `enum` values (and `const`s) of one schema, all together
MAX_REGEX_BYTES = 16 << 10       # UTF-8 bytes of one regular expression
MAX_CHOICES = 1024               # strings of one choice list
MAX_CHOICE_BYTES = 64 << 10      # UTF-8 bytes of all choices together
MAX_GRAMMAR_BYTES = 64 << 10     # UTF-8 bytes of one EBNF grammar
FIELD = "structured_output"      # the request field; every message below starts with it


class OutputKind(enum.Enum):
    JSON_SCHEMA = "json_schema"    # JSON matching the schema
    JSON_OBJECT = "json_object"    # any JSON object
    REGEX = "regex"                # text the regular expression matches in full
    CHOICE = "choice"              # exactly one of the choices
    GRAMMAR = "grammar"            # a sentence of the EBNF (GBNF) grammar, from rule `root`


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One request's output constraint; compiled grammars are cached by this value."""

    kind: OutputKind
    text: str = ""                   # the schema (JSON text, normalized), regex or grammar
    choices: tuple[str, ...] = ()    # CHOICE only


class StructuredOutputError(ValueError):
    """A malformed constraint; the message starts with the field at fault."""


def _num_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def validate_structured_output(json_schema: str | None, json_object: bool, regex: str | None,
                               choices: Sequence[str], grammar: str | None = None,
                               ) -> StructuredOutput | None:
    """The constraint the client set (at most one of the five), or None for free text."""
    given = [name for name, value in (("json_schema", json_schema is not None),
                                      ("json_object", json_object),
                                      ("regex", regex is not None), ("choice", bool(choices)),
                                      ("grammar", grammar is not None))
             if value]
    if not given:
        return None
    if len(given) > 1:
        raise StructuredOutputError(f"{FIELD}: set at most one of json_schema, json_object, "
                                    f"regex, choice and grammar (got {' and '.join(given)})")
    if grammar is not None:
        if not grammar.strip():
            raise StructuredOutputError(f"{FIELD}.grammar must not be empty")
        if _num_bytes(grammar) > MAX_GRAMMAR_BYTES:
            raise StructuredOutputError(f"{FIELD}.grammar is longer than {MAX_GRAMMAR_BYTES} "
                                        "bytes")
        return StructuredOutput(OutputKind.GRAMMAR, grammar)
    if json_schema is not None:
        return StructuredOutput(OutputKind.JSON_SCHEMA, _schema_text(json_schema))
    if json_object:
        return StructuredOutput(OutputKind.JSON_OBJECT)
    if regex is not None:
        if not regex:
            raise StructuredOutputError(f"{FIELD}.regex must not be empty")
        if _num_bytes(regex) > MAX_REGEX_BYTES:
            raise StructuredOutputError(f"{FIELD}.regex is longer than {MAX_REGEX_BYTES} bytes")
        return StructuredOutput(OutputKind.REGEX, regex)
    if len(choices) > MAX_CHOICES:
        raise StructuredOutputError(f"{FIELD}.choice has {len(choices)} strings; at most "
                                    f"{MAX_CHOICES} are allowed")
    if sum(_num_bytes(c) for c in choices) > MAX_CHOICE_BYTES:
        raise StructuredOutputError(f"{FIELD}.choice is longer than {MAX_CHOICE_BYTES} bytes")
    return StructuredOutput(OutputKind.CHOICE, choices=tuple(choices))


def _schema_text(schema: str) -> str:
    """The schema as compact JSON text: the compiled grammars' cache key, so schemas that
    differ only in whitespace share one. Keys keep their order (it is the order the model
    writes the properties in)."""
    if _num_bytes(schema) > MAX_SCHEMA_BYTES:
        raise StructuredOutputError(f"{FIELD}.json_schema is longer than {MAX_SCHEMA_BYTES} "
                                    "bytes")
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(f"{FIELD}.json_schema nests {depth} deep; at most "
                                    f"{MAX_SCHEMA_DEPTH} levels of objects and arrays are "
                                    "allowed")
    try:
        parsed = json.loads(schema)
    except (ValueError, RecursionError) as exc:
        raise StructuredOutputError(f"{FIELD}.json_schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise StructuredOutputError(f"{FIELD}.json_schema must be a JSON object (a schema), "
                                    f"got {type(parsed).__name__}")
    num_items = num_enum_items(parsed)
    if num_items > MAX_ENUM_ITEMS:
        raise StructuredOutputError(f"{FIELD}.json_schema has {num_items} enum values; at most "
                                    f"{MAX_ENUM_ITEMS} are allowed")
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)


_TOKEN = re.compile(r'\\.|["\[\]{}]', re.DOTALL)   # an escape, a quote or a bracket


def json_depth(text: str) -> int:
    """How deep `text`'s objects and arrays nest, counted in one pass without parsing it (no
    recursion, so any depth is safe to measure); for text that is not JSON, a figure that
    json.loads then refuses anyway."""
    depth = deepest = 0
    in_string = False
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token == '"':
            in_string = not in_string
        elif in_string or len(token) == 2:
            continue
        elif token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def num_enum_items(schema: object) -> int:
    """Values listed in the schema's `enum` keywords, plus its `const`s, at any depth."""
    total, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            enum_values = node.get("enum")
            if isinstance(enum_values, list):
                total += len(enum_values)
            total += "const" in node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total

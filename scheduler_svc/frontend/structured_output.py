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
from collections.abc import Sequence
from dataclasses import dataclass

MAX_SCHEMA_BYTES = 256 << 10     # UTF-8 bytes of one JSON schema
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
    """The schema as compact JSON text (equal schemas share one compiled grammar)."""
    if _num_bytes(schema) > MAX_SCHEMA_BYTES:
        raise StructuredOutputError(f"{FIELD}.json_schema is longer than {MAX_SCHEMA_BYTES} "
                                    "bytes")
    try:
        parsed = json.loads(schema)
    except (ValueError, RecursionError) as exc:
        raise StructuredOutputError(f"{FIELD}.json_schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise StructuredOutputError(f"{FIELD}.json_schema must be a JSON object (a schema), "
                                    f"got {type(parsed).__name__}")
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)

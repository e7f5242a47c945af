"""Structured output parameters, as OpenAI's API and vLLM's OpenAI server take them, onto the
gRPC API's `StructuredOutput`: `response_format` (`{"type": "text"}`, `{"type":
"json_object"}`, or `{"type": "json_schema", "json_schema": {"name", "schema", ...}}`),
vLLM's `structured_outputs` (one of `json`, `regex`, `choice`, `grammar`, `json_object`; its
other keys are refused by name) and vLLM's older `guided_json` (a schema, as an object or as
JSON text), `guided_regex`, `guided_choice` and `guided_grammar` (an EBNF / GBNF grammar whose
start rule is `root`). At most one of them may constrain a request.

Only the shape is checked here; the scheduler compiles the grammar and refuses one it cannot
compile with INVALID_ARGUMENT, whose message starts with "structured_output": the front end's
400 then names the request field it came from (`Structured.param`).
"""

import json
from dataclasses import dataclass
from typing import Any

from http_svc.errors import bad_request
from http_svc.json_limits import json_text_longer_than
from http_svc.protocol import GenerationFields
from services.rpc.splitserve.v1 import generation_pb2 as pb

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_SCHEMA_BYTES = 64 << 10     # UTF-8 bytes of a JSON schema (as compact JSON text)


@dataclass(frozen=True, slots=True)
class Structured:
    """One request's output constraint: exactly one of the five is set."""

    param: str                       # the request field it came from, for error messages
    json_schema: str | None = None   # JSON text of the schema
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] = ()
    grammar: str | None = None       # EBNF text


def structured_output(request: GenerationFields) -> Structured | None:
    """The request's constraint, or None for free text; ApiError (400) naming the field for
    a malformed one or for more than one."""
    found = [s for s in (_response_format(request.response_format),
                         _structured_outputs(request.structured_outputs),
                         _guided_json(request.guided_json),
                         _guided_regex(request.guided_regex),
                         _guided_choice(request.guided_choice),
                         _guided_grammar(request.guided_grammar)) if s is not None]
    if len(found) > 1:
        raise bad_request(f"only one of response_format, structured_outputs, guided_json, "
                          f"guided_regex, guided_choice and guided_grammar may constrain the "
                          f"output (got {' and '.join(s.param for s in found)})", found[1].param)
    return found[0] if found else None


def param_of(structured: Structured | None) -> str | None:
    """The request field a constraint came from (None: none)."""
    return None if structured is None else structured.param


def to_pb(structured: Structured) -> pb.StructuredOutput:
    message = pb.StructuredOutput(json_object=structured.json_object,
                                  choice=list(structured.choice))
    if structured.json_schema is not None:
        message.json_schema = structured.json_schema
    if structured.regex is not None:
        message.regex = structured.regex
    if structured.grammar is not None:
        message.grammar = structured.grammar
    return message


def _response_format(value: dict[str, Any] | None) -> Structured | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format.type must be one of "
                          f"{', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                          "response_format.type")
    unknown = sorted(set(value) - {"type", "json_schema"})
    if unknown:
        raise bad_request(f"unknown field in response_format: {', '.join(unknown)}",
                          f"response_format.{unknown[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("response_format", json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request('response_format of type "json_schema" needs json_schema.schema, '
                          "a JSON schema object", "response_format.json_schema.schema")
    return Structured("response_format", json_schema=_schema_text(spec["schema"],
                                                                  "response_format"))


STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value: dict[str, Any] | None) -> Structured | None:
    """vLLM's `structured_outputs`: exactly one of its keys that this engine serves."""
    if value is None:
        return None
    param = "structured_outputs"
    unknown = sorted(k for k, v in value.items()
                     if k not in STRUCTURED_OUTPUTS_KEYS and v not in (None, False))
    if unknown:
        raise bad_request(f"{param}.{unknown[0]} is not supported; set one of "
                          f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}", f"{param}.{unknown[0]}")
    given = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(f"{param} must set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}"
                          f" (got {', '.join(given) or 'none'})", param)
    key = given[0]
    if key == "json_object":
        if value[key] is not True:
            raise bad_request(f"{param}.json_object must be true or false", f"{param}.{key}")
        return Structured(param, json_object=True)
    if key == "json":
        return _guided_json(value[key], f"{param}.json", param)
    if key == "regex":
        return _guided_regex(value[key], f"{param}.regex", param)
    if key == "grammar":
        return _guided_grammar(value[key], f"{param}.grammar", param)
    return _guided_choice(value[key], f"{param}.choice", param)


def _guided_json(value: Any, name: str = "guided_json",
                 param: str | None = None) -> Structured | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{name} is not valid JSON: {exc}", name) from None
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be a JSON schema object", name)
    return Structured(param or name, json_schema=_schema_text(value, param or name))


def _guided_regex(value: Any, name: str = "guided_regex",
                  param: str | None = None) -> Structured | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string", name)
    return Structured(param or name, regex=value)


def _guided_choice(value: Any, name: str = "guided_choice",
                   param: str | None = None) -> Structured | None:
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or not all(isinstance(c, str) for c in value)):
        raise bad_request(f"{name} must list at least one string", name)
    return Structured(param or name, choice=tuple(value))


def _guided_grammar(value: Any, name: str = "guided_grammar",
                    param: str | None = None) -> Structured | None:
    """An EBNF grammar's text; the scheduler parses it (a 400 naming `name` if it cannot)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{name} must be a non-empty string (an EBNF grammar)", name)
    return Structured(param or name, grammar=value)


def _schema_text(schema: dict[str, Any], param: str) -> str:
    """The schema as JSON text; a schema surely past MAX_SCHEMA_BYTES is refused before
    json.dumps spends the event loop's time on it (http_svc.json_limits). What passes is
    measured exactly by the caller (http_svc.sampling)."""
    if json_text_longer_than(schema, MAX_SCHEMA_BYTES):
        raise bad_request(f"{param}: its JSON schema is more than {MAX_SCHEMA_BYTES} bytes "
                          f"of UTF-8; at most {MAX_SCHEMA_BYTES} are taken", param)
    return json.dumps(schema)

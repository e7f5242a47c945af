"""Structured output in the front end: the constraint's checks (scheduler_svc.frontend.
structured_output) and grammars compiled with xgrammar against the default model's tokenizer,
cached, and serialized for the engine cores with the vocabulary they need (scheduler_svc.
frontend.grammar). The engine core's part (masks, advancing, finishing) is
tests/scheduler_svc/engine/test_grammar.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_svc.frontend.grammar import Grammars
from scheduler_svc.frontend.structured_output import (
    OutputKind,
    StructuredOutput,
    StructuredOutputError,
    validate_structured_output,
)

EOS = 2
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:  # type: ignore[no-untyped-def]
    # 7 ids more than the tokenizer has: a model whose logits are wider than its vocabulary.
    return Grammars(tokenizer, tokenizer.vocab_size + 7, (EOS,))


def test_at_most_one_constraint_and_sizes_are_checked() -> None:
    assert validate_structured_output(None, False, None, []) is None
    spec = validate_structured_output('{ "type" : "object" }', False, None, [])
    assert spec == StructuredOutput(OutputKind.JSON_SCHEMA, '{"type":"object"}')
    assert validate_structured_output(None, True, None, []).kind is OutputKind.JSON_OBJECT
    assert validate_structured_output(None, False, None, ["a", "b"]).choices == ("a", "b")
    assert validate_structured_output(None, False, None, [], 'root ::= "a"') == StructuredOutput(
        OutputKind.GRAMMAR, 'root ::= "a"')
    for args, error in [
        (('{"type": "object"}', False, "x+", []), "at most one of .* json_schema and regex"),
        ((None, False, "x+", [], 'root ::= "a"'), "at most one of .* regex and grammar"),
        ((None, False, None, [], " \n"), r"structured_output\.grammar must not be empty"),
        ((None, False, None, [], 'root ::= "a"' + " " * (64 << 10)),
         r"structured_output\.grammar is longer than 65536 bytes"),
        (("{not json", False, None, []), r"structured_output\.json_schema is not valid JSON"),
        (("[1, 2]", False, None, []), r"structured_output\.json_schema must be a JSON object"),
        (("{}" + " " * (256 << 10), False, None, []), "longer than"),
        ((None, False, "", []), r"structured_output\.regex must not be empty"),
        ((None, False, None, ["x"] * 1025), r"structured_output\.choice has 1025 strings"),
    ]:
        with pytest.raises(StructuredOutputError, match=error):
            validate_structured_output(*args)


def test_bad_constraints_do_not_compile_and_name_the_field(grammars: Grammars) -> None:
    with pytest.raises(StructuredOutputError,
                       match=r"^structured_output\.json_schema does not compile: .*bogus"):
        grammars.compile(StructuredOutput(OutputKind.JSON_SCHEMA, '{"type":"bogus"}'))
    with pytest.raises(StructuredOutputError, match=r"^structured_output\.regex does not compile"):
        grammars.compile(StructuredOutput(OutputKind.REGEX, "([a-"))
    for grammar, reason in (('root ::= "yes" |', "EBNF parser error"),
                            ('answer ::= "yes"', 'root rule with name "root" is not found')):
        with pytest.raises(StructuredOutputError,
                           match=rf"^structured_output\.grammar does not compile: .*{reason}"):
            grammars.compile(StructuredOutput(OutputKind.GRAMMAR, grammar))


def test_an_ebnf_grammar_compiles(grammars: Grammars) -> None:
    spec = StructuredOutput(OutputKind.GRAMMAR, 'root ::= answer\nanswer ::= "yes" | "no"')
    compiled = grammars.compile(spec)
    assert compiled.spec == spec and grammars.cached(spec) is compiled
    assert isinstance(json.loads(compiled.serialized), dict)


def test_grammars_are_compiled_once(grammars: Grammars) -> None:
    spec = StructuredOutput(OutputKind.JSON_SCHEMA, json.dumps(SCHEMA))
    assert grammars.cached(spec) is None
    first = grammars.compile(spec)
    assert grammars.cached(spec) is first and grammars.compile(spec) is first
    assert first.spec == spec


def test_a_grammar_and_its_vocabulary_are_xgrammars_json(grammars: Grammars) -> None:
    """What the engine cores deserialize (scheduler_svc.engine.grammar): the vocabulary is
    built with the first compiled grammar, padded to the logits' width, EOS its stop token."""
    compiled = grammars.compile(StructuredOutput(OutputKind.REGEX, "[0-9]+"))
    grammar = json.loads(compiled.serialized)
    vocabulary = json.loads(grammars.vocabulary())
    assert isinstance(grammar, dict) and isinstance(vocabulary, dict)
    assert vocabulary["vocab_size"] == grammars.vocab_size
    assert vocabulary["stop_token_ids"] == [EOS]


def test_a_tokenizer_wider_than_the_logits_is_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    narrow = Grammars(tokenizer, tokenizer.vocab_size - 1, (EOS,))
    with pytest.raises(StructuredOutputError, match="structured_output is not served"):
        narrow.compile(StructuredOutput(OutputKind.JSON_OBJECT))


def test_no_process_loads_the_grammar_library_at_start() -> None:
    # xgrammar brings torch and transformers (~2 s of every start, and their memory): only a
    # constrained request loads it, in the front end that compiles it and the engine core
    # that runs it.
    entries = ("scheduler_svc.__main__", "scheduler_svc.frontend.__main__",
               "scheduler_svc.engine.__main__")
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {entries!r}]; "
            "print(sorted(m for m in ('xgrammar', 'torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_without_the_grammar_library_a_constraint_is_a_clear_error(
        tokenizer, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The compile server (a process of its own) finds an xgrammar that fails to import.
    (tmp_path / "xgrammar.py").write_text("raise ImportError('no xgrammar here')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    fresh = Grammars(tokenizer, tokenizer.vocab_size, (EOS,))
    with pytest.raises(StructuredOutputError, match="not served here: .*no xgrammar here"):
        fresh.compile(StructuredOutput(OutputKind.REGEX, "[ab]+"))
    fresh.close()

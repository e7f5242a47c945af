"""scheduler_svc/frontend/generation_config.py: `--generation-config auto|vllm|DIR` read as
vLLM reads it, applied to the sampling fields a request leaves unset, through the front end's
`prepare` and from the scheduler's flags to its front ends."""

import asyncio
import json
from pathlib import Path

import pytest

from scheduler_svc.frontend.generation_config import (
    GenerationDefaults,
    load_generation_defaults,
)
from scheduler_svc.frontend.prompts import PromptInput
from scheduler_svc.frontend.validation import Limits, RawSampling
from tests.scheduler_svc.frontend.fakes import make_frontend

QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7,
             "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.05,
             "max_new_tokens": 100, "transformers_version": "4.51.0"}


def model_dir(tmp_path: Path, config: object, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_auto_reads_the_model_directorys(tmp_path: Path) -> None:
    defaults = load_generation_defaults("auto", model_dir(tmp_path, QWEN_LIKE))
    assert defaults == GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05,
                                          repetition_penalty=1.05, max_tokens=100)


def test_auto_with_a_gguf_or_no_file_has_none(tmp_path: Path, model_path: Path) -> None:
    assert load_generation_defaults("auto", model_path) == GenerationDefaults()
    (tmp_path / "bare").mkdir()
    assert load_generation_defaults("auto", tmp_path / "bare") == GenerationDefaults()


def test_vllm_ignores_the_file(tmp_path: Path) -> None:
    assert load_generation_defaults("vllm", model_dir(tmp_path, QWEN_LIKE)) == \
        GenerationDefaults()


def test_a_directory_replaces_the_models(tmp_path: Path, model_path: Path) -> None:
    other = model_dir(tmp_path, {"temperature": 0.3}, "other")
    assert load_generation_defaults(str(other), model_path) == GenerationDefaults(
        temperature=0.3)
    with pytest.raises(ValueError, match=r"--generation-config '.*nowhere': not auto, vllm "
                                         r"or a directory with a generation_config\.json"):
        load_generation_defaults(str(tmp_path / "nowhere"), model_path)


def test_transformers_defaults_are_no_setting(tmp_path: Path) -> None:
    """vLLM reads the file's difference from transformers' defaults: top_k 50 is not one."""
    config = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
    assert load_generation_defaults("auto", model_dir(tmp_path, config)) == GenerationDefaults()


@pytest.mark.parametrize("config, message", [
    ({"temperature": "hot"}, r"temperature = 'hot' is not a number"),
    ({"temperature": -1}, r"temperature = -1 is out of range"),
    ({"top_p": 0}, r"top_p = 0 is out of range"),
    ({"top_k": 2.5}, r"top_k = 2.5 is not an integer"),
    ({"min_p": 1.5}, r"min_p = 1.5 is out of range"),
    ({"repetition_penalty": 0}, r"repetition_penalty = 0 is out of range"),
    ({"max_new_tokens": 0}, r"max_new_tokens = 0 is out of range"),
    ({"max_new_tokens": True}, r"max_new_tokens = True is not an integer"),
    ([1, 2], r"not a JSON object"),
])
def test_bad_values_are_refused_naming_the_field(tmp_path: Path, config: object,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=r"generation_config\.json: " + message):
        load_generation_defaults("auto", model_dir(tmp_path, config))


def test_apply_fills_only_unset_fields() -> None:
    defaults = GenerationDefaults(temperature=0.7, top_k=20, min_p=0.05)
    raw = defaults.apply(RawSampling(temperature=0.0, top_p=0.9), room=1000)
    assert (raw.temperature, raw.top_p, raw.top_k, raw.min_p, raw.max_tokens) == (
        0.0, 0.9, 20, 0.05, None)
    assert GenerationDefaults().apply(RawSampling(), 10) == RawSampling()


def test_max_new_tokens_is_the_default_and_the_cap() -> None:
    defaults = GenerationDefaults(max_tokens=100)
    assert defaults.apply(RawSampling(), room=1000).max_tokens == 100
    assert defaults.apply(RawSampling(), room=30).max_tokens == 30
    assert defaults.apply(RawSampling(max_tokens=500), room=1000).max_tokens == 100
    assert defaults.apply(RawSampling(max_tokens=7), room=1000).max_tokens == 7


def test_prepare_uses_the_defaults(tokenizer) -> None:  # type: ignore[no-untyped-def]
    limits = Limits("m", tokenizer.vocab_size, 1024)
    frontend = make_frontend(tokenizer, limits, generation_defaults=GenerationDefaults(
        temperature=0.25, top_p=0.5, top_k=7, repetition_penalty=1.1, max_tokens=40))
    try:
        async def prepare(raw: RawSampling):  # type: ignore[no-untyped-def]
            return (await frontend.prepare("", "m", PromptInput(text="Hello"), raw)).sampling

        unset = asyncio.run(prepare(RawSampling()))
        assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty,
                unset.max_tokens) == (0.25, 0.5, 7, 1.1, 40)
        given = asyncio.run(prepare(RawSampling(temperature=0.0, top_k=-1, max_tokens=60)))
        assert (given.temperature, given.top_k, given.max_tokens) == (0.0, -1, 40)
    finally:
        frontend.close()


def test_flags_reach_the_front_ends() -> None:
    from scheduler_svc.__main__ import parse_args
    from scheduler_svc.cluster.wire import FrontendLaunch
    from services import cli
    from services.codec import Codec

    settings = parse_args(["--tokenizer", "/tok", "--generation-config", "vllm"])
    launch = FrontendLaunch(index=0, parent_pid=1, server=settings.server,
                            scheduler=settings.scheduler, served_name="m",
                            query_address="tcp://127.0.0.1:1")
    codec = Codec(FrontendLaunch)
    server = codec.decode(codec.encode(launch)).server
    assert (server.tokenizer_path, server.generation_config) == ("/tok", "vllm")
    assert parse_args([]).server.generation_config == "auto"
    forwarded = cli.forward_flags(["--tokenizer", "/tok", "--generation-config", "vllm"],
                                  cli.service_parsers())
    assert forwarded["scheduler_svc"] == ["--tokenizer", "/tok", "--generation-config", "vllm"]

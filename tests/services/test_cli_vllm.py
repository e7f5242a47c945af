"""vLLM's command line on `splitserve` (services.cli, services.serve_args,
services.config_file): `serve MODEL`, vLLM's flag names, `--config FILE` under the command
line, `--dtype half|float`, `--seed` passed to the scheduler, and `up --help` showing every
forwarded flag's help. Nothing is started: the parsed arguments and the processes' flags."""

import argparse
import re
from pathlib import Path

import pytest

from services import cli
from services.config_file import option_of
from services.flags import FlagParser
from services.launcher import ServiceProcesses
from services.service_flags import add_scheduler_flags


def parse(*argv: str) -> argparse.Namespace:
    return cli.parse_args(list(argv))


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse(*argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def scheduler(args: list[str]) -> argparse.Namespace:
    return add_scheduler_flags(FlagParser(environ={})).parse_args(args)


@pytest.mark.parametrize("argv", [
    ["serve", "/models/m.gguf"],
    ["serve", "/models/m.gguf", "--max-num-seqs", "8"],
    ["serve", "--max-num-seqs", "8", "/models/m.gguf"],      # a forwarded flag's value first
    ["serve", "--max-num-seqs=8", "-tp", "1", "/models/m.gguf", "--enforce-eager"],
    ["up", "--model", "/models/m.gguf"],
])
def test_serve_model_is_up_with_its_model(argv: list[str]) -> None:
    args = parse(*argv)
    assert args.model == "/models/m.gguf" and args.func is cli._up
    assert "/models/m.gguf" not in args.scheduler_args + args.worker_args


def test_serve_refuses_a_second_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert "'other' is no flag" in refused(capsys, "serve", "/models/m.gguf", "other")


@pytest.mark.parametrize(("flags", "tp", "pp"), [
    (["-tp", "2", "-pp", "3"], 2, 3),
    (["--tensor-parallel-size", "4", "--pipeline-parallel-size=2"], 4, 2),
    (["-tp=2"], 2, 1),
    (["--tp", "2", "--pp", "2"], 2, 2),
])
def test_vllms_parallel_sizes_shape_the_cluster(flags: list[str], tp: int, pp: int) -> None:
    spec = cli.cluster_spec(parse("serve", "m.gguf", *flags), num_gpus=0)
    assert (spec.tp, spec.pp, len(spec.worker_devices)) == (tp, pp, tp * pp)


def test_prefix_caching_in_vllms_words(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--no-prefix-caching" not in parse("serve", "m").scheduler_args
    assert "--no-prefix-caching" not in parse("serve", "m",
                                              "--enable-prefix-caching").scheduler_args
    off = parse("serve", "m", "--no-enable-prefix-caching").scheduler_args
    assert off.count("--no-prefix-caching") == 1 and scheduler(off).no_prefix_caching
    both = parse("up", "--no-prefix-caching", "--no-enable-prefix-caching").scheduler_args
    assert both.count("--no-prefix-caching") == 1
    assert "contradict" in refused(capsys, "up", "--no-prefix-caching",
                                   "--enable-prefix-caching")


def test_seed_goes_to_the_scheduler() -> None:
    args = parse("serve", "m", "--seed", "1234")
    assert scheduler(args.scheduler_args).seed == 1234
    assert scheduler([]).seed is None
    with pytest.raises(SystemExit):
        scheduler(["--seed", "-1"])


@pytest.mark.parametrize(("value", "dtype"), [("half", "float16"), ("float", "float32"),
                                              ("bfloat16", "bfloat16"), ("HALF", "float16")])
def test_vllms_dtype_names(value: str, dtype: str) -> None:
    assert scheduler(["--dtype", value]).dtype == dtype
    args = parse("serve", "m", "--dtype", value)
    assert scheduler(args.scheduler_args).dtype == dtype
    env = add_scheduler_flags(FlagParser(environ={"SPLITSERVE_DTYPE": value}))
    assert env.parse_args([]).dtype == dtype


def test_an_unknown_dtype_is_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--dtype" in refused(capsys, "serve", "m", "--dtype", "double")


CONFIG = """
model: /models/from-config.gguf
tensor_parallel_size: 2
--max-num-seqs: 8
max_num_batched_tokens: 512
enforce_eager: true
no-chunked-prefill: false
async_scheduling: false
dtype: half
api-key: [alpha, beta]
seed: 7
"""


def test_a_config_file_gives_its_flags(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    args = parse("up", "--config", str(config))
    assert args.model == "/models/from-config.gguf" and args.tp == 2
    sched = scheduler(args.scheduler_args)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.dtype, sched.seed) == (
        8, 512, "float16", 7)
    assert not sched.no_chunked_prefill and sched.async_scheduling is False
    assert tuple(sched.api_key) == ("alpha", "beta")
    assert "--enforce-eager" in args.worker_args
    workers = ServiceProcesses(cli.cluster_spec(args, num_gpus=0)).worker_args(0)
    assert "--enforce-eager" in workers


def test_the_command_line_wins_over_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    args = parse("serve", "/models/cli.gguf", "--config", str(config), "--max-num-seqs", "4",
                 "-tp", "1", "--api-key", "gamma")
    assert args.model == "/models/cli.gguf" and args.tp == 1
    sched = scheduler(args.scheduler_args)
    assert sched.max_num_seqs == 4 and tuple(sched.api_key) == ("gamma",)
    assert sched.max_num_batched_tokens == 512          # the file's, where the line is silent


@pytest.mark.parametrize(("text", "message"), [
    ("max_num_sequences: 8\n", "'max_num_sequences': no flag --max-num-sequences"),
    ("- --tp\n- 2\n", "expected a mapping of flag names to values, got a list"),
    ("enforce_eager: 1\n", "--enforce-eager is on or off: expected true or false"),
    ("max_num_seqs: [1, 2]\n", "--max-num-seqs takes one value, got a list"),
    ("max_num_seqs:\n", "expected a value for --max-num-seqs, got None"),
    ("tp: [\n", "not YAML"),
    ("config: other.yaml\n", "'config': a config file names no other"),
])
def test_a_bad_config_file_is_refused_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    err = refused(capsys, "serve", "m", f"--config={config}")
    assert f"--config {config}" in err and message in err


def test_a_missing_config_file_is_refused(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "up", "--config", str(tmp_path / "none.yaml"))
    assert "No such file" in err


def test_config_keys_name_flags_in_any_spelling() -> None:
    assert {option_of(k) for k in ("max_num_seqs", "--max-num-seqs", "max-num-seqs",
                                   " -max_num_seqs")} == {"--max-num-seqs"}


def _squashed(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("command", ["up", "serve"])
def test_help_shows_every_forwarded_flags_help(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(command, "--help")
    out = _squashed(capsys.readouterr().out)
    own = cli.add_up_flags(FlagParser(add_help=False)).flags
    missing = []
    for name, p in cli.service_parsers().items():
        for option, action in p.flags.items():
            if option in own or option in cli.SET_BY_LAUNCHER or not action.help:
                continue
            if _squashed(action.help) not in out or option not in out:
                missing.append(f"{name} {option}")
    assert not missing

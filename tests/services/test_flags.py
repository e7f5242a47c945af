"""The environment fallback of every flag: the command line wins over SPLITSERVE_<NAME>, which
wins over the declared default; an unset or empty variable is absent; a value that does not
convert is refused naming the variable."""

import argparse

import pytest

from services.flags import EnvValueError, FlagParser, env_default, parse_bool


def parser(environ: dict[str, str]) -> FlagParser:
    p = FlagParser(prog="svc", environ=environ)
    p.add_flag("--max-num-seqs", env="MAX_NUM_SEQS", type=int, default=256)
    p.add_flag("--no-prefix-caching", env="NO_PREFIX_CACHING", action="store_true")
    p.add_flag("--async-scheduling", env="ASYNC_SCHEDULING",
               action=argparse.BooleanOptionalAction)
    p.add_flag("--dtype", env="DTYPE", choices=["auto", "float32"], default="auto")
    p.add_flag("--no-quant-kernels", "--no-int4-kernels",
               env=("NO_QUANT_KERNELS", "NO_INT4_KERNELS"), action="store_true")
    p.add_flag("--step-timeout", type=float, default=120.0)
    return p


def test_flag_over_env_over_default() -> None:
    assert parser({}).parse_args([]).max_num_seqs == 256
    env = {"SPLITSERVE_MAX_NUM_SEQS": "8"}
    assert parser(env).parse_args([]).max_num_seqs == 8
    assert parser(env).parse_args(["--max-num-seqs", "4"]).max_num_seqs == 4
    assert parser({"SPLITSERVE_MAX_NUM_SEQS": ""}).parse_args([]).max_num_seqs == 256


def test_boolean_flags_take_the_usual_words() -> None:
    a = parser({}).parse_args([])
    assert a.no_prefix_caching is False and a.async_scheduling is None
    a = parser({"SPLITSERVE_NO_PREFIX_CACHING": "1", "SPLITSERVE_ASYNC_SCHEDULING": "0"}) \
        .parse_args([])
    assert a.no_prefix_caching is True and a.async_scheduling is False
    a = parser({"SPLITSERVE_ASYNC_SCHEDULING": "off"}).parse_args(["--async-scheduling"])
    assert a.async_scheduling is True
    for word in ("1", "true", "Yes", "ON"):
        assert parse_bool(word) is True
    for word in ("0", "false", "No", "off"):
        assert parse_bool(word) is False


def test_a_flag_with_two_variables_takes_the_first_set() -> None:
    assert parser({"SPLITSERVE_NO_INT4_KERNELS": "1"}).parse_args([]).no_quant_kernels
    assert not parser({"SPLITSERVE_NO_QUANT_KERNELS": "0", "SPLITSERVE_NO_INT4_KERNELS": "1"}) \
        .parse_args([]).no_quant_kernels


@pytest.mark.parametrize("var, text, message", [
    ("MAX_NUM_SEQS", "many", "SPLITSERVE_MAX_NUM_SEQS='many': invalid literal for int()"),
    ("NO_PREFIX_CACHING", "maybe", "SPLITSERVE_NO_PREFIX_CACHING='maybe': expected one of "
                                   "1/true/yes/on or 0/false/no/off"),
    ("DTYPE", "float64", "SPLITSERVE_DTYPE='float64': expected one of auto, float32"),
])
def test_a_bad_value_is_refused_naming_the_variable(var: str, text: str, message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser({f"SPLITSERVE_{var}": text})
    assert exit_info.value.code == 2
    assert f"svc: error: {message}" in capsys.readouterr().err


def test_env_default_alone() -> None:
    assert env_default("PORT", int, 50051, {}) == 50051
    assert env_default("PORT", int, 50051, {"SPLITSERVE_PORT": "7000"}) == 7000
    assert env_default("OVERLAP_STEPS", parse_bool, None, {}) is None
    with pytest.raises(EnvValueError, match=r"SPLITSERVE_PORT='x'"):
        env_default("PORT", int, 50051, {"SPLITSERVE_PORT": "x"})


def test_help_names_the_variable_and_parser_knows_its_flags() -> None:
    p = parser({})
    text = " ".join(p.format_help().split())
    assert "env SPLITSERVE_MAX_NUM_SEQS" in text
    assert "env SPLITSERVE_NO_QUANT_KERNELS or SPLITSERVE_NO_INT4_KERNELS" in text
    assert p.flags["--no-int4-kernels"] is p.flags["--no-quant-kernels"]
    assert p.flags["--no-async-scheduling"].nargs == 0
    assert "-h" not in p.flags


def test_settings_without_a_flag_read_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    p = parser({"SPLITSERVE_OVERLAP_STEPS": "1", "SPLITSERVE_CPU_KERNELS": "perhaps"})
    assert p.env("OVERLAP_STEPS", parse_bool, None) is True
    assert p.env("TEST_FAIL_REQUEST_PREFIX", str, None) is None
    with pytest.raises(SystemExit):
        p.env("CPU_KERNELS", parse_bool, True)
    assert "SPLITSERVE_CPU_KERNELS='perhaps'" in capsys.readouterr().err

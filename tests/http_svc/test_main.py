"""`python -m http_svc`'s configuration: flags, their SPLITSERVE_HTTP_* fallbacks (flag over
variable over default), and values refused at start."""

import pytest

from http_svc.__main__ import parse_config
from http_svc.config import HttpConfig


def test_defaults_are_the_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_HOST", "HTTP_PORT", "HTTP_SCHEDULER", "HTTP_MAX_BODY_BYTES",
                 "HTTP_DRAIN_TIMEOUT", "LOG_LEVEL"):
        monkeypatch.delenv(f"SPLITSERVE_{name}", raising=False)
    assert parse_config([]) == HttpConfig()
    assert HttpConfig().port == 8000


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_HTTP_SCHEDULER", "scheduler:50051")
    monkeypatch.setenv("SPLITSERVE_HTTP_PORT", "8100")
    monkeypatch.setenv("SPLITSERVE_LOG_LEVEL", "WARNING")
    config = parse_config(["--port", "8200", "--host", "0.0.0.0", "--max-body-bytes", "1024"])
    assert (config.scheduler_address, config.port, config.host, config.max_body_bytes,
            config.log_level) == ("scheduler:50051", 8200, "0.0.0.0", 1024, "warning")


@pytest.mark.parametrize("argv", [["--port", "0"], ["--port", "70000"],
                                  ["--max-body-bytes", "0"], ["--drain-timeout", "-1"],
                                  ["--log-level", "loud"]])
def test_bad_values_are_refused_at_start(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2


def test_tool_and_reasoning_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's names: --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser."""
    config = parse_config(["--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                           "--reasoning-parser", "qwen3"])
    assert (config.tool_call_parser, config.enable_auto_tool_choice,
            config.reasoning_parser) == ("hermes", True, "qwen3")
    monkeypatch.setenv("SPLITSERVE_HTTP_TOOL_CALL_PARSER", "mistral")
    monkeypatch.setenv("SPLITSERVE_HTTP_ENABLE_AUTO_TOOL_CHOICE", "true")
    config = parse_config([])
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("mistral", True)
    for argv in (["--tool-call-parser", "nope"], ["--reasoning-parser", "nope"]):
        with pytest.raises(SystemExit):
            parse_config(argv)
    monkeypatch.delenv("SPLITSERVE_HTTP_TOOL_CALL_PARSER")
    with pytest.raises(SystemExit):          # auto tool choice needs a parser to read calls
        parse_config(["--enable-auto-tool-choice"])

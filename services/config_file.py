"""`--config FILE` of `splitserve serve|up`, as vLLM's `--config` takes it: a YAML mapping of
flag names to values, turned into command-line arguments.

A key is a flag's name with or without its leading dashes, in dashes or underscores
(`max-num-seqs`, `max_num_seqs`, `--max-num-seqs`); an alias counts as its flag
(`tensor-parallel-size` is `--tp`). A value is a scalar (`--flag VALUE`), a list (the flag once
per item, for a repeatable flag), or, for an on/off flag, true or false (`--flag`, or nothing /
its `--no-` form). The command line wins: a flag given there drops the file's value for it.
Anything else (no mapping, a key no flag has, a value of the wrong kind) is a
`ConfigFileError` naming the file and the key.

Called by `services.cli.parse_args` with the flags of `up` and of every service it forwards to.
"""

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.api_keys import AppendKeys

# Actions that take their flag more than once (a YAML list gives each item).
REPEATABLE = (argparse._AppendAction, argparse._ExtendAction, AppendKeys)


class ConfigFileError(ValueError):
    """The config file cannot be read or holds something no flag takes; names what."""


def option_of(key: str) -> str:
    """The `--option` a config key names."""
    return "--" + key.strip().lstrip("-").replace("_", "-")


def split_config(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """`argv`'s `--config FILE` (or `--config=FILE`), if any, and the rest; the last one
    counts. A `--config` with no file is left in place (the parser says what is missing)."""
    path, rest = None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config="):
            path = arg.partition("=")[2]
        elif arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return path, rest


def load_config(path: str) -> dict[str, Any]:
    """The file's mapping (empty for an empty file)."""
    # Imported only when a file is given: `splitserve generate` never pays for it.
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: not YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values, "
                              f"got a {type(data).__name__}")
    return data


def config_args(path: str, flags: Mapping[str, argparse.Action],
                given: Sequence[str]) -> list[str]:
    """The arguments `path` stands for, to go before the command line's `given` ones:
    `flags` maps every option string the command takes to its action."""
    given_actions = {id(flags[option]) for option in _options(given) if option in flags}
    args: list[str] = []
    for key, value in load_config(path).items():
        if not isinstance(key, str) or not key.strip().lstrip("-"):
            raise ConfigFileError(f"--config {path}: {key!r} is not a flag name")
        option = option_of(key)
        action = flags.get(option)
        if action is None or option == "--config":
            raise ConfigFileError(f"--config {path}: {key!r}: no flag {option} (see --help)"
                                  if action is None else
                                  f"--config {path}: {key!r}: a config file names no other")
        if id(action) in given_actions:
            continue                                     # the command line wins
        args += _flag_args(action, value, f"--config {path}: {key!r}")
    return args


def _options(argv: Sequence[str]) -> list[str]:
    return [arg.partition("=")[0] for arg in argv if arg.startswith("-")]


def _flag_args(action: argparse.Action, value: Any, where: str) -> list[str]:
    option = action.option_strings[0]
    if action.nargs == 0:                                # an on/off flag
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: {option} is on or off: expected true or false, "
                                  f"got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [option if value else "--no-" + option[2:]]
        return [option] if value else []
    values = value if isinstance(value, list) else [value]
    if len(values) > 1 and not isinstance(action, REPEATABLE):
        raise ConfigFileError(f"{where}: {option} takes one value, got a list")
    args: list[str] = []
    for item in values:
        if isinstance(item, dict | list) or item is None:
            raise ConfigFileError(f"{where}: expected a value for {option}, got {item!r}")
        text = str(item).lower() if isinstance(item, bool) else str(item)
        args += [option, text]
    return args

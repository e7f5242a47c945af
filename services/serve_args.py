"""`splitserve serve|up`'s arguments in vLLM's spellings, rewritten into `up`'s own before it
parses them (services.cli): `serve MODEL` (the model positional, as `vllm serve` takes it)
becomes `--model MODEL`, a `--config FILE` becomes the flags it holds, before the command
line's (services.config_file), and vLLM's `--[no-]enable-prefix-caching` becomes the
scheduler's `--no-prefix-caching`. (`-tp`, `--tensor-parallel-size` and the like are plain
aliases of `up`'s flags; `--dtype half|float` is the scheduler flag's own.)
"""

import argparse
from collections.abc import Mapping, Sequence

from services.config_file import config_args, split_config

NO_PREFIX_CACHING = "--no-prefix-caching"


def serve_model(args: Sequence[str], flags: Mapping[str, argparse.Action]) -> list[str]:
    """`serve`'s arguments with its MODEL, the first that is neither a flag nor a flag's
    value, as `--model MODEL`. `flags`: every option the command takes, to its action (a
    flag none takes is left as it is, for the parser to refuse)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-") and arg != "-":
            option, equals, _ = arg.partition("=")
            action = flags.get(option)
            i += 2 if action is not None and action.nargs != 0 and not equals else 1
            continue
        return [*args[:i], "--model", arg, *args[i + 1:]]
    return list(args)


def expand_command(argv: Sequence[str], flags: Mapping[str, argparse.Action]) -> list[str]:
    """`argv` (`serve ...` or `up ...`) as `up` parses it: serve's MODEL as --model, and the
    --config file's flags before the command line's. ConfigFileError for a bad file."""
    command, rest = argv[0], list(argv[1:])
    if command == "serve":
        rest = serve_model(rest, flags)
    path, rest = split_config(rest)
    if path is not None:
        rest = [*config_args(path, flags, rest), *rest]
    return [command, *rest]


def prefix_caching(enabled: bool | None, scheduler_args: list[str]) -> list[str]:
    """The scheduler's flags with vLLM's --[no-]enable-prefix-caching (`enabled`; None: not
    given) in the scheduler's words; ValueError when the two contradict each other."""
    if enabled is None:
        return scheduler_args
    if enabled:
        if NO_PREFIX_CACHING in scheduler_args:
            raise ValueError("--enable-prefix-caching and --no-prefix-caching contradict "
                             "each other")
        return scheduler_args
    if NO_PREFIX_CACHING in scheduler_args:
        return scheduler_args
    return [*scheduler_args, NO_PREFIX_CACHING]

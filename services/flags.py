"""Command-line flags with `SPLITSERVE_*` environment fallbacks (for containers).

A flag's value comes from, first to last: the command line, its environment variable
`SPLITSERVE_<NAME>` (unset or empty counts as absent), its declared default. `env_default` is
the one place that reads such a variable; `FlagParser.add_flag` declares a flag with it, and
the parser also knows its flags by option string, which is how `splitserve up` tells which
service a flag it forwards belongs to. Who calls: each service's `__main__` and `services.cli`,
through the flag tables in `services.service_flags`.

A value that does not convert (`SPLITSERVE_MAX_NUM_SEQS=many`) is refused at start with a
message naming the variable, as a bad command-line value would be.
"""

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
D = TypeVar("D")

ENV_PREFIX = "SPLITSERVE_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
BOOLEAN_ACTIONS = ("store_true", "store_false", argparse.BooleanOptionalAction)


class EnvValueError(ValueError):
    """An environment variable's value is not one its flag accepts; the message names it."""


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off, any case."""
    if (word := text.strip().lower()) in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE)} or {'/'.join(FALSE)}")


def env_default(names: str | Sequence[str], convert: Callable[[str], T], default: D,
                environ: Mapping[str, str] | None = None,
                choices: Sequence[Any] | None = None) -> T | D:
    """The value of the first of `SPLITSERVE_<name>` for `names` that is set and not empty,
    converted (and checked against `choices`); `default` when none is. Raises EnvValueError
    naming the variable when its value does not convert."""
    environ = os.environ if environ is None else environ
    for name in (names,) if isinstance(names, str) else names:
        var = ENV_PREFIX + name
        if not (text := environ.get(var, "")):
            continue
        try:
            value = convert(text)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            reason = str(exc) or f"not a valid {getattr(convert, '__name__', 'value')}"
            raise EnvValueError(f"{var}={text!r}: {reason}") from None
        if choices is not None and value not in choices:
            raise EnvValueError(f"{var}={text!r}: expected one of "
                                f"{', '.join(map(str, choices))}")
        return value
    return default


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags may fall back to environment variables, and which keeps
    its flags by option string (`flags`). `environ` defaults to the process's environment;
    `{}` gives a parser that reads none (`splitserve up` checks the flags it forwards so)."""

    def __init__(self, *args: Any, environ: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environ = os.environ if environ is None else environ
        self.flags: dict[str, argparse.Action] = {}   # "--max-num-seqs" -> its action

    def add_flag(self, *option_strings: str, env: str | Sequence[str] | None = None,
                 **kwargs: Any) -> argparse.Action:
        """`add_argument`, with the default taken from `SPLITSERVE_<env>` when that is set
        (several names: the first one set); the help says which variable."""
        if env is not None:
            names = (env,) if isinstance(env, str) else tuple(env)
            convert = parse_bool if kwargs.get("action") in BOOLEAN_ACTIONS \
                else kwargs.get("type", str)
            default = kwargs.get("default", kwargs.get("action") == "store_false"
                                 if kwargs.get("action") in ("store_true", "store_false")
                                 else None)
            try:
                kwargs["default"] = env_default(names, convert, default, self.environ,
                                                kwargs.get("choices"))
            except EnvValueError as exc:
                self.error(str(exc))
            note = "env " + " or ".join(ENV_PREFIX + name for name in names)
            kwargs["help"] = f"{kwargs['help']}; {note}" if kwargs.get("help") else note
        action = self.add_argument(*option_strings, **kwargs)
        for option in action.option_strings:
            self.flags[option] = action
        return action

    def env(self, name: str, convert: Callable[[str], T], default: D) -> T | D:
        """A setting with no flag of its own (tests, an older switch), read like a flag's
        fallback: a bad value is this parser's error."""
        try:
            return env_default(name, convert, default, self.environ)
        except EnvValueError as exc:
            self.error(str(exc))

"""The model's default sampling settings (vLLM's `--generation-config`): the sampling fields of
a `generation_config.json`, used for requests that leave those fields unset.

`--generation-config auto` (the default) reads the model directory's generation_config.json (a
GGUF file has none, as in vLLM); `vllm` ignores it; a directory reads it from there. As vLLM
takes them: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and
`max_new_tokens` as max_tokens; a value equal to transformers' own default (say `top_k: 50`)
is no setting of the model's and is skipped, as vLLM skips it (it reads the file's difference
from transformers' defaults). max_new_tokens is the default max_tokens (at most what the
context leaves) and also caps a request's own, as vLLM's does.

Read once per front end (scheduler_svc.frontend.server); `Frontend.prepare` applies it to a
request's `RawSampling` once its prompt is tokenized.
"""

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scheduler_svc.frontend.validation import RawSampling
from services.wire import MAX_REPETITION_PENALTY

FILE_NAME = "generation_config.json"
AUTO, VLLM = "auto", "vllm"

# generation_config.json key -> (RawSampling field, transformers' default: not a setting).
_KEYS: dict[str, tuple[str, float | None]] = {
    "temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
    "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None)}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Each field: the model's default, None = the server's own."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The settings the model gives (for the start-up log)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def apply(self, raw: RawSampling, room: int) -> RawSampling:
        """`raw` with the model's defaults in its unset fields. `room`: the tokens the
        context leaves after the prompt (a default max_tokens never asks for more)."""
        changes: dict[str, object] = {
            name: value for name, value in self.as_dict().items()
            if name != "max_tokens" and getattr(raw, name) is None}
        if self.max_tokens is not None:
            changes["max_tokens"] = (min(self.max_tokens, room) if raw.max_tokens is None
                                     else min(raw.max_tokens, self.max_tokens))
        return dataclasses.replace(raw, **changes) if changes else raw  # type: ignore[arg-type]


def load_generation_defaults(option: str, model_path: str | Path) -> GenerationDefaults:
    """`option`: --generation-config's value. Raises ValueError naming the file and field."""
    if option == VLLM:
        return GenerationDefaults()
    if option == AUTO:
        model = Path(model_path)
        if not (model.is_dir() and (model / FILE_NAME).is_file()):
            return GenerationDefaults()
        return _read(model / FILE_NAME)
    directory = Path(option)
    if not (directory / FILE_NAME).is_file():
        raise ValueError(f"--generation-config {option!r}: not auto, vllm or a directory with "
                         f"a {FILE_NAME}")
    return _read(directory / FILE_NAME)


def _read(path: Path) -> GenerationDefaults:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    values: dict[str, float | int] = {}
    for key, (field, hf_default) in _KEYS.items():
        value = config.get(key)
        if value is None or value == hf_default:
            continue
        _check(path, key, value)
        values[field] = value
    return GenerationDefaults(**values)  # type: ignore[arg-type]


_IN_RANGE: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: math.isfinite(v) and v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= -1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: 0 < v <= MAX_REPETITION_PENALTY,
    "max_new_tokens": lambda v: v >= 1,
}


def _check(path: Path, key: str, value: object) -> None:
    """The ranges the request fields have (scheduler_svc.frontend.validation)."""
    integer = key in ("top_k", "max_new_tokens")
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{path}: {key} = {value!r} is not {kind}")
    if not _IN_RANGE[key](value):
        raise ValueError(f"{path}: {key} = {value!r} is out of range")

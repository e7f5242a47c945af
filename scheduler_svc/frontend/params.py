"""A client's request settings, validated (scheduler_svc.frontend.validation): sampling,
stops, the output's form. The front end keeps the text-side ones (stop strings, special
tokens, choices, the grammar's source) and sends the engine core the rest, the engine's own
`SamplingParams` it extends, in an `EngineRequest` (scheduler_svc.frontend.core)."""

from dataclasses import dataclass

from scheduler_svc.engine.request import SamplingParams as EngineSampling
from scheduler_svc.frontend.structured_output import StructuredOutput


@dataclass(frozen=True, slots=True)
class SamplingParams(EngineSampling):
    """Validated sampling and stop settings of one request: the engine core's (sampling and
    token-level stops, what the `EngineRequest` carries) and the text-side ones it keeps."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False   # a matched stop string stays in the text
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None   # a grammar the output must follow
    n: int = 1                        # choices of the request (scheduler_svc.frontend.choices)

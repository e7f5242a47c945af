"""A client's request settings, validated (scheduler_svc.frontend.validation): sampling,
stops, the output's form. The front end keeps the text-side ones (stop strings, special
tokens, choices, the grammar's source) and sends the engine core the rest in its
`EngineRequest` (`engine_request`)."""

from dataclasses import dataclass

from scheduler_svc.frontend.structured_output import StructuredOutput
from services.wire import SamplingSpec


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated sampling and stop settings of one request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None   # a grammar the output must follow
    n: int = 1                        # choices of the request (scheduler_svc.frontend.choices)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token id, bias), ids unique
    prompt_logprobs: int | None = None   # alternatives per prompt token; None: none asked

    def to_spec(self) -> SamplingSpec:
        """What the workers sample with."""
        return SamplingSpec(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            seed=self.seed, num_logprobs=self.logprobs, min_p=self.min_p,
                            presence_penalty=self.presence_penalty,
                            frequency_penalty=self.frequency_penalty,
                            repetition_penalty=self.repetition_penalty,
                            logit_bias=list(self.logit_bias),
                            num_prompt_logprobs=self.prompt_logprobs)

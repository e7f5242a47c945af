"""Token-level endings, checked by the engine core as each sampled token is appended: EOS, a
stop token id, the length (max_tokens or the context), all after `min_tokens` outputs, then a
grammar's completion (scheduler_svc.engine.grammar). Stop strings are the front end's (they
need text): it aborts the request when one matches.

Also the outputs those checks produce: `token_output` for a token that does not end the
request, `final_output` for the last one (with the request's ending and usage counts).
"""

from scheduler_svc.engine.request import FinishReason, Request, RequestOutput
from services.wire import TokenLogprobs


def token_ending(request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
    """Whether `request` ends with `token_id`, just appended: (reason, the stop token id when
    one of those ended it), or (None, None). A grammar advances by the token here."""
    sampling = request.sampling
    num_tokens = len(request.token_ids)
    if num_tokens - request.num_prompt_tokens >= sampling.min_tokens:
        if not sampling.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP, None
        if token_id in sampling.stop_token_ids:
            return FinishReason.STOP, token_id
    if num_tokens >= request.max_num_tokens:
        return FinishReason.LENGTH, None
    if request.grammar is not None and request.grammar.advance(token_id):
        return FinishReason.STOP, None          # the grammar is complete
    return None, None


def token_output(request: Request, token_id: int,
                 logprobs: TokenLogprobs | None) -> RequestOutput:
    """A running request's new token."""
    return RequestOutput(request.request_id, [token_id], [logprobs],
                         frontend=request.frontend, handle=request.handle)


def final_output(request: Request, token_ids: list[int],
                 logprobs: list[TokenLogprobs | None]) -> RequestOutput:
    """A finished request's last output: `token_ids`, its ending and its usage counts."""
    return RequestOutput(
        request.request_id, token_ids, logprobs, request.finish_reason,
        request.stop_reason, num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens or 0,
        num_store_loaded_tokens=request.num_store_loaded_tokens, timing=request.timing(),
        frontend=request.frontend, handle=request.handle)

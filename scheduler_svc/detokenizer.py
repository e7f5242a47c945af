"""Incremental detokenization, stop strings and the outputs built from them, per request.

Text is emitted only once the tokens decode to complete UTF-8 (a byte-level BPE token can hold
half a character: the decode then ends in U+FFFD and we wait for the next token). Decoding
re-reads a short window (`prefix_offset`..end) so each step costs O(window), not O(output).

Stop strings are checked only when the caller asks (the scheduler does once the request has
`min_tokens` outputs, as it does for EOS and stop token ids). A check finds stop strings that
end in the text added since the previous update; one may begin in older text, so a stop string
completed by the `min_tokens`-th token or later counts even if it began before (the deciding
token is the one that completes it, as for EOS), while one completed earlier is never matched
and stays in the text. A match ends the output: the matched string and anything after it are
never returned, and the caller finishes the request, so the text is cut only at the end and
always equals the decode of the output tokens up to the stop string. While a stop string could
still be completing, up to `len(longest stop) - 1` trailing characters are held back (that is
also the most a match can reach into text from before the check).
"""

from collections.abc import Sequence

from scheduler_svc.request import FinishReason, Request, RequestOutput
from scheduler_svc.tokenizer import TextTokenizer
from services.wire import TokenLogprobs

REPLACEMENT_CHAR = "\ufffd"
INITIAL_WINDOW = 6  # prompt tokens decoded as context so the first output token reads right


class IncrementalDetokenizer:
    __slots__ = ("_tokenizer", "_skip_special", "_prefix_offset", "_read_offset", "_stop",
                 "_max_stop_len", "text", "_num_emitted")

    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Window start and the end of what was already turned into text, as indices into the
        # request's full token list (prompt + outputs).
        self._read_offset = len(prompt_token_ids)
        self._prefix_offset = max(0, self._read_offset - INITIAL_WINDOW)
        self._stop = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self.text = ""           # output text so far (stop string excluded once matched)
        self._num_emitted = 0    # characters of `text` already handed to the client

    def update(self, token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Decode newly appended tokens (the request's full list). With `check_stop`, returns
        the matched stop string when one ends the output (the text is cut there and the caller
        must finish the request), else None."""
        window = token_ids[self._prefix_offset:]
        before = self._tokenizer.decode(token_ids[self._prefix_offset:self._read_offset],
                                        self._skip_special)
        after = self._tokenizer.decode(window, self._skip_special)
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return None  # nothing printable yet (special token skipped, or half a character)
        new_text = after[len(before):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(token_ids)
        num_old = len(self.text)
        self.text += new_text
        if not check_stop:
            return None
        # Only matches that end in the new text: one lying wholly in older text was completed
        # before stop strings were checked (before min_tokens) and must not end the output now.
        hits = [(at, stop) for stop in self._stop
                if (at := self.text.find(stop, max(0, num_old - len(stop) + 1))) != -1]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest match ends the output
        self.text = self.text[:at]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; holds back a possible stop-string prefix unless finished."""
        end = len(self.text)
        if not finished and self._max_stop_len > 1:
            end = max(self._num_emitted, end - (self._max_stop_len - 1))
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta


def stop_check(request: Request, token_id: int) -> tuple[FinishReason | None, str | int | None]:
    """Whether `request` ends with `token_id`, just appended: (reason, stop_reason), or
    (None, None). EOS, a stop token id, a stop string (the detokenizer finds it), the length."""
    sampling = request.sampling
    reason: FinishReason | None = None
    stop_reason: str | int | None = None
    past_min = request.num_output_tokens >= sampling.min_tokens
    if past_min and not sampling.ignore_eos and token_id in request.eos_token_ids:
        reason = FinishReason.STOP
    elif past_min and token_id in sampling.stop_token_ids:
        reason, stop_reason = FinishReason.STOP, token_id
    detok = request.detokenizer
    if isinstance(detok, IncrementalDetokenizer) and reason is None:
        # Stop strings are not even looked for before min_tokens: a match cuts the text,
        # which is only right when the request ends with it.
        matched = detok.update(request.token_ids, check_stop=past_min)
        if matched is not None:
            reason, stop_reason = FinishReason.STOP, matched
    if reason is None and request.num_tokens >= request.max_num_tokens:
        reason = FinishReason.LENGTH
    return reason, stop_reason


def token_output(request: Request, token_id: int,
                 logprobs: TokenLogprobs | None) -> RequestOutput:
    """What a running request's client gets for `token_id`: the token and the text it made
    printable (a possible stop string's start held back)."""
    detok = request.detokenizer
    text = detok.take_delta(False) if isinstance(detok, IncrementalDetokenizer) else ""
    return RequestOutput(request.request_id, [token_id], text, [logprobs])


def final_output(request: Request, token_ids: list[int],
                 logprobs: list[TokenLogprobs | None]) -> RequestOutput:
    """A finished request's last output: `token_ids`, the rest of its text, its ending and
    its usage counts."""
    detok = request.detokenizer
    text = detok.take_delta(True) if isinstance(detok, IncrementalDetokenizer) else ""
    return RequestOutput(
        request.request_id, token_ids, text, logprobs, request.finish_reason,
        request.stop_reason, num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens or 0,
        num_store_loaded_tokens=request.num_store_loaded_tokens)

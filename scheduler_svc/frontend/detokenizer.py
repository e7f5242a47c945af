"""Incremental detokenization and stop strings, per request, in the front end that owns it.

Each new token goes through the `tokenizers` library's streaming decoder (`DecodeStream`), which
turns it into the text it completes in constant time (a byte-level BPE token can hold half a
character: the decoder then waits for the next token), seeded with the prompt's last tokens so
the first output token reads as it would after the prompt.

Stop strings are checked only when the caller asks (once the request has `min_tokens` outputs,
as the engine core does for EOS and stop token ids). A check finds stop strings that end in the
text added by this token; one may begin in older text, so a stop string completed by the
`min_tokens`-th token or later counts even if it began before (the deciding token is the one
that completes it, as for EOS), while one completed earlier is never matched and stays in the
text. A match ends the output: anything after the matched string is never returned, nor is the
string itself unless the request keeps it (vLLM's `include_stop_str_in_output`), and the
caller finishes the request (aborting it on its engine core), so the text is cut only at the
end and always equals the decode of the output tokens up to (or through) the stop string. While a
stop string could still be completing, up to `len(longest stop) - 1` trailing characters are
held back (that is also the most a match can reach into text from before the check).
"""

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

INITIAL_WINDOW = 6  # prompt tokens the decoder starts from, so the first output reads right


class IncrementalDetokenizer:
    __slots__ = ("_tokenizer", "_stream", "_stop", "_max_stop_len", "text", "_num_emitted")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-INITIAL_WINDOW:]),
                                    skip_special_tokens=skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self.text = ""           # output text so far (cut at a matched stop string)
        self._num_emitted = 0    # characters of `text` already handed to the client

    def update(self, token_id: int, check_stop: bool = True,
               keep_stop: bool = False) -> str | None:
        """Decode one more output token. With `check_stop`, returns the matched stop string
        when one ends the output (the text is cut before it, or after it with `keep_stop`, and
        the caller must finish the request), else None."""
        new_text = self._stream.step(self._tokenizer, token_id)
        if not new_text:
            return None  # nothing printable yet (special token skipped, or half a character)
        num_old = len(self.text)
        self.text += new_text
        if not check_stop or not self._stop:
            return None
        # Only matches that end in the new text: one lying wholly in older text was completed
        # before stop strings were checked (before min_tokens) and must not end the output now.
        hits = [(at, stop) for stop in self._stop
                if (at := self.text.find(stop, max(0, num_old - len(stop) + 1))) != -1]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest match ends the output
        self.text = self.text[:at + len(stop) if keep_stop else at]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; holds back a possible stop-string prefix unless finished."""
        end = len(self.text)
        if not finished and self._max_stop_len > 1:
            end = max(self._num_emitted, end - (self._max_stop_len - 1))
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta

"""Structured output in the engine core: each constrained request's place in its grammar.

A front end compiles a request's constraint (scheduler_svc.frontend.grammar, off its event
loop, cached) and sends the compiled grammar as xgrammar's serialized JSON with the request,
after the tokenizer's vocabulary (`GrammarVocabulary`, once). The engine deserializes them
here, on its command reader's thread (a large grammar takes a while), and the request enters
the scheduler's queue only then: one waiting for its grammar holds no batch slot. The
scheduler then packs the allowed tokens of each step that samples for the request into
`StepInput.token_masks` and advances the state with the token that comes back; a grammar that
is complete finishes the request. A request with a grammar never has two tokens in flight
(scheduler_svc.engine.scheduler's `_schedulable`): a step's mask depends on the token before.

No text here: xgrammar's vocabulary comes from the front end, already built.
"""

import hashlib
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256          # deserialized grammars kept, least recently used dropped


class GrammarError(ValueError):
    """A grammar that cannot be used (no vocabulary yet, or malformed)."""


class GrammarBook:
    """The vocabulary and the grammars this engine has deserialized; thread-safe."""

    def __init__(self, vocab_size: int) -> None:
        """`vocab_size`: the model's logits width, the length of every mask."""
        self.vocab_size = vocab_size
        self._info: Any = None                   # xgrammar.TokenizerInfo, once sent
        self._info_digest = b""
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Any] = OrderedDict()

    def set_vocabulary(self, vocabulary: bytes) -> None:
        """The front end's `GrammarVocabulary` (the same from every front end of a model)."""
        digest = hashlib.sha256(vocabulary).digest()
        if digest == self._info_digest:
            return
        import xgrammar as xgr  # brought in by the first constrained request only

        try:
            info = xgr.TokenizerInfo.deserialize_json(vocabulary.decode())
        except (RuntimeError, UnicodeDecodeError) as exc:
            raise GrammarError(f"malformed grammar vocabulary: {exc}") from None
        with self._lock:
            self._info, self._info_digest = info, digest
            self._cache.clear()

    def state(self, grammar: bytes, output_token_ids: list[int]) -> "GrammarState":
        """A matcher for `grammar` (a compiled grammar's JSON) that has taken the outputs the
        request already has (a request moved off a lost replica)."""
        digest = hashlib.sha256(grammar).digest()
        with self._lock:
            compiled = self._cache.get(digest)
            info = self._info
            if compiled is not None:
                self._cache.move_to_end(digest)
        if compiled is None:
            if info is None:
                raise GrammarError("a request with a grammar came before the vocabulary")
            import xgrammar as xgr

            try:
                compiled = xgr.CompiledGrammar.deserialize_json(grammar.decode(), info)
            except (RuntimeError, UnicodeDecodeError) as exc:
                raise GrammarError(f"malformed compiled grammar: {exc}") from None
            with self._lock:
                self._cache[digest] = compiled
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        state = GrammarState(compiled, self.vocab_size)
        for token_id in output_token_ids:
            if state.advance(token_id):
                break
        return state


class GrammarState:
    """One request's place in its grammar; the engine's loop alone uses it."""

    __slots__ = ("_matcher", "_bitmask")

    def __init__(self, grammar: "xgr.CompiledGrammar", vocab_size: int) -> None:
        import xgrammar as xgr  # loaded already: the grammar was deserialized with it

        self._matcher = xgr.GrammarMatcher(grammar)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)   # [1, words] int32

    def next_token_mask(self) -> bytes:
        """The tokens allowed next, packed as `TokenMask.bitmask` (little-endian int32)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask.numpy().astype("<i4", copy=False).tobytes()

    def advance(self, token_id: int) -> bool:
        """Takes the sampled token; True when the request must end here: the grammar is
        complete (it took a stop token, or nothing may follow), or the token broke it (the
        mask was not applied: the output would no longer match)."""
        if not self._matcher.accept_token(token_id):
            log.error("sampled token %d is outside the grammar (its mask was not applied); "
                      "ending the request", token_id)
            return True
        return bool(self._matcher.is_terminated())

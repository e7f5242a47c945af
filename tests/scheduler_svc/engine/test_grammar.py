"""Structured output in the engine core: grammars the front end compiled and serialized
(scheduler_svc.frontend.grammar, against the default model's tokenizer) deserialized into each
request's grammar state (scheduler_svc.engine.grammar.GrammarBook), and the scheduler's part: a
mask for each constrained request that samples, never a constrained request ahead of its own
token under async scheduling, the grammar advanced by each token and the request finished when
the grammar is complete; only the last pipeline stage gets the masks."""

import numpy as np
import pytest

from scheduler_svc.engine.grammar import GrammarBook, GrammarError, GrammarState
from scheduler_svc.engine.request import FinishReason
from scheduler_svc.engine.transport import ZmqTransport
from scheduler_svc.frontend.grammar import Grammars
from scheduler_svc.frontend.structured_output import OutputKind, StructuredOutput
from services.channels import Receiver
from services.codec import Codec
from services.wire import FromWorker, StepInput, TokenMask, ToWorker
from tests.scheduler_svc.engine.common import EOS, add, make_scheduler, sample, scheduled, step


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:  # type: ignore[no-untyped-def]
    # 7 ids more than the tokenizer has: a model whose logits are wider than its vocabulary.
    return Grammars(tokenizer, tokenizer.vocab_size + 7, (EOS,))


@pytest.fixture(scope="module")
def book(grammars: Grammars) -> GrammarBook:
    """The engine core's side, given the front end's vocabulary (built by a first grammar)."""
    grammars.compile(StructuredOutput(OutputKind.JSON_OBJECT))
    book = GrammarBook(grammars.vocab_size)
    book.set_vocabulary(grammars.vocabulary())
    return book


def state(grammars: Grammars, book: GrammarBook, spec: StructuredOutput,
          output_token_ids: list[int] | None = None) -> GrammarState:
    """A request's grammar state, as the engine core builds it from an EngineRequest."""
    return book.state(grammars.compile(spec).serialized, output_token_ids or [])


def allowed(grammar: GrammarState, vocab_size: int) -> set[int]:
    words = np.frombuffer(grammar.next_token_mask(), dtype="<i4")
    assert len(words) == -(-vocab_size // 32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_the_mask_follows_the_grammar(grammars: Grammars, book: GrammarBook,
                                      tokenizer) -> None:  # type: ignore[no-untyped-def]
    grammar = state(grammars, book, StructuredOutput(OutputKind.CHOICE, choices=("yes", "no way")))
    vocab_size = grammars.vocab_size
    first = allowed(grammar, vocab_size)
    assert tokenizer.encode("yes")[0] in first and tokenizer.encode("no")[0] in first
    assert tokenizer.encode("maybe")[0] not in first
    assert EOS not in first and not first & set(range(tokenizer.vocab_size, vocab_size))
    for token_id in tokenizer.encode("no way"):
        assert grammar.advance(token_id) is False
    assert allowed(grammar, vocab_size) == {EOS}     # complete: only the stop token is left
    assert grammar.advance(EOS) is True


def test_a_moved_requests_grammar_goes_on_from_its_outputs(
        grammars: Grammars, book: GrammarBook, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A request moved off a lost replica arrives with the outputs its client has: its state
    has taken them (the mask is where the lost engine core left off)."""
    spec = StructuredOutput(OutputKind.CHOICE, choices=("yes", "no way"))
    grammar = state(grammars, book, spec, tokenizer.encode("no"))
    after_no = allowed(grammar, grammars.vocab_size)
    assert tokenizer.encode(" way")[0] in after_no
    assert not {tokenizer.encode("yes")[0], tokenizer.encode("no")[0], EOS} & after_no
    for token_id in tokenizer.encode(" way"):
        assert grammar.advance(token_id) is False
    assert allowed(grammar, grammars.vocab_size) == {EOS}
    # Outputs that completed it already: the rest is not taken, and the next token ends it.
    done = state(grammars, book, spec, [*tokenizer.encode("yes"), EOS, 99])
    assert done.advance(EOS) is True


def test_a_token_outside_the_grammar_ends_the_request(grammars: Grammars, book: GrammarBook,
                                                      tokenizer) -> None:  # type: ignore[no-untyped-def]
    grammar = state(grammars, book, StructuredOutput(OutputKind.REGEX, "[0-9]+"))
    assert grammar.advance(tokenizer.encode("abc")[0]) is True


def test_json_object_means_an_object(grammars: Grammars, book: GrammarBook,
                                     tokenizer) -> None:  # type: ignore[no-untyped-def]
    first = allowed(state(grammars, book, StructuredOutput(OutputKind.JSON_OBJECT)),
                    grammars.vocab_size)
    assert tokenizer.encode("{")[0] in first
    assert not {tokenizer.encode(t)[0] for t in ("[", "1", '"')} & first


def test_a_grammar_before_its_vocabulary_or_malformed_is_refused(grammars: Grammars) -> None:
    serialized = grammars.compile(StructuredOutput(OutputKind.REGEX, "[a-z]+")).serialized
    fresh = GrammarBook(grammars.vocab_size)
    with pytest.raises(GrammarError, match="came before the vocabulary"):
        fresh.state(serialized, [])
    with pytest.raises(GrammarError, match="malformed grammar vocabulary"):
        fresh.set_vocabulary(b"{not json")
    fresh.set_vocabulary(grammars.vocabulary())
    with pytest.raises(GrammarError, match="malformed compiled grammar"):
        fresh.state(b'{"not": "a grammar"}', [])
    assert fresh.state(serialized, []) is not None


def test_the_scheduler_masks_waits_for_the_token_and_finishes(
        grammars: Grammars, book: GrammarBook, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Async scheduling: a free request runs one step ahead of its token; the constrained one
    waits for its token each time, carries a mask in each step that samples for it, and ends
    with "stop" once its grammar takes EOS, even though its max_tokens were not reached."""
    sched, kv = make_scheduler(async_scheduling=True)
    free = add(sched, "free", list(range(6)), max_tokens=20)
    constrained = add(sched, "json", list(range(10, 16)), max_tokens=20)
    constrained.grammar = state(grammars, book, StructuredOutput(OutputKind.REGEX, "[0-9]{2}"))
    digits = tokenizer.encode("42")
    assert len(digits) == 2

    s1 = step(sched, kv)
    assert scheduled(s1) == {"free": 6, "json": 6}
    assert [m.request_id for m in s1.token_masks] == ["json"]
    assert len(s1.token_masks[0].bitmask) == -(-grammars.vocab_size // 32) * 4
    s2 = step(sched, kv)
    assert scheduled(s2) == {"free": 1}           # "json" waits for its first token
    assert s2.token_masks == []
    sched.update(sample(s1, {"free": 100, "json": digits[0]}))
    s3 = step(sched, kv)
    assert scheduled(s3) == {"free": 1, "json": 1}   # "free" one step ahead again
    assert [m.request_id for m in s3.token_masks] == ["json"]
    sched.update(sample(s2, {"free": 101}))
    sched.update(sample(s3, {"free": 102, "json": digits[1]}))
    s4 = step(sched, kv)
    assert scheduled(s4) == {"free": 1, "json": 1}
    mask = np.frombuffer(s4.token_masks[0].bitmask, dtype="<i4")
    assert mask[EOS // 32] >> (EOS % 32) & 1 and np.count_nonzero(mask) == 1   # EOS alone
    outs = sched.update(sample(s4, {"free": 103, "json": EOS}))
    final = next(o for o in outs if o.request_id == "json")
    assert final.finish_reason is FinishReason.STOP and final.num_output_tokens == 3
    assert "json" not in sched.requests and free.request_id in sched.requests


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(
        grammars: Grammars, book: GrammarBook, tokenizer) -> None:  # type: ignore[no-untyped-def]
    sched, kv = make_scheduler()
    request = add(sched, "r", list(range(6)), max_tokens=20, ignore_eos=True)
    request.grammar = state(grammars, book, StructuredOutput(OutputKind.CHOICE,
                                                             choices=("yes",)))
    (token,) = tokenizer.encode("yes")
    s1 = step(sched, kv)
    sched.update(sample(s1, {"r": token}))
    s2 = step(sched, kv)
    (out,) = sched.update(sample(s2, {"r": EOS}))
    assert out.finish_reason is FinishReason.STOP and out.new_token_ids == [EOS]


def test_only_the_last_stage_gets_the_masks(ctx) -> None:  # type: ignore[no-untyped-def]
    """PP 2 x TP 2: ranks 2 and 3 are the last stage; ranks 0 and 1 get the step without its
    masks (and everything else the same)."""
    codec = Codec(ToWorker)
    ranks = [Receiver(ctx, codec, "tcp://127.0.0.1:0") for _ in range(4)]
    outputs: Receiver[FromWorker] = Receiver(ctx, Codec(FromWorker), "tcp://127.0.0.1:0")
    transport = ZmqTransport(ctx, "tcp://127.0.0.1:1", [r.address for r in ranks], outputs,
                             tp_size=2)
    try:
        step_input = StepInput(7, [], [], ["gone"], [TokenMask("a", b"\x01\0\0\0")])
        transport.send_to_ranks(step_input)
        got = [r.recv(timeout_ms=5000) for r in ranks]
        assert got[2] == got[3] == step_input
        assert got[0] == got[1] == StepInput(7, [], [], ["gone"], [])
    finally:
        transport.close()
        for r in [*ranks, outputs]:
            r.close()


def test_no_mask_for_a_prefill_chunk_that_samples_nothing(grammars: Grammars,
                                                          book: GrammarBook) -> None:
    sched, kv = make_scheduler(max_num_batched_tokens=4)
    request = add(sched, "r", list(range(10)), max_tokens=5)
    request.grammar = state(grammars, book, StructuredOutput(OutputKind.REGEX, "[a-z]+"))
    chunks = []
    for _ in range(3):
        s = step(sched, kv)
        chunks.append((scheduled(s)["r"], [m.request_id for m in s.token_masks]))
        sched.update(sample(s, {"r": 100} if s.token_masks else {}))
    assert chunks == [(4, []), (4, []), (2, ["r"])]


def test_a_preempted_request_keeps_its_grammar_state(
        grammars: Grammars, book: GrammarBook, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Preemption by recompute keeps the tokens, so the grammar state goes on from them: every
    step that samples for the constrained request carries its mask, before and after, and the
    grammar completes exactly when its 11 digits and EOS are out."""
    (digit,) = tokenizer.encode("7")
    sched, kv = make_scheduler(num_blocks=9, prefix_caching=False, max_num_batched_tokens=64)
    add(sched, "a", list(range(12)), max_tokens=12)
    b = add(sched, "b", list(range(20, 32)), max_tokens=20)
    b.grammar = state(grammars, book, StructuredOutput(OutputKind.REGEX, "[0-9]{11}"))
    finals = {}
    for _ in range(60):
        s = step(sched, kv)
        if s is None:
            continue
        sampling = [rid for rid in scheduled(s) if sched.requests[rid].num_computed_tokens
                    == sched.requests[rid].num_tokens]
        assert sorted(m.request_id for m in s.token_masks) == sorted(
            r for r in sampling if r == "b")
        tokens = {rid: 3 if rid == "a" else digit if b.num_output_tokens < 11 else EOS
                  for rid in sampling}
        for out in sched.update(sample(s, tokens)):
            if out.finish_reason is not None:
                finals[out.request_id] = out
        if not sched.requests:
            break
    assert b.num_preemptions >= 1
    assert finals["b"].finish_reason is FinishReason.STOP
    assert b.output_token_ids == [digit] * 11 + [EOS]

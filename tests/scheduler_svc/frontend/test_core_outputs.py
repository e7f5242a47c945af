"""A request's outputs in the front end (`Frontend.take_outputs`): each engine core step message
turns into text for the client's stream, in order; a stop string ends the output (the matched
text and every token computed after it are never returned), aborts the request on its engine
core and waits for the engine core's ending to finish with its usage counts; stop strings count
from `min_tokens` on (the token that completes one decides, as for EOS)."""

import asyncio

import pytest

from scheduler_svc.engine.request import FinishReason
from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.prompts import PreparedRequest
from scheduler_svc.frontend.tokenizer import TextTokenizer
from services.wire import TokenLogprobs
from tests.scheduler_svc.frontend.fakes import (
    Client,
    FakeEngineLinks,
    cluster_state,
    finished,
    placement_of,
    replica,
    settle,
    step_message,
)

PROMPT = [5, 6]


async def generate(frontend: Frontend, links: FakeEngineLinks, tokens: list[int],
                   prompt: list[int] = PROMPT, num_cached_tokens: int = 0,
                   **sampling: object) -> Client:
    """Runs a request on replica 0, whose engine core samples `tokens` one per step (the last
    one ends it: max_tokens). It answers an abort with its ending, as an engine core does: its
    counts are its own (the tokens it computed)."""
    a = replica(0)
    frontend.take_state(cluster_state(a))
    client = Client(frontend, PreparedRequest("r", prompt, SamplingParams(
        max_tokens=len(tokens), **sampling)))  # type: ignore[arg-type]
    await settle()
    ((_, sent),) = links.requests()
    handle = sent.handle
    for i, token in enumerate(tokens, start=1):
        ending = [finished(handle, "length", len(prompt), i, num_cached_tokens=num_cached_tokens)]
        frontend.take_outputs(step_message(a, [(handle, token)], ending if i == len(tokens)
                                           else []))
        await settle()
        if links.aborts():
            frontend.take_outputs(step_message(a, finished=[finished(
                handle, "abort", len(prompt), i, num_cached_tokens=num_cached_tokens)]))
            break
    await asyncio.wait_for(client.task, 5)
    assert client.error is None
    return client


def test_tokens_are_detokenized_and_streamed_in_order(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    prompt = tokenizer.encode("Say something:")
    tokens = tokenizer.encode(" Voilà — naïve 🎉 emoji and 日本語 text, done.")
    client = asyncio.run(generate(frontend, links, tokens, prompt, num_cached_tokens=9))
    assert [o.new_token_ids for o in client.outputs] == [[t] for t in tokens]
    assert client.text == tokenizer.decode(tokens)
    # Half a character waits for the token that completes it.
    assert all("\ufffd" not in o.text for o in client.outputs)
    assert any(o.text == "" for o in client.outputs)
    last = client.last
    assert (last.finish_reason, last.stop_reason) == (FinishReason.LENGTH, None)
    assert (last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) == (
        len(prompt), len(tokens), 9)
    assert all(o.finish_reason is None for o in client.outputs[:-1])
    assert frontend.num_live == 0 and links.aborts() == []


def test_logprobs_and_a_stop_token_reach_the_client(frontend: Frontend,
                                                    links: FakeEngineLinks) -> None:
    a = replica(0)
    lp = TokenLogprobs(-0.25, [9, 10], [-0.25, -2.0])

    async def run() -> Client:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, PreparedRequest("r", PROMPT, SamplingParams(
            stop_token_ids=(77,), logprobs=2)))
        await settle()
        ((_, sent),) = links.requests()
        h = sent.handle
        frontend.take_outputs(step_message(a, [(h, 9)], logprobs={0: lp}))
        frontend.take_outputs(step_message(a, [(h, 77)], [finished(
            h, "stop", 2, 2, stop_token_id=77, num_store_loaded_tokens=1)], logprobs={0: lp}))
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert client.token_ids == [9, 77]
    assert [lp for o in client.outputs for lp in o.logprobs] == [lp, lp]
    assert (client.last.finish_reason, client.last.stop_reason) == (FinishReason.STOP, 77)
    assert client.last.num_store_loaded_tokens == 1


def test_outputs_of_other_front_ends_requests_or_outside_the_vocabulary_are_dropped(
        frontend: Frontend, links: FakeEngineLinks) -> None:
    a = replica(0)

    async def run() -> Client:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, PreparedRequest("r", PROMPT, SamplingParams()))
        await settle()
        ((_, sent),) = links.requests()
        h = sent.handle
        frontend.take_outputs(step_message(a, [(h + 100, 9)]))           # no such request
        frontend.take_outputs(step_message(a, [(h, frontend.facts.vocab_size)]))
        bad = step_message(a, [(h, 9)])
        bad.num_rows = 2                                                  # malformed rows
        frontend.take_outputs(bad)
        await settle()
        assert client.outputs == []
        frontend.take_outputs(step_message(a, [(h, 9)], [finished(h, "length", 2, 1)]))
        await asyncio.wait_for(client.task, 5)
        return client

    assert asyncio.run(run()).token_ids == [9]


def test_a_stop_string_ends_the_output_and_aborts_it_on_its_engine_core(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    tokens = tokenizer.encode("The answer is 42. END of story")
    end = next(i for i in range(len(tokens)) if "END" in tokenizer.decode(tokens[:i + 1]))
    a = replica(0)

    async def run() -> Client:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, PreparedRequest("r", PROMPT, SamplingParams(stop=("END",))))
        await settle()
        ((_, sent),) = links.requests()
        h = sent.handle
        for token in tokens[:end]:
            frontend.take_outputs(step_message(a, [(h, token)]))
        assert links.aborts() == []
        # The token that completes the stop string, and one more in the same message.
        frontend.take_outputs(step_message(a, [(h, tokens[end]), (h, tokens[end + 1])]))
        assert links.aborts() == [(placement_of(a), [sent.request_id])]
        # The engine core computed one more step before the abort reached it.
        frontend.take_outputs(step_message(a, [(h, tokens[end + 2])]))
        await settle()
        assert not client.done                   # its ending waits for the engine core's
        frontend.take_outputs(step_message(a, finished=[finished(
            h, "abort", 2, end + 3, num_cached_tokens=2)]))
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert client.error is None and len(links.aborts()) == 1
    assert client.text == "The answer is 42. "
    assert client.token_ids == tokens[:end + 1]
    last = client.last
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, "END")
    # Usage counts what the client got; the prefix-cache figure is the engine core's.
    assert (last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) == (
        2, end + 1, 2)


def test_a_stop_string_in_the_engine_cores_last_step_needs_no_abort(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    tokens = tokenizer.encode(" x STOP")
    client = asyncio.run(generate(frontend, links, tokens, stop=("STOP",)))
    assert links.aborts() == []
    assert (client.text, client.last.finish_reason, client.last.stop_reason) == (
        " x ", FinishReason.STOP, "STOP")
    assert client.token_ids == tokens and client.last.num_output_tokens == len(tokens)


def test_a_kept_stop_string_stays_in_the_text(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    """include_stop_str_in_output: the output ends with the matched string (nothing after
    it); the request still ends at it, aborted on its engine core, with the same tokens and
    counts as without it."""
    tokens = tokenizer.encode(" x STOP y z")
    client = asyncio.run(generate(frontend, links, tokens, stop=("STOP",),
                                  include_stop_str_in_output=True))
    assert len(links.aborts()) == 1
    assert (client.text, client.last.finish_reason, client.last.stop_reason) == (
        " x STOP", FinishReason.STOP, "STOP")
    assert client.token_ids == tokens[:3] and client.last.num_output_tokens == 3
    assert tokenizer.decode(client.token_ids, True) == client.text


def test_a_failed_step_after_the_stop_string_does_not_fail_the_request(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    tokens = tokenizer.encode(" x STOP y")
    a = replica(0)

    async def run() -> Client:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, PreparedRequest("r", PROMPT, SamplingParams(stop=("STOP",))))
        await settle()
        ((_, sent),) = links.requests()
        h = sent.handle
        frontend.take_outputs(step_message(a, [(h, t) for t in tokens[:3]]))
        assert len(links.aborts()) == 1
        # The step in flight when the abort came fails: its requests end with the error.
        frontend.take_outputs(step_message(a, finished=[finished(
            h, "abort", 2, 3, error="RuntimeError: boom", server_fault=True)]))
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert client.error is None
    assert (client.text, client.last.finish_reason, client.last.stop_reason) == (
        " x ", FinishReason.STOP, "STOP")


def test_text_that_may_begin_a_stop_string_is_held_back(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    tokens = tokenizer.encode(" a b c d e")
    assert len(tokens) == 5, "one token per letter"
    client = asyncio.run(generate(frontend, links, tokens, stop=("never",)))
    # The last len("never") - 1 characters wait for the next token; the end sends the rest.
    assert [o.text for o in client.outputs] == ["", "", " a", " b", " c d e"]
    assert client.last.stop_reason is None


def test_stop_string_before_min_tokens_stays_in_the_text(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    tokens = tokenizer.encode(" A END B C END D")
    assert len(tokens) == 6, "one token per word"
    # The first END is completed by output token 2, before min_tokens: it is neither a stop
    # nor cut out of the text; the second (token 5) ends the output.
    client = asyncio.run(generate(frontend, links, tokens, stop=("END",), min_tokens=3))
    assert (client.last.finish_reason, client.last.stop_reason) == (FinishReason.STOP, "END")
    assert client.token_ids == tokens[:5]
    assert client.text == " A END B C "
    # The text is what the streamed token ids decode to, up to the stop string.
    assert tokenizer.decode(client.token_ids, True) == client.text + "END"


@pytest.mark.parametrize("stop, min_tokens, num_tokens, text", [
    # Completed by the min_tokens-th token, begun by the one before: it counts (the token
    # that completes a stop string decides, as for EOS), and the output has min_tokens tokens.
    (("\n\n",), 3, 3, "one"),
    # Completed one token before min_tokens: never matched later, even when a longer stop
    # string widens the window held back; the next one ends the output.
    (("\n\n", "a much longer stop"), 4, 6, "one\n\ntwo"),
])
def test_stop_string_straddling_min_tokens(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer,
        stop: tuple[str, ...], min_tokens: int, num_tokens: int, text: str) -> None:
    tokens = tokenizer.encode("one\n\ntwo\n\nthree")
    assert len(tokens) == 7 and tokenizer.decode(tokens[1:3], True) == "\n\n"
    client = asyncio.run(generate(frontend, links, tokens, stop=stop, min_tokens=min_tokens))
    assert (client.token_ids, client.text, client.last.stop_reason) == (
        tokens[:num_tokens], text, "\n\n")
    assert client.last.num_output_tokens == num_tokens


def test_a_whole_output_is_one_message(frontend: Frontend, links: FakeEngineLinks,
                                       tokenizer: TextTokenizer) -> None:
    tokens = tokenizer.encode(" one two three")
    a = replica(0)

    async def run() -> Client:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, PreparedRequest("r", PROMPT, SamplingParams(
            max_tokens=len(tokens))), whole=True)
        await settle()
        ((_, sent),) = links.requests()
        for i, token in enumerate(tokens, start=1):
            ending = [finished(sent.handle, "length", 2, i)] if i == len(tokens) else []
            frontend.take_outputs(step_message(a, [(sent.handle, token)], ending))
            await settle()
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    (whole,) = client.outputs
    assert whole.new_token_ids == tokens and whole.text == " one two three"
    assert whole.finish_reason is FinishReason.LENGTH

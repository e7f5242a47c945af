"""Requests moving off a lost engine core, in the front end: an engine core's `down` message (or
the cluster's state listing it gone) parks every request placed there and dispatches it again,
token-exact (prompt + the outputs its client has, the same limits), to another ready replica
and never back to the lost one; late outputs of the lost engine core are ignored; a request
whose outputs already end it finishes instead of running again."""

import asyncio

import pytest

from scheduler_svc.cluster.wire import ReplicaEntry
from scheduler_svc.engine.request import FinishReason
from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.prompts import PreparedRequest
from scheduler_svc.frontend.tokenizer import TextTokenizer
from tests.scheduler_svc.frontend.fakes import (
    EOS,
    Client,
    FakeEngineLinks,
    cluster_state,
    finished,
    placement_of,
    replica,
    settle,
    step_message,
)

A, B = replica(0), replica(1)


async def start(frontend: Frontend, links: FakeEngineLinks, prompt: list[int],
                *ready: ReplicaEntry, **sampling: object) -> tuple[Client, int]:
    """A request dispatched to the first of `ready` (all idle: the lowest id wins); the
    client and the request's handle."""
    frontend.take_state(cluster_state(*ready))
    client = Client(frontend, PreparedRequest("r", prompt, SamplingParams(**sampling)))  # type: ignore[arg-type]
    await settle()
    ((where, sent),) = links.requests()
    assert where == placement_of(ready[0])
    return client, sent.handle


@pytest.mark.parametrize("how", ["down message", "gone in the state"])
def test_a_lost_engine_cores_request_moves_token_exact(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer, how: str) -> None:
    prompt = tokenizer.encode("Count: one two")
    tokens = tokenizer.encode(" three four five six seven")

    async def run() -> Client:
        client, h = await start(frontend, links, prompt, A, B, max_tokens=len(tokens),
                                min_tokens=1, stop_token_ids=(77,))
        frontend.take_outputs(step_message(A, [(h, tokens[0])]))
        frontend.take_outputs(step_message(A, [(h, tokens[1])]))
        if how == "down message":
            # The cluster has not heard yet: its state still lists A ready.
            frontend.take_outputs(step_message(A, down="worker w0 lost"))
        else:
            frontend.take_state(cluster_state(B, gone=[placement_of(A)]))
        await settle()
        (first, (where, moved)) = links.requests()
        assert where == placement_of(B)
        assert moved.token_ids == prompt + tokens[:2]
        assert moved.num_prompt_tokens == len(prompt)
        assert (moved.max_tokens, moved.min_tokens, moved.stop_token_ids) == (
            first[1].max_tokens, first[1].min_tokens, first[1].stop_token_ids)
        assert (moved.handle, moved.request_id) == (h, first[1].request_id)
        assert links.forgotten == [placement_of(A)] and links.aborts() == []
        assert frontend.num_migrations == 1 and frontend.report().num_migrations == 1
        frontend.take_outputs(step_message(A, [(h, 999)]))   # late, from the lost one
        for i, token in enumerate(tokens[2:], start=3):
            ending = [finished(h, "length", len(prompt), i)] if i == len(tokens) else []
            frontend.take_outputs(step_message(B, [(h, token)], ending))
            await settle()
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert client.error is None
    assert client.token_ids == tokens and client.text == tokenizer.decode(tokens)
    assert client.last.finish_reason is FinishReason.LENGTH
    assert client.last.num_output_tokens == len(tokens)
    assert len(links.requests()) == 2        # moved once: the gone entry after the message
    frontend.take_state(cluster_state(B, gone=[placement_of(A)]))
    assert frontend.num_migrations == 1


def test_with_no_other_replica_it_waits_for_one_never_the_lost_engine_core(
        frontend: Frontend, links: FakeEngineLinks) -> None:
    restarted = replica(0, engine_epoch=A.engine_epoch + 1)   # replica 0's next engine core

    async def run() -> Client:
        client, h = await start(frontend, links, [5, 6], A, max_tokens=3)
        frontend.take_outputs(step_message(A, [(h, 9)], down="its engine core stops"))
        await settle()
        frontend.take_state(cluster_state(A))      # not heard yet: still listed ready
        await settle()
        assert len(links.requests()) == 1 and frontend.live.num_parked == 1
        frontend.take_state(cluster_state(restarted, gone=[placement_of(A)]))
        await settle()
        (_, (where, moved)) = links.requests()
        assert where == placement_of(restarted) and moved.token_ids == [5, 6, 9]
        # An output of the same handle from the old engine core is stale.
        frontend.take_outputs(step_message(A, [(h, 10)]))
        frontend.take_outputs(step_message(restarted, [(h, 11)]))
        frontend.take_outputs(step_message(restarted, [(h, 12)], [finished(h, "length", 2, 3)]))
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert client.token_ids == [9, 11, 12] and client.last.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("outputs, sampling, reason, stop_reason", [
    ([9, EOS], {}, FinishReason.STOP, None),
    ([9, 77], {"stop_token_ids": (77,)}, FinishReason.STOP, 77),
    ([9, 10, 11], {"max_tokens": 3}, FinishReason.LENGTH, None),
])
def test_a_request_its_outputs_already_end_finishes_instead_of_moving(
        frontend: Frontend, links: FakeEngineLinks, outputs: list[int],
        sampling: dict[str, object], reason: FinishReason, stop_reason: int | None) -> None:
    """The engine core went down before its ending came (its rules are the same: EOS or a
    stop token id from min_tokens on, max_tokens)."""
    async def run() -> Client:
        client, h = await start(frontend, links, [5, 6], A, B, **sampling)
        frontend.take_outputs(step_message(A, [(h, t) for t in outputs]))
        frontend.take_outputs(step_message(A, down="lost"))
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert len(links.requests()) == 1
    assert client.token_ids == outputs
    assert (client.last.finish_reason, client.last.stop_reason) == (reason, stop_reason)
    assert client.last.num_output_tokens == len(outputs)


def test_eos_before_min_tokens_does_not_end_it(frontend: Frontend,
                                              links: FakeEngineLinks) -> None:
    async def run() -> None:
        client, h = await start(frontend, links, [5, 6], A, B, min_tokens=3)
        frontend.take_outputs(step_message(A, [(h, 9), (h, EOS)], down="lost"))
        await settle()
        (_, (where, moved)) = links.requests()
        assert where == placement_of(B) and moved.token_ids == [5, 6, 9, EOS]
        assert not client.done
        client.task.cancel()
        await asyncio.gather(client.task, return_exceptions=True)

    asyncio.run(run())


def test_a_stop_string_waiting_for_its_ending_finishes_when_its_engine_core_is_lost(
        frontend: Frontend, links: FakeEngineLinks, tokenizer: TextTokenizer) -> None:
    tokens = tokenizer.encode(" x STOP y")

    async def run() -> Client:
        client, h = await start(frontend, links, [5, 6], A, B, stop=("STOP",))
        frontend.take_outputs(step_message(A, [(h, t) for t in tokens[:3]]))
        assert len(links.aborts()) == 1
        frontend.take_outputs(step_message(A, down="lost"))     # no ending will come
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert len(links.requests()) == 1 and frontend.num_migrations == 0
    assert (client.text, client.last.finish_reason, client.last.stop_reason) == (
        " x ", FinishReason.STOP, "STOP")
    assert client.last.num_output_tokens == 3


def test_a_cancelled_request_does_not_run_again(frontend: Frontend,
                                               links: FakeEngineLinks) -> None:
    """Its client went away (or Abort) just before its engine core was lost: the abort went
    to a replica that is gone, and nothing runs it elsewhere."""
    async def run() -> None:
        cancelled, _ = await start(frontend, links, [5, 6], A, B)
        frontend.cancel_id("r")
        await asyncio.wait_for(cancelled.task, 5)
        frontend.take_outputs(step_message(A, down="lost"))
        await settle()

    asyncio.run(run())
    assert len(links.requests()) == 1 and len(links.aborts()) == 1


def test_a_moved_request_waits_for_a_replica_again(frontend: Frontend,
                                                   links: FakeEngineLinks) -> None:
    """`Frontend.replica_wait_s`: how long a request may wait for a ready replica, at start
    or after its replica was lost with no other left."""
    frontend.replica_wait_s = 0.2

    async def run() -> Client:
        client, h = await start(frontend, links, [5, 6], A, max_tokens=4)
        frontend.take_outputs(step_message(A, [(h, 9)]))
        await asyncio.sleep(0.3)                   # it ran longer than replica_wait_s
        frontend.take_outputs(step_message(A, down="lost"))
        frontend.take_state(cluster_state(gone=[placement_of(A)]))
        await settle()
        assert not client.done, client.error       # it has just begun to wait
        frontend.take_state(cluster_state(B, gone=[placement_of(A)]))
        await settle()
        assert [where for where, _ in links.requests()] == [placement_of(A), placement_of(B)]
        client.task.cancel()
        await asyncio.gather(client.task, return_exceptions=True)
        return client

    asyncio.run(run())


def test_a_finished_request_is_not_counted_as_moved(frontend: Frontend,
                                                    links: FakeEngineLinks) -> None:
    """Its ending and the engine core's down message came together: its client has every
    output, nothing moves."""
    async def run() -> Client:
        client, h = await start(frontend, links, [5, 6], A, B, max_tokens=1)
        frontend.take_outputs(step_message(A, [(h, 9)], [finished(h, "length", 2, 1)]))
        frontend.take_outputs(step_message(A, down="lost"))
        await asyncio.wait_for(client.task, 5)
        await settle()
        return client

    client = asyncio.run(run())
    assert [o.finish_reason for o in client.outputs] == [FinishReason.LENGTH]
    assert len(links.requests()) == 1
    assert frontend.num_migrations == 0

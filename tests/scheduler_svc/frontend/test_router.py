"""The router (scheduler_svc.frontend.router): prefix-versus-load scoring over the cluster's
ready replicas, store hits counting on every replica, the prompt's block hashes as the engine
computes them, and when the prefix query is worth making. Parking, deadlines and moves off
lost replicas are the front end's (test_core.py, test_core_moves.py); a slow or silent
kvcache_svc is test_router_query.py."""

import asyncio
from collections.abc import Iterator

import pytest
import zmq

from scheduler_svc.frontend import router as router_module
from scheduler_svc.frontend.requests import Placement
from scheduler_svc.frontend.router import Router
from scheduler_svc.frontend.tokenizer import TextTokenizer
from services.block_hash import NONE_HASH, hash_full_blocks
from services.kv_wire import PrefixQuery, PrefixReply, ReplicaPrefix
from tests.scheduler_svc.frontend.fakes import (
    front_request,
    make_router,
    placement_of,
    replace_kvcache,
    replica,
)

A, B = replica(0), replica(1)


@pytest.fixture
def router(ctx: zmq.Context) -> Iterator[Router]:
    r = make_router(ctx, prefix_caching=True)
    yield r
    r.close()


class Kv:
    """kvcache_svc answering every prefix query with `reply` (None: no answer in time)."""

    def __init__(self, reply: PrefixReply | None) -> None:
        self.reply = reply
        self.queries: list[PrefixQuery] = []

    def call(self, message: PrefixQuery, timeout_ms: int) -> PrefixReply | None:
        self.queries.append(message)
        return self.reply

    def close(self) -> None:
        pass


def loads(**by_replica: int) -> dict[Placement, int]:
    return {placement_of(A): by_replica.get("a", 0), placement_of(B): by_replica.get("b", 0)}


def test_route_prefers_the_cached_prefix_unless_much_busier(router: Router,
                                                            tokenizer: TextTokenizer) -> None:
    request = front_request(tokenizer, "r", range(100, 500))     # 400 tokens
    load = loads(a=3)
    # 320 cached tokens on replica 0 outweigh 3 more live requests (3 x 64 tokens).
    assert router.choose(request, [A, B], {0: 20}, load.__getitem__) is A
    load = loads(a=6)                                  # 6 x 64 > 320: now it is too busy
    assert router.choose(request, [A, B], {0: 20}, load.__getitem__) is B
    load = loads(a=1, b=2)                             # nothing cached: least loaded
    assert router.choose(request, [A, B], {}, load.__getitem__) is A
    assert router.choose(request, [B], {0: 20}, load.__getitem__) is B
    assert router.choose(request, [], {}, load.__getitem__) is None


def test_a_prompt_all_cached_counts_one_token_less(router: Router,
                                                   tokenizer: TextTokenizer) -> None:
    """An admission computes at least the last token: a replica holding the whole prompt is
    worth num_tokens - 1 cached tokens, like one holding all but its last block's last token.
    A moved request's tokens are its prompt and outputs so far."""
    request = front_request(tokenizer, "r", range(100, 116))     # one block
    request.output_token_ids += list(range(16))                  # and one more, moved
    router.weight = 1.0
    # Replica 0 holds both blocks (31 tokens count), replica 1 one (16): 0 wins by 15 tokens
    # even with 14 more requests, not with 16.
    assert router.choose(request, [A, B], {0: 2, 1: 1}, loads(a=14).__getitem__) is A
    assert router.choose(request, [A, B], {0: 2, 1: 1}, loads(a=16).__getitem__) is B


def test_store_hits_count_as_cached_on_every_replica(router: Router,
                                                     tokenizer: TextTokenizer) -> None:
    """A prefix the KV store holds is reachable from both replicas (a load): it no longer
    pulls the prompt to the replica that computed it, so the less busy replica wins, while
    the replica's own longer device hit still counts in full."""
    kv = Kv(PrefixReply(epoch=1, replicas=[ReplicaPrefix(0, 20, 16), ReplicaPrefix(1, 0, 16)]))
    replace_kvcache(router, kv)
    request = front_request(tokenizer, "r", range(100, 500))
    load = loads(a=1)
    cached = asyncio.run(router.cached_blocks([b"x" * 32]))
    assert cached == {0: 20, 1: 16} and kv.queries == [PrefixQuery(block_hashes=[b"x" * 32])]
    # 320 tokens on replica 0 vs 256 from the store on replica 1: 64 tokens apart, exactly
    # the weight of replica 0's one more live request; the tie goes to the lower id.
    assert router.choose(request, [A, B], cached, load.__getitem__) is A
    kv.reply = PrefixReply(epoch=1, replicas=[ReplicaPrefix(0, 16, 16), ReplicaPrefix(1, 0, 16)])
    cached = asyncio.run(router.cached_blocks([b"x" * 32]))
    assert router.choose(request, [A, B], cached, load.__getitem__) is B   # only the store


def test_block_hashes_are_the_engines_and_computed_once(router: Router, ctx: zmq.Context,
                                                        tokenizer: TextTokenizer) -> None:
    request = front_request(tokenizer, "r", range(100, 140), cache_salt=b"tenant")
    request.output_token_ids += [7] * 8               # moved: its outputs are hashed too
    hashes = router.block_hashes(request)
    assert hashes == hash_full_blocks(list(range(100, 140)) + [7] * 8, 16, NONE_HASH,
                                      cache_salt=b"tenant")
    assert len(hashes) == 3
    assert hash_full_blocks(request.token_ids, 16, NONE_HASH)[0] != hashes[0]   # salted
    request.output_token_ids.append(8)
    assert router.block_hashes(request) is hashes      # kept on the request
    off = make_router(ctx, prefix_caching=False)
    try:
        assert off.block_hashes(front_request(tokenizer, "s", range(100, 140))) == []
    finally:
        off.close()


def test_the_prefix_query_is_made_only_where_it_can_decide(
        router: Router, tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    long = front_request(tokenizer, "long", range(100, 140))
    short = front_request(tokenizer, "short", range(100, 115))    # no full block
    assert router.needs_query(long, [A, B], kv_reachable=True)
    assert not router.needs_query(long, [A], kv_reachable=True)   # one choice
    assert not router.needs_query(long, [A, B], kv_reachable=False)
    assert not router.needs_query(short, [A, B], kv_reachable=True)
    # After a query with no answer, none for QUERY_BACKOFF_S.
    monkeypatch.setattr(router_module, "QUERY_BACKOFF_S", 30.0)
    replace_kvcache(router, Kv(None))
    assert asyncio.run(router.cached_blocks(router.block_hashes(long))) == {}
    assert not router.needs_query(long, [A, B], kv_reachable=True)


def test_a_closed_router_routes_by_load(router: Router) -> None:
    router.close()
    assert asyncio.run(router.cached_blocks([b"x" * 32])) == {}

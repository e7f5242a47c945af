"""The KV store's refusals go through the rate-limited refusal log (issue 40), as every other
listener's do: 1,000 bad requests from one peer write one line, not 1,000, and each is still
answered StoreRefused."""

import logging

import pytest
import zmq

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.kv_store_wire import LookupChunks, StoreRefused
from services.zmq_gate import present_credentials
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, key
from tests.kvcache_svc.kv_store.serving import KEY, client_codec, serving

NUM_BAD = 1000


def test_a_thousand_refusals_of_one_peer_write_one_line(
        ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    caplog.set_level(logging.WARNING, logger="kvcache_svc.kv_store.server")
    with serving(ctx, store) as loop:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        present_credentials(sock, KEY)
        sock.connect(loop.address)
        try:
            bad = [client_codec().encode(LookupChunks([[key(1)]])), b"unexpected data"]
            for _ in range(NUM_BAD):
                sock.send_multipart(bad)
            for _ in range(NUM_BAD):
                assert sock.poll(5000), "no answer"
                reply = client_codec().decode(sock.recv_multipart()[0])
                assert isinstance(reply, StoreRefused) and "takes no data frames" in reply.error
        finally:
            sock.close(linger=0)
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "kvcache_svc.kv_store.server"]
        assert len(lines) == 1, lines[:5]
        assert "refused KV store requests on tcp://" in lines[0]
        assert "from 127.0.0.1" in lines[0] and "takes no data frames" in lines[0]

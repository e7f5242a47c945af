"""`ChunkFetcher`: fetches a load's chunks from the KV store one message per chunk, on a thread
of its own, a few chunks ahead of the loader (issue 24, point 2).

Without it a load asked for every chunk in one message and copied none into the cache before
the last had arrived and been checked. With it the loader copies chunk i into the request's
blocks while chunk i + 1 is received and its checksum computed (both release the GIL), so a
long hit takes about its transfer time. At most `max_ahead` fetched chunks wait for the loader
(bounded memory). A miss, a damaged chunk or no answer ends the run: the fetcher yields None
and stops. Used by `worker_svc.kv_loader.KvLoader` only; the client comes from its factory, on
this thread (a client is not thread-safe).
"""

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import zmq

from services.kv_chunks import KvChunk
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey

log = logging.getLogger(__name__)

MAX_AHEAD = 2           # chunks fetched and not yet taken by the loader
PUT_POLL_S = 0.1        # how often a blocked fetch looks whether the loader gave up


class _Fetch:
    __slots__ = ("keys", "out", "cancelled")

    def __init__(self, keys: list[ChunkKey], max_ahead: int) -> None:
        self.keys = keys
        self.out: queue.Queue[KvChunk | None] = queue.Queue(maxsize=max_ahead)
        self.cancelled = threading.Event()


class ChunkFetcher:
    def __init__(self, new_client: Callable[[zmq.Context], KvStoreClient],
                 max_ahead: int = MAX_AHEAD) -> None:
        self.max_ahead = max_ahead
        self._fetches: queue.SimpleQueue[_Fetch | None] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, args=(new_client,),
                                        name="kv-fetcher", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._fetches.put(None)
        self._thread.join(timeout_s)

    def fetch(self, keys: Sequence[ChunkKey]) -> Iterator[KvChunk | None]:
        """The chunks of `keys` in order as they arrive; stops after the first None (a miss).
        Leaving the loop early tells the fetcher to stop too."""
        fetch = _Fetch(list(keys), self.max_ahead)
        self._fetches.put(fetch)
        try:
            for _ in fetch.keys:
                chunk = fetch.out.get()
                yield chunk
                if chunk is None:
                    return
        finally:
            fetch.cancelled.set()

    def _run(self, new_client: Callable[[zmq.Context], KvStoreClient]) -> None:
        client = new_client(self._ctx)
        try:
            while (fetch := self._fetches.get()) is not None:
                try:
                    self._serve(client, fetch)
                except Exception:       # a bug: the load ends short, the worker goes on
                    log.exception("KV chunk fetch failed")
                    self._put(fetch, None)
        finally:
            client.close()
            self._ctx.term()

    def _serve(self, client: KvStoreClient, fetch: _Fetch) -> None:
        for key in fetch.keys:
            if fetch.cancelled.is_set():
                return
            [chunk] = client.load([key])
            if not self._put(fetch, chunk) or chunk is None:
                return

    def _put(self, fetch: _Fetch, chunk: KvChunk | None) -> bool:
        """Hands `chunk` to the loader; False when it gave up meanwhile."""
        while not fetch.cancelled.is_set():
            try:
                fetch.out.put(chunk, timeout=PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

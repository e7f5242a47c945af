"""`ChunkFetcher`: fetches a load's chunks from the KV store on a thread of its own, a few
messages ahead of the loader (issue 24, point 2).

Without it a load asked for every chunk in one message and copied none into the cache before
the last had arrived and been checked. With it the loader copies chunk i into the request's
blocks while chunk i + 1 is received and its checksum computed (both release the GIL), so a
long hit takes about its transfer time. A chunk-by-chunk load (`fetch`) asks for one chunk per
message; a layer-wise load (`fetch_batches`) asks for one range of layers of all its chunks per
message, so layer group g + 1 is on its way while group g is copied and computed on. At most
`max_ahead` fetched messages wait for the loader (bounded memory). A miss, a damaged chunk or
no answer ends the run. Used by `worker_svc.kv_loader.KvLoader` only; the client comes from its
factory, on this thread (a client is not thread-safe).
"""

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing

import zmq

from services.kv_chunks import KvChunk
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey

log = logging.getLogger(__name__)

MAX_AHEAD = 2           # messages' chunks fetched and not yet taken by the loader
PUT_POLL_S = 0.1        # how often a blocked fetch looks whether the loader gave up


Batch = tuple[list[ChunkKey], "tuple[int, int] | None"]   # keys of one message, layer range


class _Fetch:
    __slots__ = ("batches", "out", "cancelled")

    def __init__(self, batches: list[Batch], max_ahead: int) -> None:
        self.batches = batches
        self.out: queue.Queue[list[KvChunk | None]] = queue.Queue(maxsize=max_ahead)
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
        """The chunks of `keys` in order as they arrive, one message each; stops after the
        first None (a miss). Leaving the loop early tells the fetcher to stop too."""
        with closing(self.fetch_batches([([key], None) for key in keys])) as batches:
            for [chunk] in batches:
                yield chunk
                if chunk is None:
                    return

    def fetch_batches(self, batches: Sequence[Batch]) -> Iterator[list[KvChunk | None]]:
        """Per batch, in order as they arrive, its chunks (one message per batch: its keys,
        only their layers [start, end) when a range is given; None for a miss). A layer-wise
        load asks for a range of layers of all its chunks at a time (worker_svc.kv_loader).
        A batch whose first chunk is a miss ends the fetch (nothing after it is useful), as
        does an empty one (the fetcher failed). Leaving the loop early tells the fetcher to
        stop too."""
        fetch = _Fetch([(list(keys), layers) for keys, layers in batches], self.max_ahead)
        self._fetches.put(fetch)
        try:
            for _ in fetch.batches:
                chunks = fetch.out.get()
                yield chunks
                if not chunks or chunks[0] is None:   # the fetcher stopped there
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
                    self._put(fetch, [])
        finally:
            client.close()
            self._ctx.term()

    def _serve(self, client: KvStoreClient, fetch: _Fetch) -> None:
        for keys, layers in fetch.batches:
            if fetch.cancelled.is_set():
                return
            chunks = client.load(keys, layers)
            if not self._put(fetch, chunks) or chunks[0] is None:
                return      # a miss at the first key: the run ends here, for every batch

    def _put(self, fetch: _Fetch, chunks: list[KvChunk | None]) -> bool:
        """Hands `chunks` to the loader; False when it gave up meanwhile."""
        while not fetch.cancelled.is_set():
            try:
                fetch.out.put(chunks, timeout=PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

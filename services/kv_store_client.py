"""Client of kvcache_svc's KV store: look up, save and load KV chunks over ZMQ.

A DEALER socket, one call in flight at a time, each with a timeout: a call that times out (or
is refused) counts as misses and failed saves, never raises, and replaces the socket (as
`channels.RequestClient` does) so a late reply cannot answer the next call and a restarted
kvcache_svc is picked up. Chunk data leaves without a copy (`send_multipart(copy=False)` over
the chunks' memoryviews): a caller must not write them until `save` returns. Should it write
them anyway after a timeout, the store refuses the damaged chunk by its checksum. Every loaded
chunk is checked (its key, sizes and checksum) before it is returned. Not thread-safe: one
client per thread. No torch here: `services.kv_tensors` converts tensors.
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from services import cluster_token
from services.codec import Codec, DecodeError
from services.kv_chunks import KvChunk, chunk_problem
from services.kv_store_wire import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKS_PER_MESSAGE,
    MAX_KEY_LISTS,
    MAX_STORE_DATA_BYTES,
    MAX_STORE_HEADER_BYTES,
    ChunkKey,
    DescribeStore,
    FromKvStore,
    LoadChunks,
    LoadReply,
    LookupChunks,
    LookupReply,
    SaveChunks,
    SaveReply,
    StoreInfo,
    StoreRefused,
)
from services.zmq_gate import present_credentials

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 5000

Answer = tuple[FromKvStore, list[memoryview]]


@dataclass(frozen=True, slots=True)
class SaveResult:
    num_stored_chunks: int      # newly stored
    num_held_chunks: int        # the store already held them
    num_failed_chunks: int      # not saved: timeout, refusal, no store, or too large for it


class KvStoreClient:
    def __init__(self, ctx: zmq.Context, address: str, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 codec: Codec[FromKvStore] | None = None) -> None:
        """`codec`: this process's frame key unless given (tests pass their own)."""
        self.ctx = ctx
        self.address = address
        self.timeout_ms = timeout_ms
        self.codec: Codec[FromKvStore] = codec if codec is not None else Codec(
            FromKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES)
        self.socket = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        tag = 0 if self.codec.key is None else cluster_token.TAG_BYTES
        sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_CHUNK_BYTES, self.codec.max_frame_bytes + tag))
        # A send waits for a connection to queue on at most this long (a store that refused
        # the handshake leaves none): then the call counts as unanswered.
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        present_credentials(sock, self.codec.key)   # the store admits members only
        sock.connect(self.address)
        return sock

    def close(self) -> None:
        self.socket.close(linger=0)

    def _call(self, message: msgspec.Struct,
              data: Sequence[bytes | memoryview] = ()) -> Answer | None:
        """The reply and its data frames; None on a timeout or a refusal (logged)."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        try:
            self.socket.send_multipart([self.codec.encode(message), *data], copy=False)
        except zmq.Again:
            deadline = 0.0            # no connection to send on: unanswered, as below
        while self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            header, *frames = self.socket.recv_multipart(copy=False)
            try:
                reply = self.codec.decode(header.buffer)
            except DecodeError as exc:
                log.warning("dropping malformed KV store reply from %s: %s", self.address, exc)
                continue
            if isinstance(reply, StoreRefused):
                log.warning("KV store %s refused %s: %s", self.address,
                            type(message).__name__, reply.error)
                return None
            return reply, [frame.buffer for frame in frames]
        log.warning("KV store %s did not answer %s within %d ms", self.address,
                    type(message).__name__, self.timeout_ms)
        self.socket.close(linger=0)
        self.socket = self._connect()
        return None

    def describe(self) -> StoreInfo | None:
        answer = self._call(DescribeStore())
        return answer[0] if answer is not None and isinstance(answer[0], StoreInfo) else None

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading `keys` the store holds (0 when it does not answer)."""
        return self.lookup_many([keys])[0]

    def lookup_many(self, key_lists: Sequence[Sequence[ChunkKey]]) -> list[int]:
        """`lookup` for each key list (e.g. every rank's keys of one request) in one call."""
        counts: list[int] = []
        for start in range(0, len(key_lists), MAX_KEY_LISTS):
            batch = [list(keys[:MAX_CHUNKS_PER_MESSAGE])
                     for keys in key_lists[start:start + MAX_KEY_LISTS]]
            answer = self._call(LookupChunks(batch))
            reply = None if answer is None else answer[0]
            if not isinstance(reply, LookupReply) or len(reply.num_leading_chunks) != len(batch):
                counts += [0] * len(batch)
                continue
            counts += [min(n, len(keys)) for n, keys in zip(reply.num_leading_chunks, batch)]
        return counts

    def save(self, chunks: Sequence[KvChunk]) -> SaveResult:
        """Sends `chunks` (split into messages within the wire's limits); after a failed
        message the rest are not sent (the store is likely down)."""
        num_stored = num_held = 0
        start = 0
        while start < len(chunks):
            end = _batch_end(chunks, start)
            batch = chunks[start:end]
            answer = self._call(SaveChunks([chunk.header for chunk in batch]),
                                [chunk.data for chunk in batch])
            if answer is None or not isinstance(answer[0], SaveReply):
                break
            num_stored += answer[0].num_stored_chunks
            num_held += answer[0].num_held_chunks
            start = end
        return SaveResult(num_stored, num_held, len(chunks) - num_stored - num_held)

    def load(self, keys: Sequence[ChunkKey], layers: tuple[int, int] | None = None
             ) -> list[KvChunk | None]:
        """Per key, its chunk or None (a miss: not held, damaged, or no answer). Only the
        leading run of chunks is useful to a request; later ones are returned as found.
        `layers`: only layers [start, end) of each chunk (counted from its first layer)."""
        loaded: list[KvChunk | None] = []
        while len(loaded) < len(keys):
            batch = list(keys[len(loaded):len(loaded) + MAX_CHUNKS_PER_MESSAGE])
            answer = self._call(LoadChunks(batch, layers))
            chunks = None if answer is None else self._checked_load(batch, *answer, layers)
            if not chunks:
                break
            loaded += chunks
        return loaded + [None] * (len(keys) - len(loaded))

    def _checked_load(self, keys: list[ChunkKey], reply: FromKvStore,
                      frames: list[memoryview], layers: tuple[int, int] | None = None
                      ) -> list[KvChunk | None] | None:
        """The chunks of one LoadReply; None when the reply is not one, or is malformed."""
        if not isinstance(reply, LoadReply):
            return None
        headers = reply.chunks
        num_frames = sum(header is not None for header in headers)
        if not 0 < len(headers) <= len(keys) or num_frames != len(frames):
            log.warning("malformed KV store load reply from %s: %d headers (%d with data) for "
                        "%d keys, %d data frames", self.address, len(headers), num_frames,
                        len(keys), len(frames))
            return None
        chunks: list[KvChunk | None] = []
        data = iter(frames)
        for key, header in zip(keys, headers):
            if header is None:
                chunks.append(None)
                continue
            frame = next(data)
            problem = ("another key's chunk" if header.key != key
                       else f"layers {header.shape[0]}, asked for {list(layers)}"
                       if layers is not None and header.shape[0] != layers[1] - layers[0]
                       else chunk_problem(header, frame))
            if problem is not None:
                log.warning("dropping a chunk loaded from %s: %s", self.address, problem)
                chunks.append(None)
                continue
            chunks.append(KvChunk(header, frame))
        return chunks


def _batch_end(chunks: Sequence[KvChunk], start: int) -> int:
    """End of the save message that starts at `start`: within MAX_CHUNKS_PER_MESSAGE chunks and
    MAX_STORE_DATA_BYTES of data, at least one chunk."""
    end, num_bytes = start, 0
    while end < len(chunks) and end - start < MAX_CHUNKS_PER_MESSAGE:
        num_bytes += chunks[end].num_bytes
        if end > start and num_bytes > MAX_STORE_DATA_BYTES:
            break
        end += 1
    return end

"""What a replica's engine says to the rest of the cluster, as one small interface: the plan
call to kvcache_svc, a step (or InitCache) to every rank, and the next message from the
ranks. `ZmqTransport` is the real one; the engine's unit tests hand it fakes instead.

A transport is created on the engine's own thread (`connect`) and used only there: ZMQ
sockets belong to one thread.
"""

from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq

from services.channels import Receiver, RequestClient, Sender
from services.codec import Codec
from services.kv_wire import (
    FromKvCache,
    ToKvCache,
)
from services.wire import (
    FromWorker,
    StepInput,
    ToWorker,
)


class EngineTransport(Protocol):
    num_ranks: int      # the replica's ranks: each answers InitCache

    def call_kv(self, message: ToKvCache, timeout_ms: int) -> FromKvCache | None:
        """kvcache_svc's reply, or None when it did not answer in time."""

    def send_to_ranks(self, message: ToWorker) -> None:
        """To every rank of the replica, in rank order; a step's token masks only to the
        last pipeline stage's ranks (the others do not sample)."""

    def recv_from_ranks(self, timeout_ms: int) -> FromWorker | None:
        """The next message any rank sent, or None after `timeout_ms`."""

    def close(self) -> None: ...


Connect = Callable[[], EngineTransport]


class ZmqTransport:
    """A DEALER to kvcache_svc's plan socket, a PUSH per rank, and the replica's PULL socket
    for the ranks' outputs (bound by the engine process at an address the cluster chose and
    gave the workers when they registered)."""

    def __init__(self, ctx: zmq.Context, kvcache_address: str, step_addresses: list[str],
                 outputs: Receiver[FromWorker], tp_size: int = 1) -> None:
        """`step_addresses` in rank order (pp_rank * tp_size + tp_rank): the last `tp_size`
        are the last pipeline stage. `outputs` is closed with the transport."""
        self.num_ranks = len(step_addresses)
        self._first_last_stage_rank = max(0, self.num_ranks - tp_size)
        self._kv: RequestClient[FromKvCache] = RequestClient(ctx, Codec(FromKvCache),
                                                             kvcache_address)
        self._ranks = [Sender(ctx, Codec(ToWorker), address) for address in step_addresses]
        self._outputs = outputs

    def call_kv(self, message: ToKvCache, timeout_ms: int) -> FromKvCache | None:
        return self._kv.call(message, timeout_ms=timeout_ms)

    def send_to_ranks(self, message: ToWorker) -> None:
        unmasked = message
        if isinstance(message, StepInput) and message.token_masks:
            unmasked = msgspec.structs.replace(message, token_masks=[])
        for i, rank in enumerate(self._ranks):
            rank.send(message if i >= self._first_last_stage_rank else unmasked)

    def recv_from_ranks(self, timeout_ms: int) -> FromWorker | None:
        return self._outputs.recv(timeout_ms=timeout_ms)

    def close(self) -> None:
        self._kv.close()
        for rank in self._ranks:
            rank.close()
        self._outputs.close()

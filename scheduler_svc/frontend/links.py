"""A front end's sockets to the rest of the scheduler, used on its event loop:

- `EngineLinks`: a PUSH to each engine core it sends requests to (a `FrontendHello` first, the
  grammar vocabulary before the first grammar), and the output PULL every engine core sends
  its step messages to (read with asyncio);
- `ClusterLink`: a DEALER to the cluster's query socket: a `FrontendReport` every
  STATE_INTERVAL_S answered with the cluster's state, ServerInfo's `StatsQuery`, and Abort by
  request id relayed to and from the other front ends.

Sockets are bound or connected through services.channels (members only, frame limits, the
cluster's frame tag); the readers are asyncio shadows of them.
"""

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from scheduler_svc.cluster.wire import (
    STATE_INTERVAL_S,
    AbortAnswer,
    AbortQuery,
    ClusterState,
    ClusterStatsReply,
    FromFrontend,
    FrontendReport,
    StatsQuery,
    ToFrontend,
)
from scheduler_svc.engine.wire import (
    EngineOutputs,
    FrontendHello,
    GrammarVocabulary,
    ToEngine,
)
from services.channels import Sender, open_socket, peer_of
from services.codec import Codec, DecodeError
from services.refusal_log import RefusalLog

log = logging.getLogger(__name__)

Placement = tuple[int, int]         # (replica id, engine core epoch)
STATS_TIMEOUT_S = 2.0


class EngineLinks:
    def __init__(self, ctx: zmq.Context, frontend: int, epoch: int,
                 host: str = "127.0.0.1") -> None:
        """`host`: the interface of the output socket (the cluster's internal one)."""
        self.ctx = ctx
        self.frontend = frontend
        self.epoch = epoch
        self._codec: Codec[ToEngine] = Codec(ToEngine)
        self._out_codec: Codec[EngineOutputs] = Codec(EngineOutputs)
        self._pull, self.output_address = open_socket(
            ctx, zmq.PULL, self._out_codec, f"tcp://{host}:0", bind=True,
            options={zmq.RCVHWM: 0})
        self._reader = zmq.asyncio.Socket.shadow(self._pull.underlying)
        self._engines: dict[Placement, Sender] = {}
        self._with_vocabulary: set[Placement] = set()
        self.refusals = RefusalLog(log, f"engine outputs on {self.output_address}")

    def send(self, placement: Placement, address: str, message: ToEngine) -> None:
        sender = self._engines.get(placement)
        if sender is None:
            sender = self._engines[placement] = Sender(self.ctx, self._codec, address)
            sender.send(FrontendHello(frontend=self.frontend, epoch=self.epoch,
                                      output_address=self.output_address))
        sender.send(message)

    def send_known(self, placement: Placement, message: ToEngine) -> bool:
        """To an engine core this front end has sent to before (False: it never has)."""
        sender = self._engines.get(placement)
        if sender is None:
            return False
        sender.send(message)
        return True

    def send_vocabulary(self, placement: Placement, address: str, vocabulary: bytes) -> None:
        """Once per engine core, before its first request with a grammar."""
        if placement not in self._with_vocabulary:
            self._with_vocabulary.add(placement)
            self.send(placement, address, GrammarVocabulary(vocabulary=vocabulary))

    def forget(self, placement: Placement) -> None:
        """The engine core is gone: its socket closes."""
        sender = self._engines.pop(placement, None)
        if sender is not None:
            sender.close()
        self._with_vocabulary.discard(placement)

    def known(self) -> set[Placement]:
        return set(self._engines)

    async def recv(self) -> EngineOutputs:
        """The next valid step message from any engine core."""
        while True:
            frame = await self._reader.recv(copy=False)
            try:
                return self._out_codec.decode(frame.buffer)
            except DecodeError as exc:
                self.refusals.refused(peer_of(frame), f"malformed frame: {exc}")

    def close(self) -> None:
        for sender in self._engines.values():
            sender.close()
        self._reader.close(linger=0)
        self._pull.close(linger=0)


class ClusterLink:
    def __init__(self, ctx: zmq.Context, address: str, frontend: int = 0) -> None:
        self.frontend = frontend
        self._codec: Codec[ToFrontend] = Codec(ToFrontend)
        self._send_codec: Codec[FromFrontend] = Codec(FromFrontend)
        self._socket, _ = open_socket(ctx, zmq.DEALER, self._codec, address, bind=False)
        self._async = zmq.asyncio.Socket.shadow(self._socket.underlying)
        self._stats: asyncio.Queue[ClusterStatsReply] = asyncio.Queue()
        self._aborts: dict[int, asyncio.Future[bool]] = {}   # query id -> its answer
        self._next_query = 0
        # Answers another front end's abort query: whether a request with that id was live
        # here (and is now cancelled).
        # `owner`: the asking client's (services.api_keys); "" when keys are off.
        self.on_abort: Callable[[str, str], bool] = lambda request_id, owner="": False
        self.last_state_at = 0.0             # time.monotonic() of the latest state

    async def run(self, report: Callable[[], FrontendReport],
                  on_state: Callable[[ClusterState], None]) -> None:
        """Reports every STATE_INTERVAL_S and hands each state that comes back to
        `on_state`; ends when cancelled."""
        reader = asyncio.ensure_future(self._read(on_state))
        try:
            while True:
                await self._async.send(self._send_codec.encode(report()), copy=False)
                await asyncio.sleep(STATE_INTERVAL_S)
        finally:
            reader.cancel()

    async def _read(self, on_state: Callable[[ClusterState], None]) -> None:
        while True:
            frame = await self._async.recv(copy=False)
            try:
                message = self._codec.decode(frame.buffer)
            except DecodeError as exc:
                log.warning("malformed message from the cluster: %s", exc)
                continue
            if isinstance(message, ClusterState):
                self.last_state_at = time.monotonic()
                on_state(message)
            elif isinstance(message, AbortQuery):       # another front end's
                found = self.on_abort(message.request_id, message.owner)
                await self._async.send(self._send_codec.encode(AbortAnswer(
                    frontend=message.frontend, query_id=message.query_id, found=found)),
                    copy=False)
            elif isinstance(message, AbortAnswer):      # the hub's, to our query
                future = self._aborts.pop(message.query_id, None)
                if future is not None and not future.done():
                    future.set_result(message.found)
            else:
                if message.state is not None:
                    on_state(message.state)
                self._stats.put_nowait(message)

    async def stats(self, report: FrontendReport) -> ClusterStatsReply | None:
        """The cluster's statistics and state (None when it does not answer in time)."""
        while not self._stats.empty():     # a late answer to an earlier query
            self._stats.get_nowait()
        await self._async.send(self._send_codec.encode(StatsQuery(report=report)), copy=False)
        try:
            return await asyncio.wait_for(self._stats.get(), STATS_TIMEOUT_S)
        except TimeoutError:
            return None

    async def abort_elsewhere(self, request_id: str, timeout_s: float = 1.0,
                              owner: str = "") -> bool:
        """Has every other front end cancel its live requests with this id (and `owner`,
        when given); whether any had one (False when the cluster does not answer in time)."""
        self._next_query += 1
        query_id = self._next_query
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._aborts[query_id] = future
        await self._async.send(self._send_codec.encode(AbortQuery(
            frontend=self.frontend, query_id=query_id, request_id=request_id, owner=owner)),
            copy=False)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            self._aborts.pop(query_id, None)
            return False

    def close(self) -> None:
        self._async.close(linger=0)
        self._socket.close(linger=0)

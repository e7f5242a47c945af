"""The plan channel's loop: a ZMQ ROUTER (members only, services.channels) whose requests
`KvCachePools` answers, on a thread of its own. Started by `server.KvCacheServer`.
"""

import logging
import threading
from collections.abc import Callable

import zmq

from kvcache_svc.pools import KvCachePools
from services.channels import ReplyServer
from services.codec import Codec
from services.kv_wire import (
    ToKvCache,
)

log = logging.getLogger(__name__)

POLL_MS = 100         # how often the plan loop looks for a stop request


class PlanLoop:
    """Answers plan-channel requests on its own thread until stopped.

    The socket is bound by the constructor (so a taken port fails there, on the caller's
    thread) and used only by the loop thread afterwards.
    """

    def __init__(self, ctx: zmq.Context, pools: KvCachePools, address: str,
                 on_fatal: Callable[[], None]) -> None:
        self.pools = pools
        self.address = address
        self.failed = False
        self._on_fatal = on_fatal
        self._server: ReplyServer[ToKvCache] = ReplyServer(ctx, Codec(ToKvCache), address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-plan-loop")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops the loop (or, if it never started, just closes the socket)."""
        self._stop.set()
        if self._thread.ident is None:
            self._server.close()
        else:
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                received = self._server.recv(timeout_ms=POLL_MS)
                if received is not None:
                    peer, message = received
                    self._server.reply(peer, self.pools.handle(message))
        except Exception:
            # Socket-level failures only (handle never raises): the service cannot go on.
            log.exception("plan loop failed")
            self.failed = True
            self._on_fatal()
        finally:
            self._server.close()

"""Rate-limited log lines for refused peers: what a listener writes when someone it does not
trust knocks.

A peer that sends 20,000 bad frames or calls must not write 20,000 lines (a disk filled by a
stranger, and the real errors buried). `RefusalLog` writes the first refusal of a peer at
once, counts the rest of that peer's refusals in the interval, and writes the count as one line
when the interval is over (on that peer's next refusal, or on anyone's refusal after it): one
line per peer and interval, with a count. Used by the ZMQ listeners (services.channels,
services.zmq_gate) and the control plane's token check (services.cluster_token).
"""

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

INTERVAL_S = 10.0       # one line per peer per interval
MAX_PEERS = 1024        # peers remembered at once; the oldest is forgotten (its count logged)


class _Peer:
    __slots__ = ("since", "num_more", "why")

    def __init__(self, since: float, why: str) -> None:
        self.since = since      # when this peer's interval began (its first line)
        self.num_more = 0       # refusals since, not written yet
        self.why = why          # the latest reason


class RefusalLog:
    """`refused(peer, why)` from any thread; never raises."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = INTERVAL_S,
                 max_peers: int = MAX_PEERS, clock: Callable[[], float] = time.monotonic) -> None:
        """`what`: the refused thing, in the plural (e.g. "frames on tcp://...:5")."""
        self._log = logger
        self._what = what
        self._interval_s = interval_s
        self._max_peers = max_peers
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: OrderedDict[str, _Peer] = OrderedDict()   # oldest interval first

    def refused(self, peer: str, why: str) -> None:
        with self._lock:
            now = self._clock()
            self._flush(now)
            entry = self._peers.get(peer)
            if entry is not None:
                entry.num_more += 1
                entry.why = why
                return
            self._log.warning("refused %s from %s: %s (further refusals of this peer are "
                              "counted, one line per %.0f s)", self._what, peer, why,
                              self._interval_s)
            self._peers[peer] = _Peer(now, why)
            if len(self._peers) > self._max_peers:
                self._write_count(*self._peers.popitem(last=False))

    def flush(self) -> None:
        """Writes the counts of every interval that is over (tests; a quiet listener)."""
        with self._lock:
            self._flush(self._clock())

    def _flush(self, now: float) -> None:
        while self._peers:
            peer, entry = next(iter(self._peers.items()))
            if now - entry.since < self._interval_s:
                return
            del self._peers[peer]
            self._write_count(peer, entry)

    def _write_count(self, peer: str, entry: _Peer) -> None:
        if entry.num_more:
            self._log.warning("refused %d more %s from %s in %.0f s (last: %s)", entry.num_more,
                              self._what, peer, self._interval_s, entry.why)

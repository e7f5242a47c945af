"""Refusals are logged once per peer and interval, with a count of the rest."""

import logging

import pytest

from services.cluster_token import peer_host
from services.refusal_log import RefusalLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.refusals"]


def test_one_line_per_peer_and_interval_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="test.refusals")
    clock = Clock()
    refusals = RefusalLog(logging.getLogger("test.refusals"), "frames", interval_s=10.0,
                          clock=clock)
    for i in range(20_000):
        refusals.refused("10.0.0.7", f"bad frame {i}")
    refusals.refused("10.0.0.8", "bad frame")
    assert lines(caplog) == [
        "refused frames from 10.0.0.7: bad frame 0 (further refusals of this peer are "
        "counted, one line per 10 s)",
        "refused frames from 10.0.0.8: bad frame (further refusals of this peer are counted, "
        "one line per 10 s)"]
    clock.now += 5
    refusals.flush()                                  # the interval is not over: nothing
    assert len(lines(caplog)) == 2
    clock.now += 5
    refusals.refused("10.0.0.7", "bad frame again")   # a new interval: the count, then it
    assert lines(caplog)[2:] == [
        "refused 19999 more frames from 10.0.0.7 in 10 s (last: bad frame 19999)",
        "refused frames from 10.0.0.7: bad frame again (further refusals of this peer are "
        "counted, one line per 10 s)"]                # 10.0.0.8 had no more: no count line


def test_the_peers_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="test.refusals")
    refusals = RefusalLog(logging.getLogger("test.refusals"), "calls", max_peers=2,
                          clock=Clock())
    for peer in ("a", "a", "b", "c"):
        refusals.refused(peer, "no token")
    # "a" was forgotten to make room for "c"; its count was written then.
    assert "refused 1 more calls from a in 10 s (last: no token)" in lines(caplog)
    assert len(refusals._peers) == 2


@pytest.mark.parametrize("peer, host", [("ipv4:10.0.0.7:41234", "10.0.0.7"),
                                        ("ipv6:[::1]:5000", "[::1]"),
                                        ("unix:/tmp/sock", "/tmp/sock")])
def test_a_grpc_peer_is_its_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host

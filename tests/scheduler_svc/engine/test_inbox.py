"""The engine's inbox: commands come out in order, a blocking take waits for the first, and
closing it refuses later adds while handing back the adds never taken (none is lost)."""

import threading
import time

from scheduler_svc.engine.inbox import Abort, Add, EngineInbox
from scheduler_svc.engine.request import Request, SamplingParams


def request(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4), (2,), 64, 4,
                   hash_blocks=False)


def test_take_returns_every_waiting_command_in_order() -> None:
    inbox = EngineInbox()
    a = request("a")
    assert inbox.take() == []
    assert inbox.add(a)
    inbox.abort("a")
    inbox.wake()
    assert inbox.take() == [Add(a), Abort("a"), None]
    assert inbox.take() == []


def test_a_blocking_take_waits_for_the_first_command_or_its_timeout() -> None:
    inbox = EngineInbox()
    started = time.monotonic()
    assert inbox.take(block=True, timeout_s=0.1) == []
    assert time.monotonic() - started >= 0.09
    threading.Timer(0.05, inbox.abort, args=("x",)).start()
    assert inbox.take(block=True, timeout_s=5) == [Abort("x")]


def test_close_refuses_later_adds_and_returns_the_untaken_ones() -> None:
    inbox = EngineInbox()
    a, b, c = request("a"), request("b"), request("c")
    assert inbox.add(a) and inbox.add(b)
    inbox.abort("a")
    assert inbox.close() == [a, b]
    assert not inbox.add(c)
    assert inbox.take() == []

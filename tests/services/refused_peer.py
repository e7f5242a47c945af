"""Sending as a peer the listener refuses (no or wrong cluster credentials).

libzmq drops a connection's pipe when the listener refuses its handshake, and makes a new one
when it reconnects. On a loaded machine its I/O thread can finish a refusal between connect()
and the next line's send, which then finds no pipe (zmq.Again; seen on CI, and here in 226 of
3,000 tries with three busy loops on 2 cores). Nothing was queued then, so sending again is
safe."""

import time

import zmq


def queue_while_refused(sock: zmq.Socket, frames: list[bytes],  # type: ignore[type-arg]
                        copy: bool = True, within_s: float = 2.0) -> None:
    """Queues `frames` (NOBLOCK) on connected `sock` as soon as it has a pipe; fails the test
    when it has none for `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            sock.send_multipart(frames, copy=copy, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            if time.monotonic() > deadline:
                raise AssertionError(f"no pipe to queue the message on for {within_s} s"
                                     ) from None
            time.sleep(0.02)

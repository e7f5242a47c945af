"""Who may connect to a ZMQ listener: the cluster's members, proven at the handshake.

Every frame carries an HMAC tag (services.codec), but a tag is checked only after libzmq has
handed the application a whole message, and libzmq delivers a multipart message only once all
its frames are in: an anonymous peer could make a listener buffer any number of frames, each
under ZMQ_MAXMSGSIZE (4 x 256 MiB grew kvcache_svc by 1 GiB), before anything was checked. So
a listener also checks the peer before it accepts a single frame: it is a ZMQ PLAIN server, and
this context's ZAP handler (`Gate`, one thread per context) admits a connection only if its
PLAIN password is the cluster's handshake secret. A refused peer is disconnected during the
handshake; its frames are never read. Refusals are logged rate-limited (services.refusal_log).

The handshake secret is derived from the cluster token (as the frame key is), so a listener
and its members need nothing but the token. PLAIN sends it in clear, like the gRPC control
plane's metadata: the internal plane belongs on a private network (cluster_token.py). Frames
are still tagged, so a peer that saw the handshake secret still cannot forge a frame.

Both sides take the frame key of the socket's codec (`Codec.key`: this process's cluster key,
or a test's own). With none (unit tests that build codecs without a key) the listener is open,
as its frames are untagged: `guard_listener` and `present_credentials` do nothing.
"""

import hashlib
import hmac
import logging
import threading
import weakref

import zmq

from services.refusal_log import RefusalLog

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"     # where libzmq asks (RFC 27)
ZAP_DOMAIN = "splitserve"
USERNAME = b"member"

# One ZAP handler per context (libzmq asks the handler bound in the listener's own context).
# Keyed weakly: a context that is gone needs none, and its handler thread ends with it.
_gates: "weakref.WeakKeyDictionary[zmq.Context, Gate]" = weakref.WeakKeyDictionary()
_gates_lock = threading.Lock()


def handshake_secret(frame_key: bytes) -> bytes:
    """The PLAIN password of this cluster's members (derived from the frame key, never the
    token itself)."""
    return hmac.new(frame_key, b"splitserve zmq handshake", hashlib.sha256).hexdigest().encode()


def guard_listener(ctx: zmq.Context, socket: zmq.Socket,  # type: ignore[type-arg]
                   frame_key: bytes | None) -> None:
    """Call before binding: only peers holding `frame_key`'s cluster token may connect to
    `socket` (the key of the listener's codec; None: open, its frames are untagged too). A
    context's gate admits the key of its first guarded listener."""
    key = frame_key
    if key is None:
        return
    with _gates_lock:
        if ctx not in _gates:
            _gates[ctx] = Gate(ctx, handshake_secret(key))
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    socket.setsockopt(zmq.PLAIN_SERVER, 1)


def present_credentials(socket: zmq.Socket,  # type: ignore[type-arg]
                        frame_key: bytes | None) -> None:
    """Call before connecting: `socket` proves it holds `frame_key`'s cluster token at the
    handshake (the key of its codec; None: it presents nothing)."""
    if frame_key is None:
        return
    socket.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
    socket.setsockopt(zmq.PLAIN_PASSWORD, handshake_secret(frame_key))


class Gate:
    """The ZAP handler of one context: answers libzmq's "may this peer connect?" on a thread.

    Its socket is made outside the context's socket list, so `ctx.destroy()` does not close it
    under the thread; `ctx.term()` wakes the thread with ETERM and the thread closes it."""

    def __init__(self, ctx: zmq.Context, secret: bytes) -> None:
        self._secret = secret
        self.refusals = RefusalLog(log, "connections to a ZMQ listener")
        self._socket = zmq.Socket(ctx, zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        threading.Thread(target=self._run, name="zmq-gate", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                request = self._socket.recv_multipart()
                self._socket.send_multipart(self.answer(request))
        except zmq.ContextTerminated:
            pass
        except Exception:   # never expected: then every handshake fails closed
            log.exception("ZAP handler failed; ZMQ listeners now refuse every peer")
        finally:
            self._socket.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """A ZAP reply (RFC 27): 200 for a member, 400 for anyone else."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = request
        peer = address.decode(errors="replace") or "an unknown address"
        if mechanism != b"PLAIN" or len(credentials) != 2:
            why = f"no credentials (mechanism {mechanism.decode(errors='replace')})"
        elif hmac.compare_digest(credentials[1], self._secret):
            return [version, request_id, b"200", b"OK", USERNAME, b""]
        else:
            why = "wrong cluster credentials"
        self.refusals.refused(peer, why)
        return [version, request_id, b"400", b"not a member of this cluster", b"", b""]

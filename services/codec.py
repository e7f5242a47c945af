"""MessagePack codec for the wire types in `services.wire`: typed, validated, size-limited.

Decoding checks the frame size before parsing and every field's type and bounds while parsing,
so a malformed or hostile frame raises `DecodeError` and nothing else. Never pickle.

In a service process (`services.cluster_token.install` at start) every frame ends with an
HMAC-SHA256 tag under the cluster's frame key: encode appends it, decode checks it (in constant
time) before parsing anything, so a frame from outside the cluster is refused unread.
"""

import hmac
from typing import Any, Generic, TypeVar

import msgspec

from services import cluster_token

MAX_FRAME_BYTES = 64 << 20  # one step message; a 16k-request step stays far below this

T = TypeVar("T")


class DecodeError(ValueError):
    """A frame that is too large, not MessagePack, or not a valid message of the expected type."""


class Codec(Generic[T]):
    """Encodes any wire struct; decodes frames into the union `message_type`."""

    __slots__ = ("_decoder", "_encoder", "max_frame_bytes", "key")

    def __init__(self, message_type: Any, max_frame_bytes: int = MAX_FRAME_BYTES,
                 key: bytes | None = None) -> None:
        """`key`: the frames' HMAC key (None: this process's cluster key, if installed)."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type)
        self.max_frame_bytes = max_frame_bytes
        self.key = key if key is not None else cluster_token.installed_frame_key()

    def encode(self, message: msgspec.Struct) -> bytes:
        payload = self._encoder.encode(message)
        if self.key is None:
            return payload
        return payload + cluster_token.frame_tag(self.key, payload)

    def decode(self, frame: bytes | memoryview) -> T:
        limit = self.max_frame_bytes + (0 if self.key is None else cluster_token.TAG_BYTES)
        if len(frame) > limit:
            raise DecodeError(f"frame of {len(frame)} bytes exceeds {limit}")
        if self.key is not None:
            tag_at = len(frame) - cluster_token.TAG_BYTES
            view = memoryview(frame)
            if tag_at < 0 or not hmac.compare_digest(
                    cluster_token.frame_tag(self.key, view[:tag_at]), view[tag_at:]):
                raise DecodeError("frame without a valid cluster token tag (not from a member "
                                  "of this cluster)")
            frame = view[:tag_at]
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeError(str(exc)) from exc

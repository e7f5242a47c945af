"""MessagePack codec for the wire types in `services.wire`: typed, validated, size-limited.

Decoding checks the frame size before parsing and every field's type and bounds while parsing,
so a malformed or hostile frame raises `DecodeError` and nothing else. Never pickle.
"""

from typing import Any, Generic, TypeVar

import msgspec

MAX_FRAME_BYTES = 64 << 20  # one step message; a 16k-request step stays far below this

T = TypeVar("T")


class DecodeError(ValueError):
    """A frame that is too large, not MessagePack, or not a valid message of the expected type."""


class Codec(Generic[T]):
    """Encodes any wire struct; decodes frames into the union `message_type`."""

    __slots__ = ("_decoder", "_encoder", "max_frame_bytes")

    def __init__(self, message_type: Any, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type)
        self.max_frame_bytes = max_frame_bytes

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        if len(frame) > self.max_frame_bytes:
            raise DecodeError(f"frame of {len(frame)} bytes exceeds {self.max_frame_bytes}")
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeError(str(exc)) from exc

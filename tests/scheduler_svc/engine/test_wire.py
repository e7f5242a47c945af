"""The engine core's messages (scheduler_svc.engine.wire) through the codec: an
`EngineRequest`'s client key (its turn in the waiting queue) is bounded and typed, and a
message from a front end that sends none (an older one) still decodes, as the empty client."""

import msgspec
import pytest

from scheduler_svc.engine.request import SamplingParams
from scheduler_svc.engine.wire import MAX_CLIENT_LEN, EngineRequest, ToEngine
from services import cluster_token
from services.codec import Codec, DecodeError

KEY = b"k" * 32
CODEC: Codec[ToEngine] = Codec(ToEngine, key=KEY)


def engine_request(**fields: object) -> EngineRequest:
    return EngineRequest(frontend=0, handle=1, request_id="r#0.1", token_ids=[5, 6],
                         num_prompt_tokens=2, sampling=SamplingParams().to_spec(),
                         max_tokens=4, min_tokens=0, stop_token_ids=[], ignore_eos=False,
                         **fields)  # type: ignore[arg-type]


def client_index() -> str:
    """Where the decoder's error points for the client field (array-like: by position)."""
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(engine_request()))
    return rf"at `\$\[{len(fields) - 1}\]`"


def with_client(client: object) -> bytes:
    """An EngineRequest's frame whose client field is `client` (any type), tagged."""
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(engine_request()))
    fields[-1] = client
    return _tagged(fields)


def _tagged(fields: list[object]) -> bytes:
    payload = msgspec.msgpack.encode(fields)
    return payload + cluster_token.frame_tag(KEY, payload)


def test_the_client_travels() -> None:
    sent = engine_request(client="tenant-a")
    got = CODEC.decode(CODEC.encode(sent))
    assert isinstance(got, EngineRequest) and got.client == "tenant-a" and got == sent
    assert engine_request().client == ""


def test_a_message_without_the_client_decodes_as_the_empty_client() -> None:
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(engine_request(client="x")))
    assert fields[-1] == "x"
    got = CODEC.decode(_tagged(fields[:-1]))       # what a front end before the field sends
    assert isinstance(got, EngineRequest) and got.client == ""


def test_a_client_past_its_bound_is_refused() -> None:
    assert CODEC.decode(with_client("c" * MAX_CLIENT_LEN)).client == "c" * MAX_CLIENT_LEN
    with pytest.raises(DecodeError, match=f"length <= {MAX_CLIENT_LEN} - {client_index()}"):
        CODEC.decode(with_client("c" * (MAX_CLIENT_LEN + 1)))


@pytest.mark.parametrize("client", [7, None, b"tenant", ["a"]])
def test_a_client_of_another_type_is_refused(client: object) -> None:
    with pytest.raises(DecodeError, match=f"Expected `str`, got .* - {client_index()}"):
        CODEC.decode(with_client(client))

"""Block ids per KV group on the wire (services.wire): one list per group in every message
that carries them, compact for a uniform model (one list), and validated on decode (at least
one and at most MAX_KV_GROUPS lists, each within the per-request limit); the pool's group
windows and the KV events' group likewise."""

import msgspec
import pytest

from services.codec import Codec, DecodeError
from services.kv_wire import (
    AdmitResult,
    BlockStored,
    ConfigurePool,
    FromKvCache,
    GrowOp,
    KvEventBatch,
    PlanReply,
    ToKvCache,
)
from services.wire import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_KV_GROUPS,
    NewRequest,
    RunningRequest,
    SamplingSpec,
    StepInput,
    ToWorker,
)

SPEC = SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=None, num_logprobs=None)


def _step(block_ids: list[list[int]], new_block_ids: list[list[int]]) -> StepInput:
    return StepInput(1, [NewRequest("a", [1, 2, 3], 3, SPEC, block_ids, 0, 3)],
                     [RunningRequest("b", 4, 1, new_block_ids, [])], [])


def test_per_group_lists_round_trip_and_a_uniform_model_sends_one() -> None:
    codec: Codec[StepInput] = Codec(ToWorker)
    hybrid = _step([[1, 2], [0, 3], [0, 4]], [[5], [6], [7]])
    assert codec.decode(codec.encode(hybrid)) == hybrid
    uniform = _step([[1, 2]], [[5]])
    assert codec.decode(codec.encode(uniform)).running[0].new_block_ids == [[5]]
    # A group's list costs one msgpack array header (1 byte) besides its ids: a decode of a
    # two-group model that appends nothing sends [[], []].
    assert len(codec.encode(_step([[1, 2], []], [[5], []]))) == len(codec.encode(uniform)) + 2


@pytest.mark.parametrize("block_ids,new_block_ids", [
    ([], [[5]]),                                       # no list at all
    ([[1]] * (MAX_KV_GROUPS + 1), [[5]]),              # too many lists
    ([[1]], [[5]] * (MAX_KV_GROUPS + 1)),
    ([[1]], []),
    ([[-1]], [[5]]),                                   # a block id out of range
    ([[1]], [[1 << 31]]),
])
def test_bad_group_lists_are_refused(block_ids: list[list[int]],
                                     new_block_ids: list[list[int]]) -> None:
    frame = Codec(ToWorker).encode(_step(block_ids, new_block_ids))
    with pytest.raises(DecodeError):
        Codec(ToWorker).decode(frame)


def test_an_oversize_group_list_is_refused() -> None:
    codec: Codec[StepInput] = Codec(ToWorker)
    at_limit = _step([[1] * MAX_BLOCKS_PER_REQUEST, [1]], [[5], [6]])
    assert len(codec.decode(codec.encode(at_limit)).new_requests[0].block_ids[0]) == \
        MAX_BLOCKS_PER_REQUEST
    with pytest.raises(DecodeError):
        codec.decode(codec.encode(_step([[1], [1] * (MAX_BLOCKS_PER_REQUEST + 1)],
                                        [[5], [6]])))


def test_plan_messages_carry_per_group_lists() -> None:
    codec: Codec[PlanReply] = Codec(FromKvCache)
    reply = PlanReply(1, [[[3], [4]], None], [AdmitResult("a", 4, 2, [[1, 2], [0, 5]], 1)], 7,
                      None, 9)
    assert codec.decode(codec.encode(reply)) == reply
    bad = PlanReply(1, [[]], [], 7, None, 9)                     # a grow with no group list
    with pytest.raises(DecodeError):
        codec.decode(codec.encode(bad))
    grow = GrowOp("a", 12, [], 8)
    to_kv: Codec[GrowOp] = Codec(ToKvCache)
    plan = msgspec.msgpack.encode(["PlanRequest", 0, 1, [], [["GrowOp", "a", 12, []]], []])
    assert to_kv.decode(plan).grows[0].num_computed_tokens == 0   # absent: frees nothing
    assert grow.num_computed_tokens == 8


@pytest.mark.parametrize("windows,ok", [([0], True), ([0, 512, 4096], True), ([], False),
                                        ([0, -1], False), ([0] * (MAX_KV_GROUPS + 1), False)])
def test_pool_group_windows_are_validated(windows: list[int], ok: bool) -> None:
    codec: Codec[ConfigurePool] = Codec(ToKvCache)
    frame = codec.encode(ConfigurePool(0, 8, 4, True, group_windows=windows))
    if ok:
        assert codec.decode(frame).group_windows == windows
    else:
        with pytest.raises(DecodeError):
            codec.decode(frame)
    assert ConfigurePool(0, 8, 4, True).group_windows == [0]        # a uniform full model


def test_kv_events_name_their_group() -> None:
    codec: Codec[KvEventBatch] = Codec(KvEventBatch)
    batch = KvEventBatch(1, 0, 0, [BlockStored([b"x" * 32], 2), BlockStored([b"y" * 32])])
    decoded = codec.decode(codec.encode(batch))
    assert [e.group for e in decoded.events] == [2, 0]
    with pytest.raises(DecodeError):
        codec.decode(codec.encode(KvEventBatch(1, 0, 0, [BlockStored([b"x" * 32],
                                                                     MAX_KV_GROUPS)])))

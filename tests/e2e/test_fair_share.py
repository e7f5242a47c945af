"""The engine's waiting queue shared fairly between clients, through the real services
(issue 40, point 2; scheduler_svc.engine.fair_queue): a flooder on the native API queues
NUM_FLOOD requests of FLOOD_TOKENS tokens under the declared client `flooder` on a replica of
MAX_NUM_SEQS slots, then a control client (`control`) sends one short greedy request.

`--scheduling-policy fair` (the default) admits the control in the next step, taking one of
the flood's slots (scheduler_svc.engine.fair_queue `slots_to_share`): it finishes while
nearly all of the flood still waits (before the CONTROL_BOUND-th flood reply since it came;
the running wave of MAX_NUM_SEQS ends meanwhile). Under
`fcfs`, the queue as it was, the control waits behind every flood request: CONTROL_BOUND
flood replies come first (the whole flood would take a minute more; the test stops there).
The null worker (worker_svc.null_runner, 2 ms steps) keeps the steps short. Measured on the
2-core EPYC: fair, the control took 0.02-0.03 s, 0 or 1 flood replies in that time (0.04-0.13
s and 8 replies when it waited for a slot to free); fcfs, 104 flood replies came and the
control had not finished."""

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.harness import RunningCluster, greedy_request, run_cluster

pytestmark = pytest.mark.e2e

NUM_FLOOD = 1000
FLOOD_TOKENS = 64
CONTROL_TOKENS = 8
MAX_NUM_SEQS = 8
CONTROL_BOUND = 100          # flood replies the control must finish before (fair)
FLOOD = (("splitserve-client", "flooder"),)
CONTROL = (("splitserve-client", "control"),)


@pytest.fixture(scope="module", params=["fair", "fcfs"])
def cluster(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp(f"fair-share-{request.param}"),
                     scheduler_args=("--max-num-seqs", str(MAX_NUM_SEQS),
                                     "--scheduling-policy", request.param),
                     worker_args=("--null-model", "--null-step-ms", "2")) as running:
        yield running


async def _num_queued(stub: generation_pb2_grpc.GenerationStub) -> int:
    info = await stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)
    return sum(r.num_waiting + r.num_running for r in info.replicas)


async def _flood_then_control(address: str, flood_metadata: tuple[tuple[str, str], ...] = FLOOD,
                              control_metadata: tuple[tuple[str, str], ...] = CONTROL,
                              ) -> dict[str, object]:
    """The flood, queued on the engine core; then the control. How many flood replies came
    between the control's start and its end (None: it had not ended by the CONTROL_BOUND-th
    of them)."""
    options = [("grpc.use_local_subchannel_pool", 1)]         # a connection of its own each
    async with grpc.aio.insecure_channel(address, options=options) as flood_channel, \
            grpc.aio.insecure_channel(address, options=options) as control_channel:
        flooder = generation_pb2_grpc.GenerationStub(flood_channel)
        control = generation_pb2_grpc.GenerationStub(control_channel)
        replies: list[float] = []

        async def flood_one(i: int) -> None:
            await flooder.GenerateOnce(greedy_request([5, 6, 7, 8 + i % 100], FLOOD_TOKENS),
                                       metadata=flood_metadata, timeout=300)
            replies.append(time.monotonic())

        flood = [asyncio.ensure_future(flood_one(i)) for i in range(NUM_FLOOD)]
        deadline = time.monotonic() + 60
        while await _num_queued(control) < NUM_FLOOD - len(replies):
            assert time.monotonic() < deadline, "the flood never reached the engine core"
            await asyncio.sleep(0.05)
        num_before = len(replies)
        start = time.monotonic()

        async def control_one() -> tuple[generation_pb2.GenerateResponse, int, float]:
            reply = await control.GenerateOnce(greedy_request([9, 10, 11], CONTROL_TOKENS),
                                               metadata=control_metadata, timeout=300)
            return reply, len(replies), time.monotonic() - start

        controlled = asyncio.ensure_future(control_one())
        while not controlled.done() and len(replies) < num_before + CONTROL_BOUND:
            await asyncio.sleep(0.005)
        outcome: dict[str, object] = {"num_before": num_before,
                                      "num_at_bound": len(replies) - num_before}
        if controlled.done():
            reply, num_replies, outcome["control_s"] = controlled.result()
            outcome["num_replies"] = num_replies - num_before
            outcome["control"] = (len(reply.token_ids), reply.finish_reason)
        else:
            outcome["num_replies"] = None
            controlled.cancel()
        for call in flood:
            call.cancel()
        await asyncio.gather(controlled, *flood, return_exceptions=True)
        return outcome


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "by-connection"])
def test_a_client_is_served_beside_another_clients_flood(cluster: RunningCluster,
                                                         request: pytest.FixtureRequest,
                                                         declared: bool) -> None:
    """Clients declared in the metadata, or, with none declared, told apart by their
    connections (the flood and the control come from one host, on a channel each)."""
    policy = request.node.callspec.params["cluster"]
    outcome = asyncio.run(_flood_then_control(cluster.procs.address) if declared else
                          _flood_then_control(cluster.procs.address, (), ()))
    print(policy, outcome)
    # The flood was queued before the control came (hardly any of it answered yet).
    assert outcome["num_before"] < NUM_FLOOD // 10, outcome
    if policy == "fair":
        assert outcome["control"] == (CONTROL_TOKENS, "length"), outcome
        # Admitted as soon as the first flood requests ended: one wave of them before it.
        assert outcome["num_replies"] is not None, outcome
        assert outcome["num_replies"] < min(CONTROL_BOUND, 3 * MAX_NUM_SEQS), outcome
    else:
        # The old order: the control waits behind the whole flood.
        assert outcome["num_replies"] is None and outcome["num_at_bound"] >= CONTROL_BOUND, \
            outcome

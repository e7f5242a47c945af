"""The live-request registry: one home for every live request, its placement counts (the
router's load measure), delivery, and the one cancel path."""

import threading

import pytest

from scheduler_svc.live_requests import DuplicateRequest, LiveRequests
from scheduler_svc.request import FinishReason, Request, RequestOutput, SamplingParams


class FakeRunner:
    def __init__(self, replica_id: int) -> None:
        self.replica_id = replica_id
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def request(request_id: str, deadline: float | None = None) -> Request:
    r = Request(request_id, [5, 6, 7], SamplingParams(max_tokens=2), (2,), 64, 4, hash_blocks=False)
    r.deadline = deadline
    return r


def final(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [9], "", [None], FinishReason.STOP)


def test_ids_are_unique_while_live() -> None:
    live = LiveRequests()
    live.add(request("a"), lambda out: None)
    with pytest.raises(DuplicateRequest, match="'a' is already in use"):
        live.add(request("a"), lambda out: None)
    live.remove("a")
    live.add(request("a"), lambda out: None)
    assert len(live) == 1 and live.num_parked == 1


def test_place_counts_load_and_a_final_output_ends_the_placement() -> None:
    live = LiveRequests()
    outputs: list[RequestOutput] = []
    runner = FakeRunner(3)
    live.add(request("a"), outputs.append)
    assert live.place("a", runner)
    assert not live.place("a", FakeRunner(4))      # placed already: nobody places it twice
    assert live.num_on(3) == 1 and live.num_parked == 0
    live.deliver([RequestOutput("a", [8], "", [None], None), final("a"), final("ghost")])
    assert [o.new_token_ids for o in outputs] == [[8], [9]]
    assert live.num_on(3) == 0 and len(live) == 0


def test_cancel_parked_ends_it_and_cancel_running_asks_its_engine() -> None:
    live = LiveRequests()
    outputs: list[RequestOutput] = []
    runner = FakeRunner(0)
    live.add(request("parked"), outputs.append)
    live.add(request("running"), outputs.append)
    live.place("running", runner)
    assert live.cancel("parked") and live.cancel("running") and not live.cancel("nobody")
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("parked", FinishReason.ABORT)]
    assert runner.aborted == ["running"]
    # Its replica went down before the abort reached it: handed back, it ends, not re-runs.
    assert not live.unplace("running", runner)
    assert outputs[-1].request_id == "running" and len(live) == 0


def test_unplace_only_from_the_runner_that_holds_it() -> None:
    live = LiveRequests()
    a, b = FakeRunner(0), FakeRunner(1)
    live.add(request("r"), lambda out: None)
    live.place("r", a)
    assert not live.unplace("r", b)
    assert live.unplace("r", a) and live.num_parked == 1 and live.num_on(0) == 0
    assert live.place("r", b) and live.num_on(1) == 1


def test_expired_parked_requests_end_with_an_error() -> None:
    live = LiveRequests()
    outputs: list[RequestOutput] = []
    live.add(request("late", deadline=100.0), outputs.append)
    live.add(request("soon", deadline=10.0), outputs.append)
    live.add(request("placed", deadline=10.0), outputs.append)
    live.place("placed", FakeRunner(0))
    assert live.expire_parked(now=50.0) == 1
    assert [o.request_id for o in outputs] == ["soon"] and "deadline" in (outputs[0].error or "")
    assert [r.request_id for r in live.parked()] == ["late"]


def test_counts_hold_under_threads() -> None:
    """Every change to the counts happens under the registry's lock: four threads placing,
    finishing and re-placing 2,000 requests leave no drift (a lost update would)."""
    live = LiveRequests()
    runners = [FakeRunner(i) for i in range(4)]

    def work(t: int) -> None:
        for i in range(500):
            request_id = f"{t}-{i}"
            live.add(request(request_id), lambda out: None)
            live.place(request_id, runners[i % 4])
            if i % 3 == 0:
                live.unplace(request_id, runners[i % 4])
                live.place(request_id, runners[(i + 1) % 4])
            if i % 2 == 0:
                live.deliver([final(request_id)])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(live) == 4 * 250
    assert sum(live.num_on(r.replica_id) for r in runners) == 4 * 250
    assert live.num_parked == 0
    for t in range(4):
        for i in range(1, 500, 2):
            live.remove(f"{t}-{i}")
    assert len(live) == 0 and all(live.num_on(r.replica_id) == 0 for r in runners)

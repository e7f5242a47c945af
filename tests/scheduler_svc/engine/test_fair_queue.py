"""The fair waiting queue (scheduler_svc.engine.fair_queue) against a reference model: a list
of the admission order rebuilt from scratch after every operation (the requests put back
first, then round-robin over the clients in rotation order). Plus the scheduler's invariant
(draft by iterating, then popleft what was admitted, each the head in turn), one client as a
plain FIFO, and iteration that takes its first requests without walking a huge queue."""

import random
import time
import tracemalloc
from collections import deque
from itertools import islice

import pytest

from scheduler_svc.engine.fair_queue import FairQueue
from scheduler_svc.engine.request import Request, SamplingParams

CLIENTS = ("a", "b", "c", "d")


def request(request_id: str, client: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4), (2,), 1024, 4,
                   hash_blocks=False, client=client)


class Reference:
    """The admission order, spelled out: `fronts` (the last put back first), then each round
    the next request of every client, clients in rotation order; the client served goes to
    the back, a client that runs out leaves, a new one joins after the other newcomers (not
    served since they joined) and before the rest; one whose request is put back in its own
    turn (`putback`) heads its own queue, joining at the back."""

    def __init__(self) -> None:
        self.fronts: list[Request] = []
        self.rotation: list[str] = []
        self.num_new = 0                 # the rotation's first clients: joined, not served
        self.queues: dict[str, list[Request]] = {}

    def order(self) -> list[Request]:
        rounds = max((len(q) for q in self.queues.values()), default=0)
        return self.fronts + [self.queues[c][depth] for depth in range(rounds)
                              for c in self.rotation if depth < len(self.queues[c])]

    def append(self, r: Request) -> None:
        if r.client not in self.rotation:
            self.rotation.insert(self.num_new, r.client)
            self.num_new += 1
            self.queues[r.client] = []
        self.queues[r.client].append(r)

    def promote(self, client: str) -> None:
        if self.rotation.index(client) < self.num_new:
            self.num_new -= 1
        self.rotation.remove(client)
        self.rotation.insert(0, client)
        self.num_new += 1

    def putback(self, r: Request) -> None:
        if r.client not in self.rotation:
            self.rotation.append(r.client)
            self.queues[r.client] = []
        self.queues[r.client].insert(0, r)

    def appendleft(self, r: Request) -> None:
        self.fronts.insert(0, r)

    def popleft(self) -> Request:
        if self.fronts:
            return self.fronts.pop(0)
        client = self.rotation.pop(0)
        self.num_new = max(0, self.num_new - 1)
        r = self.queues[client].pop(0)
        if self.queues[client]:
            self.rotation.append(client)
        else:
            del self.queues[client]
        return r

    def remove(self, r: Request) -> None:
        if r in self.fronts:
            self.fronts.remove(r)
            return
        self.queues[r.client].remove(r)
        if not self.queues[r.client]:
            del self.queues[r.client]
            if self.rotation.index(r.client) < self.num_new:
                self.num_new -= 1
            self.rotation.remove(r.client)


def check(queue: FairQueue, ref: Reference) -> None:
    want = ref.order()
    assert list(queue) == want
    assert len(queue) == len(want) and bool(queue) == bool(want)
    if want:
        assert queue[0] is want[0] and queue[len(want) - 1] is want[-1]
    with pytest.raises(IndexError):
        queue[len(want)]


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    queue, ref = FairQueue(), Reference()
    num_made = 0
    for _ in range(400):
        order = ref.order()
        op = rng.choices(["append", "appendleft", "putback", "promote", "popleft", "remove"],
                         [5, 1, 1, 1, 3, 1])[0]
        if op == "append" or (op != "append" and not order):
            r = request(f"r{num_made}", rng.choice(CLIENTS[:rng.randint(1, len(CLIENTS))]))
            num_made += 1
            queue.append(r)
            ref.append(r)
            # A new request takes its client's next turn: everyone else keeps their order.
            assert [x for x in queue if x is not r] == order
        elif op == "appendleft":      # a request taken earlier is put back (preempted)
            r = request(f"r{num_made}", rng.choice(CLIENTS))
            num_made += 1
            queue.appendleft(r)
            ref.appendleft(r)
        elif op == "promote" and ref.rotation:    # an under-served client goes first
            client = rng.choice(ref.rotation)
            queue.promote(client)
            ref.promote(client)
            assert next(queue.clients_in_turn()) == client
        elif op == "putback":         # preempted so that another client gets its slot
            r = request(f"r{num_made}", rng.choice(CLIENTS))
            num_made += 1
            queue.putback(r)
            ref.putback(r)
        elif op == "popleft":
            got = queue.popleft()
            assert got is ref.popleft() is order[0]
            assert list(queue) == order[1:]     # the draft's order, one turn on
        else:
            r = rng.choice(order)
            queue.remove(r)
            ref.remove(r)
        check(queue, ref)
    while ref.order():
        assert queue.popleft() is ref.popleft()
    assert not queue and len(queue) == 0 and queue.num_clients == 0


def test_a_client_that_joins_waits_behind_newcomers_only_not_a_flood() -> None:
    queue = FairQueue()
    for i in range(1000):
        queue.append(request(f"flood-{i}", "flood"))
    for i in range(3):
        queue.append(request(f"other-{i}", f"other-{i}"))
    late = request("late", "late")
    queue.append(late)
    head = [r.request_id for r in islice(queue, 6)]
    # Every client joined without a turn yet: in the order they came.
    assert head == ["flood-0", "other-0", "other-1", "other-2", "late", "flood-1"]
    queue.popleft()                              # flood-0 was admitted: flood goes last
    queue.popleft()                              # other-0 too: it has none left
    queue.append(request("other-0b", "other-0"))     # it joins again: a newcomer again,
    assert [r.request_id for r in islice(queue, 5)] == [  # ahead of the flood
        "other-1", "other-2", "late", "other-0b", "flood-1"]


def test_drafting_then_popping_the_admitted_finds_each_at_the_head() -> None:
    """The scheduler's contract: the requests a draft took by iterating are the queue's
    first ones, taken one by one with popleft, each `queue[0]` when its turn comes."""
    rng = random.Random(7)
    queue = FairQueue()
    for i in range(300):
        queue.append(request(f"r{i}", rng.choice(CLIENTS)))
        if i % 50 == 0:
            queue.appendleft(request(f"back{i}", rng.choice(CLIENTS)))
    while queue:
        before = list(queue)
        drafted = []
        for r in queue:                  # the draft stops early, as the scheduler's does
            if len(drafted) == rng.randint(1, 9):
                break
            drafted.append(r)
        for r in drafted:
            assert queue[0] is r
            assert queue.popleft() is r
        assert list(queue) == before[len(drafted):]


def test_one_client_is_a_fifo() -> None:
    """One client (or fcfs, where every request is one client's) behaves as the deque the
    scheduler used before: the same order after every operation."""
    rng = random.Random(3)
    for queue in (FairQueue(), FairQueue(fair=False)):
        plain: deque[Request] = deque()
        for i in range(500):
            op = rng.choices(["append", "appendleft", "popleft", "remove"], [5, 1, 3, 1])[0]
            if op == "append" or not plain:
                client = "only" if queue.fair else rng.choice(CLIENTS)   # fcfs ignores it
                r = request(f"r{i}", client)
                queue.append(r)
                plain.append(r)
            elif op == "appendleft":
                r = request(f"r{i}", "only")
                queue.appendleft(r)
                plain.appendleft(r)
            elif op == "popleft":
                assert queue.popleft() is plain.popleft()
            else:
                r = rng.choice(plain)
                queue.remove(r)
                plain.remove(r)
            assert list(queue) == list(plain) and len(queue) == len(plain)


def test_errors_say_what_is_wrong() -> None:
    queue = FairQueue()
    with pytest.raises(IndexError):
        queue.popleft()
    with pytest.raises(IndexError):
        queue[0]
    stranger = request("s", "a")
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(stranger)
    queue.append(request("x", "a"))
    with pytest.raises(ValueError):
        queue.remove(stranger)             # its client is queued, the request is not
    with pytest.raises(IndexError):
        queue[-1]


def test_iteration_takes_its_first_requests_without_walking_a_huge_queue() -> None:
    queue = FairQueue()
    for i in range(100_000):
        queue.append(request(f"flood-{i}", "flood"))
    for client in CLIENTS:
        queue.append(request(client, client))

    def first() -> list[str]:
        return [r.request_id for r in islice(queue, 8)]

    tracemalloc.start()
    try:
        taken = first()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert taken == ["flood-0", "a", "b", "c", "d", "flood-1", "flood-2", "flood-3"]
    assert peak < 64 << 10, peak         # a list of every request would be 800 KB and more
    start = time.perf_counter()
    num_walked = sum(1 for _ in queue)
    walk_s = time.perf_counter() - start
    take_s = min(_timed(first) for _ in range(5))
    assert num_walked == len(queue) == 100_004
    assert take_s < walk_s / 50, (take_s, walk_s)


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start

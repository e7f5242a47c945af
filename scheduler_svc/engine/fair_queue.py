"""The engine core's waiting queue (`Scheduler.waiting`): requests admitted in turn by client,
so that one client's thousands of queued requests hold no other client's request back
behind all of them (issue 40, point 2; `--scheduling-policy fair`).

Admission order: first the requests put back at the front (`appendleft`: preempted, in the
order a deque would hold them), then round-robin over the clients, each client's own
requests first in, first out. A client with one request waits behind at most one request of
each other client. The client whose request is taken goes to the back of the rotation; a
client that joins (its first request while none of its are queued) starts at the back.

What must hold for the scheduler (scheduler_svc.engine.scheduler): iterating the queue
yields the admission order, and taking the head (`popleft`) leaves a queue whose admission
order is the rest of the old one. The draft iterates, then pops what it admitted, and checks
that each is `queue[0]` in turn. The round-robin keeps that: taking the head client's first
request and moving that client to the back is exactly one turn of the rotation.

Iteration is lazy (the draft stops after the few it admits), one O(1) step per request
yielded, whatever the clients' queues hold. With `fair=False` (`--scheduling-policy fcfs`),
or when every request has the same client, it is a plain FIFO: the order of arrival.
"""

from collections import OrderedDict, deque
from collections.abc import Iterator
from itertools import islice

from scheduler_svc.engine.request import Request

SCHEDULING_POLICIES = ("fair", "fcfs")


class FairQueue:
    """Waiting requests, admitted in turn by `Request.client` (one turn for all: not fair)."""

    __slots__ = ("fair", "_fronts", "_clients", "_len")

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self._fronts: deque[Request] = deque()     # put back (preempted): before every turn
        # Each client's requests, oldest first; the dict's order is the rotation's, its first
        # client's turn next. A client with nothing queued is not in it.
        self._clients: OrderedDict[str, deque[Request]] = OrderedDict()
        self._len = 0

    def _key(self, request: Request) -> str:
        return request.client if self.fair else ""

    def append(self, request: Request) -> None:
        """A new (or moved) request, at the end of its client's queue."""
        queue = self._clients.get(self._key(request))
        if queue is None:
            self._clients[self._key(request)] = deque((request,))
        else:
            queue.append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request, before everything (the last put back first, as a deque)."""
        self._fronts.appendleft(request)
        self._len += 1

    def popleft(self) -> Request:
        """Takes the head: a request put back, else the next client's oldest (that client
        goes to the back of the rotation). IndexError when empty."""
        if self._fronts:
            self._len -= 1
            return self._fronts.popleft()
        if not self._clients:
            raise IndexError("pop from an empty waiting queue")
        client, queue = next(iter(self._clients.items()))
        request = queue.popleft()
        if queue:
            self._clients.move_to_end(client)
        else:
            del self._clients[client]
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        """Takes `request` out wherever it waits (an abort); ValueError if it is not here.
        Its client keeps its place in the rotation while it has others queued."""
        if request in self._fronts:
            self._fronts.remove(request)
        else:
            key = self._key(request)
            queue = self._clients.get(key)
            if queue is None:
                raise ValueError(f"request {request.request_id!r} is not waiting")
            queue.remove(request)
            if not queue:
                del self._clients[key]
        self._len -= 1

    def __iter__(self) -> Iterator[Request]:
        """The admission order, lazily: each round takes the next request of every client
        that has one left, in rotation order."""
        yield from self._fronts
        turns: list[Iterator[Request]] = []
        for queue in self._clients.values():      # the first round, one per client
            turn = iter(queue)
            yield next(turn)
            turns.append(turn)
        while turns:
            kept: list[Iterator[Request]] = []
            for turn in turns:
                request = next(turn, None)
                if request is not None:
                    yield request
                    kept.append(turn)
            turns = kept

    def __getitem__(self, index: int) -> Request:
        """The request `index` places from the head in admission order (0: the next one)."""
        if index < 0:
            raise IndexError("the waiting queue is indexed from its head only")
        if index == 0 and (self._fronts or self._clients):    # the head, checked per admission
            return self._fronts[0] if self._fronts else next(iter(self._clients.values()))[0]
        for request in islice(self, index, None):
            return request
        raise IndexError("waiting queue index out of range")

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    @property
    def num_clients(self) -> int:
        """Clients with a request queued in turn (those put back at the front not counted)."""
        return len(self._clients)

"""The engine core's waiting queue (`Scheduler.waiting`): requests admitted in turn by client,
so that one client's thousands of queued requests hold no other client's request back
behind all of them (issue 40, point 2; `--scheduling-policy fair`).

Admission order: first the requests put back at the front (`appendleft`: preempted for
memory, in the order a deque would hold them), then round-robin over the clients, each
client's own requests first in, first out. The client whose request is taken goes to the
back of the rotation; a client that joins (its first request while none of its are queued)
takes its turn before every client already served, after those that joined before it. So a
client with one request waits behind at most the other newcomers', not behind a flood.

When every batch slot is taken, a waiting client that holds at least two fewer running
requests than the client holding most takes one of that client's slots (`slots_to_share`: its
newest idle request is preempted by recompute and heads its own client's queue again,
`putback`; the client served takes the next turn, `promote`), a few per step: a client that
joins runs in the next step instead of waiting for the running requests to end, and the
slots converge to equal shares between the clients that want them.

What must hold for the scheduler (scheduler_svc.engine.scheduler): iterating the queue
yields the admission order, and taking the head (`popleft`) leaves a queue whose admission
order is the rest of the old one. The draft iterates, then pops what it admitted, and checks
that each is `queue[0]` in turn. The round-robin keeps that: taking the head client's first
request and moving that client to the back is exactly one turn of the rotation.

Iteration is lazy (the draft stops after the few it admits), one O(1) step per request
yielded, whatever the clients' queues hold. With `fair=False` (`--scheduling-policy fcfs`),
or when every request has the same client, it is a plain FIFO: the order of arrival.
"""

from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from itertools import islice

from scheduler_svc.engine.request import Request

SCHEDULING_POLICIES = ("fair", "fcfs")
MAX_SHARED_PER_STEP = 4     # slots one step takes from clients that hold more for others
MAX_CLIENTS_SCANNED = 64    # waiting clients a step looks at for that, in turn order


class FairQueue:
    """Waiting requests, admitted in turn by `Request.client` (one turn for all: not fair)."""

    __slots__ = ("fair", "_fronts", "_new", "_served", "_len")

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self._fronts: deque[Request] = deque()     # put back (preempted): before every turn
        # Each client's requests, oldest first, in two parts of the rotation: clients that
        # joined and have not had a turn since (in the order they joined), then the others
        # (the one served last at the back). A client with nothing queued is in neither.
        self._new: OrderedDict[str, deque[Request]] = OrderedDict()
        self._served: OrderedDict[str, deque[Request]] = OrderedDict()
        self._len = 0

    def _key(self, request: Request) -> str:
        return request.client if self.fair else ""

    def _queue_of(self, key: str) -> deque[Request] | None:
        queue = self._new.get(key)
        return queue if queue is not None else self._served.get(key)

    def append(self, request: Request) -> None:
        """A new (or moved) request, at the end of its client's queue. A client that joins
        (none of its requests queued) takes its turn before the clients already served."""
        key = self._key(request)
        queue = self._queue_of(key)
        if queue is None:
            self._new[key] = deque((request,))
        else:
            queue.append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request, before everything (the last put back first, as a deque)."""
        self._fronts.appendleft(request)
        self._len += 1

    def putback(self, request: Request) -> None:
        """A request whose slot went to another client (`slots_to_share`): first of its
        client's queue; a client with none queued joins at the back (it was just served)."""
        key = self._key(request)
        queue = self._queue_of(key)
        if queue is None:
            self._served[key] = deque((request,))
        else:
            queue.appendleft(request)
        self._len += 1

    def popleft(self) -> Request:
        """Takes the head: a request put back, else the next client's oldest (that client
        goes to the back of the rotation). IndexError when empty."""
        if self._fronts:
            self._len -= 1
            return self._fronts.popleft()
        clients = self._new or self._served
        if not clients:
            raise IndexError("pop from an empty waiting queue")
        client, queue = next(iter(clients.items()))
        request = queue.popleft()
        del clients[client]
        if queue:
            self._served[client] = queue
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        """Takes `request` out wherever it waits (an abort); ValueError if it is not here.
        Its client keeps its place in the rotation while it has others queued."""
        if request in self._fronts:
            self._fronts.remove(request)
        else:
            key = self._key(request)
            clients = self._new if key in self._new else self._served
            queue = clients.get(key)
            if queue is None:
                raise ValueError(f"request {request.request_id!r} is not waiting")
            queue.remove(request)
            if not queue:
                del clients[key]
        self._len -= 1

    def __iter__(self) -> Iterator[Request]:
        """The admission order, lazily: each round takes the next request of every client
        that has one left, in rotation order."""
        yield from self._fronts
        turns: list[Iterator[Request]] = []
        for queue in (*self._new.values(), *self._served.values()):   # the first round
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
        if index == 0 and self._len:                  # the head, checked per admission
            if self._fronts:
                return self._fronts[0]
            return next(iter((self._new or self._served).values()))[0]
        for request in islice(self, index, None):
            return request
        raise IndexError("waiting queue index out of range")

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    @property
    def num_put_back(self) -> int:
        """Requests put back at the front (preempted for memory)."""
        return len(self._fronts)

    def clients_in_turn(self) -> Iterator[str]:
        """The clients with requests queued in turn, in the order of their next turns."""
        yield from self._new
        yield from self._served

    def promote(self, client: str) -> None:
        """`client` (queued) takes the next turn."""
        queue = self._served.pop(client, None)
        if queue is not None:
            self._new[client] = queue
        self._new.move_to_end(client, last=False)

    @property
    def num_clients(self) -> int:
        """Clients with a request queued in turn (those put back at the front not counted)."""
        return len(self._new) + len(self._served)


def slots_to_share(waiting: FairQueue, running: list[Request], max_num_seqs: int,
                   limit: int = MAX_SHARED_PER_STEP) -> tuple[list[Request], list[Request]]:
    """Running requests to preempt so that under-served clients run now (fair policy, every
    slot taken), and those to hold back this step so that they can be next step: each
    waiting client, in turn order (the first MAX_CLIENTS_SCANNED), that holds at least two
    fewer running requests than the client holding most takes that client's newest request.
    An idle one is preempted (the first list) and the client goes to the front of the
    rotation, so that this step's admissions take exactly those slots; one in a step in
    flight (async scheduling, the PP batch queue) cannot be, and sits this step out (the
    second list), idle for the next. At most `limit` per step; none under fcfs, nor while
    requests preempted for memory wait."""
    if (not waiting.fair or not waiting or len(running) < max_num_seqs
            or waiting.num_put_back):
        return [], []
    held = Counter(r.client for r in running)
    victims: list[Request] = []
    holding: list[Request] = []
    chosen: list[str] = []
    for client in islice(waiting.clients_in_turn(), MAX_CLIENTS_SCANNED):
        if len(victims) + len(holding) == limit:
            break
        richest, most = held.most_common(1)[0]
        if held[client] + 1 >= most:
            continue                   # it holds its share already
        victim = next((r for r in reversed(running) if r.client == richest
                       and r not in victims and r not in holding), None)
        if victim is None:
            break
        if victim.in_flight:
            holding.append(victim)
        else:
            victims.append(victim)
            chosen.append(client)
        held[richest] -= 1
        held[client] += 1
    for client in reversed(chosen):    # the first chosen ends up first
        waiting.promote(client)
    return victims, holding

"""One replica's torch.distributed group: pipeline links between stages and the TP group of
this rank's stage.

Global rank = pp_rank * tp_size + tp_rank. Every rank receives every StepInput and lays the
step's tokens out identically (the runner sorts them the same way from the same message), so
stage k only sends stage k+1 a one-number header (the row count, or FAILED when the step
failed there, so that the next stage does not wait for activations that never come) and the
hidden states and residual of its last layer: two [num_tokens, hidden_size] tensors, from each
TP rank to the same TP rank of the next stage (after the all-reduce every TP rank of a stage
holds the same activations). Tensors travel as raw bytes: gloo between CPU workers, NCCL
device to device between GPU workers.

Addresses: the rendezvous is `tcp://HOST:PORT` on rank 0's host (the scheduler picks it from
rank 0's advertised address). Its store holds the group's keys unauthenticated, so rank 0
binds it to HOST only (torch's own `init_method` would listen on every interface), and every
rank keeps gloo's (or NCCL's) sockets on the interface that reaches HOST, the internal network,
unless the operator chose one (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
"""

import array
import datetime
import fcntl
import logging
import os
import socket
import struct

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """The replica's ranks did not all join the process group in time."""


class StageFailed(RuntimeError):
    """The previous pipeline stage failed the step this stage was waiting for."""


class PeerLost(RuntimeError):
    """A collective with another rank of the replica failed: the peer is gone (killed, its
    machine lost) or the connection broke. Not the step's fault: the scheduler moves the
    step's requests to another replica instead of failing them."""


def peer_lost(exc: BaseException, what: str) -> PeerLost:
    """`exc`, raised by a torch.distributed call, as a PeerLost that says which call."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return PeerLost(f"{what}: {type(exc).__name__}: {first}")


FAILED = -1   # the header a stage sends in place of a step's row count when it failed the step
SIOCGIFADDR = 0x8915   # Linux ioctl: an interface's IPv4 address


def split_init_method(init_method: str) -> tuple[str, int]:
    """(host, port) of a `tcp://HOST:PORT` rendezvous; an IPv6 host may be in brackets."""
    if not init_method.startswith("tcp://"):
        raise ValueError(f"rendezvous {init_method!r} is not tcp://HOST:PORT")
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def rendezvous_store(host: str, port: int, rank: int, world_size: int,
                     timeout: datetime.timedelta) -> dist.TCPStore:
    """The replica's key-value store: rank 0 serves it on `host` alone (a socket it binds
    itself and hands to torch), the other ranks connect to it. Raises DistStoreError (a
    RuntimeError) when not every rank arrives within `timeout`, OSError when `host:port`
    cannot be bound."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=world_size * 4)
    # torch's server (libuv) takes the descriptor over and closes it when the store goes.
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach())


def interface_towards(host: str) -> str | None:
    """The name of this machine's interface whose IPv4 address is the source of packets to
    `host` (its own address when `host` is local); None where that cannot be told (IPv6, no
    route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))          # UDP: picks the route, sends nothing
            source = probe.getsockname()[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                request = array.array("B", struct.pack("256s", name.encode()[:15]))
                try:
                    fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
                except OSError:               # no IPv4 address on it
                    continue
                if socket.inet_ntoa(request.tobytes()[20:24]) == source:
                    return name
    except OSError:
        return None
    return None


def pin_collective_interface(host: str) -> None:
    """gloo and NCCL open their own listeners for the ranks' pairs: on the interface that
    reaches the rendezvous host (the internal network; loopback on one machine), not on
    whatever the machine's hostname resolves to. An operator's choice stands. Process-wide
    environment, because that is where torch's process groups read it; set before the
    first group exists."""
    name = interface_towards(host)
    if name is None:
        log.warning("cannot tell which interface reaches %s; gloo/NCCL pick their own", host)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", f"={name}")      # exactly this interface


class ParallelGroups:
    """This rank's place in the replica's process group, its PP neighbours and TP group."""

    def __init__(self, init_method: str, pp_rank: int, pp_size: int, tp_rank: int,
                 tp_size: int, timeout_s: float, device: str = "cpu") -> None:
        # The collectives run where the tensors live: NCCL for CUDA tensors, gloo for CPU.
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        self.rank = pp_rank * tp_size + tp_rank
        world_size = pp_size * tp_size
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            host, port = split_init_method(init_method)
            pin_collective_interface(host)
            store = rendezvous_store(host, port, self.rank, world_size, timeout)
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=world_size, timeout=timeout)
        except (RuntimeError, ValueError, OSError) as exc:   # DistStoreError: RuntimeError
            raise RendezvousError(
                f"rank {self.rank} of {world_size} (pp_rank {pp_rank}, tp_rank {tp_rank}): "
                f"not every rank of the replica joined {init_method} within {timeout_s:.0f}s "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Same tp_rank in the previous / next stage.
        self.prev_rank = self.rank - tp_size if pp_rank > 0 else None
        self.next_rank = self.rank + tp_size if pp_rank < pp_size - 1 else None
        # Every rank creates every stage's group, in the same order (torch.distributed rule).
        self.tp_group = None
        for stage in range(pp_size if tp_size > 1 else 0):
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp_rank:
                self.tp_group = group
        log.info("joined %s group %s as rank %d of %d (pp_rank %d/%d, tp_rank %d/%d)",
                 backend, init_method, self.rank, world_size, pp_rank, pp_size, tp_rank,
                 tp_size)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and residual from the previous stage, each [num_tokens, hidden], on
        `device` (NCCL moves them GPU to GPU). Raises `StageFailed` when the previous stage
        failed the step (and sent only that)."""
        assert self.prev_rank is not None
        header = torch.empty(1, dtype=torch.int64, device=device)
        self._recv(header)
        sent = int(header.item())
        if sent == FAILED:
            raise StageFailed(f"pipeline stage {self.pp_rank - 1} failed this step")
        if sent != num_tokens:
            raise RuntimeError(f"the previous stage sent {sent} rows for a step of "
                               f"{num_tokens} tokens")
        tensors = []
        for _ in range(2):
            buf = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
            self._recv(buf.view(torch.uint8))
            tensors.append(buf)
        return tensors[0], tensors[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """This step's activations to the next stage: a header (the row count), then both."""
        assert self.next_rank is not None
        self._send(torch.tensor([hidden.shape[0]], dtype=torch.int64, device=hidden.device))
        for t in (hidden, residual):
            self._send(t.contiguous().view(torch.uint8))

    def send_failure(self) -> None:
        """Tell the next stage this step failed here: a header of FAILED and nothing else."""
        assert self.next_rank is not None
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        self._send(torch.tensor([FAILED], dtype=torch.int64, device=device))

    def _recv(self, t: torch.Tensor) -> None:
        try:
            dist.recv(t, src=self.prev_rank)
        except RuntimeError as exc:   # gloo/NCCL errors, DistError among them
            raise peer_lost(exc, f"receive from pipeline rank {self.prev_rank}") from exc

    def _send(self, t: torch.Tensor) -> None:
        try:
            dist.send(t, dst=self.next_rank)
        except RuntimeError as exc:
            raise peer_lost(exc, f"send to pipeline rank {self.next_rank}") from exc

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

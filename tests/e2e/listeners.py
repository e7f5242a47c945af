"""The TCP sockets a process listens on, read from /proc (Linux): for the tests that hold every
service to its addresses (test_listeners.py, test_multi_host.py).

A socket belongs to a process when one of its file descriptors names the socket's inode; the
address comes from the process's own network namespace (/proc/PID/net/tcp and tcp6), so this
also reads processes in other namespaces (as root)."""

import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

LISTEN = "0A"          # TCP state in /proc/net/tcp
WILDCARDS = {"0.0.0.0", "::"}


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host order (little-endian here).
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir() if fd_dir.is_dir() else ():
        try:
            target = os.readlink(fd)
        except OSError:                  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that process `pid` listens on."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                found.append(_address(fields[1]))
    return sorted(found)


def descendants(pids: Iterable[int]) -> list[int]:
    """`pids` and all their children, grandchildren, ... (from /proc/PID/task/*/children)."""
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass
    return seen


def wildcard_listeners(pids: Iterable[int]) -> dict[int, list[tuple[str, int]]]:
    """The processes (and their descendants) listening on every interface, with those sockets."""
    found = {}
    for pid in descendants(pids):
        if wild := [a for a in listening(pid) if a[0] in WILDCARDS]:
            found[pid] = wild
    return found

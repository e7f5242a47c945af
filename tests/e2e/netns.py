"""Hosts made of Linux network namespaces, for tests of a cluster split across machines.

    with Network.create(["sched", "kv", "w0"]) as net:     # root only; see `unavailable()`
        net.address("sched")            # 10.X.Y.2, that host's one address
        net.popen("sched", argv, ...)   # a process on that host
        net.cut("w0")                   # its link goes down: packets to and from it are lost

Each host is a namespace with one veth whose peer sits on a bridge in a "switch" namespace;
the test process (the root namespace) has a link to the switch too, at .1, so it reaches every
host as a client on another machine would. The bridge lives in a namespace of its own so that
the root namespace's firewall (Docker sets its FORWARD policy to DROP and has bridged frames
pass it) never touches the hosts' traffic. Names carry this process's id: runs side by side do
not meet. Everything made is removed on exit, the processes first.
"""

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    name = f"ssprobe{os.getpid()}"
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        return f"cannot create a network namespace: {exc.stderr.strip()}"
    ip("netns", "del", name)
    return None


@dataclass
class Network:
    hosts: list[str]
    prefix: str                           # "10.X.Y": a /24 of its own
    tag: str                              # in every name this run makes
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @classmethod
    def create(cls, hosts: Sequence[str]) -> "Network":
        pid = os.getpid()
        net = cls(list(hosts), f"10.{200 + pid % 50}.{pid % 250}", f"{pid % 100000}")
        try:
            net._build()
        except BaseException:
            net.remove()
            raise
        return net

    @property
    def switch(self) -> str:
        return f"ss{self.tag}sw"

    def namespace(self, host: str) -> str:
        return f"ss{self.tag}{host}"

    def _veth(self, i: int) -> str:          # the switch's side of host i (15 chars at most)
        return f"ss{self.tag}p{i}"

    def address(self, host: str) -> str:
        return f"{self.prefix}.{self.hosts.index(host) + 2}"

    def _build(self) -> None:
        sw = self.switch
        ip("netns", "add", sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "link", "set", "br0", "up")
        # The test's own link: root namespace <-> switch, at .1.
        ip("link", "add", f"ss{self.tag}r", "type", "veth", "peer", "name", "up0", "netns", sw)
        ip("addr", "add", f"{self.prefix}.1/24", "dev", f"ss{self.tag}r")
        ip("link", "set", f"ss{self.tag}r", "up")
        ip("-n", sw, "link", "set", "up0", "master", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            ip("netns", "add", ns)
            ip("-n", sw, "link", "add", self._veth(i), "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            ip("-n", sw, "link", "set", self._veth(i), "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, host: str, argv: Sequence[str], log: IO[bytes],
              env: dict[str, str]) -> subprocess.Popen[bytes]:
        """`argv` on `host`: `ip netns exec` execs it, so the Popen's pid is the process's."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def cut(self, host: str) -> None:
        """Unplug `host`: its switch port goes down, so nothing reaches it or leaves it."""
        ip("-n", self.switch, "link", "set", self._veth(self.hosts.index(host)), "down")

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", self.namespace(host)], capture_output=True)
        subprocess.run(["ip", "link", "del", f"ss{self.tag}r"], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

"""Child processes a service starts and owns (the scheduler's engine cores and front ends):
started with their settings on stdin, and gone when their parent is.

`spawn` starts `python -m MODULE`, writes one encoded settings message to its stdin and closes
it (settings never go on a command line, where `ps` shows them to everyone). The child calls
`read_settings` once, then `die_with_parent`: Linux kills it the moment the parent dies, however
the parent died, so a SIGKILLed scheduler leaves no engine or front end holding its ports.
`start_child` is that whole start, as a child's `main` makes it.
"""

import ctypes
import logging
import os
import signal
import subprocess
import sys
from typing import Protocol, TypeVar

from services import cluster_token
from services.codec import Codec, DecodeError

log = logging.getLogger(__name__)


class ChildSettings(Protocol):
    parent_pid: int
    log_level: str


Settings = TypeVar("Settings", bound=ChildSettings)

PR_SET_PDEATHSIG = 1      # prctl(2)


def spawn(module: str, settings: bytes, args: tuple[str, ...] = (),
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m module args...` with `settings` on its stdin; its stdout and stderr are
    this process's (a service's log)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                            env=env)
    assert proc.stdin is not None
    try:
        proc.stdin.write(settings)
        proc.stdin.close()
    except BrokenPipeError:      # it died at once; the caller sees it exit
        pass
    return proc


def read_settings(limit: int = 64 << 20) -> bytes:
    """The settings the parent wrote on stdin (at most `limit` bytes)."""
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"settings on stdin exceed {limit} bytes")
    return data


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (pid `parent`, which the parent tells its child:
    a container's PID 1 may be either) exits (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError):      # not Linux: the parent stops its children itself
        pass
    if os.getppid() != parent:
        os._exit(1)                        # the parent died before the request took effect


def start_child(settings_type: type[Settings], child_log: logging.Logger) -> Settings | None:
    """A child's start: SIGINT left to the parent (which stops its children), the cluster
    secret joined, its settings read from stdin and decoded, its life tied to the parent's,
    logging at the settings' level. None (after logging why) when it cannot start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cluster_token.join(child_log) is None:
        return None
    try:
        settings = Codec(settings_type).decode(read_settings())
    except (DecodeError, ValueError) as exc:
        logging.basicConfig()
        child_log.error("bad %s on stdin: %s", settings_type.__name__, exc)
        return None
    die_with_parent(settings.parent_pid)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return settings


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
    """SIGTERM, then SIGKILL after `timeout_s`; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode

"""`python -m services.gpu_claim [--dir DIR] -- COMMAND...`: take a GPU that no other worker
on this host holds, then run COMMAND with only that GPU visible.

Why it exists: compose.gpu.yaml must give each worker container a GPU of its own under
`docker compose up --scale worker=N`, and Docker cannot. A reservation of `count: 1` makes
every container see GPU 0 (Docker turns a count n into devices 0..n-1; it does not hand out
distinct ones), and `device_ids` names the same GPU for every replica of a scaled service. So
each worker container sees every GPU (`count: all`) and starts through this module: it takes
an exclusive lock on `DIR/gpu-<i>.lock` for the first GPU i nobody holds, sets
CUDA_VISIBLE_DEVICES=i and replaces itself with COMMAND (exec), which inherits the locked
descriptor. The lock lasts exactly as long as the worker's process: when it exits or is killed
the kernel drops it, and the next worker can take that GPU. DIR is a volume that every worker
container of the host mounts.

With every GPU held, the claim waits (and logs it once) instead of exiting: a container
restarted by its policy would only find them held again. It takes the first GPU freed.

What it does not do: see GPU users outside DIR (another compose project, a process on the
host), or enforce anything (a worker could still open the other GPUs; the scheduler refuses
a second worker on one GPU by its uuid). GPU numbers are the same in every container only with
the same CUDA_DEVICE_ORDER; compose.gpu.yaml sets PCI_BUS_ID.
"""

import argparse
import fcntl
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.flags import FlagParser

log = logging.getLogger("services.gpu_claim")


def visible_gpus() -> list[str]:
    """The GPUs this process may claim, as CUDA_VISIBLE_DEVICES entries: the entries already
    set (an operator narrowed them), else 0..n-1 for the n GPUs torch sees. torch is imported
    here only: the claim runs once, before the worker imports it again."""
    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if preset is not None:
        return [entry.strip() for entry in preset.split(",") if entry.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def lock_path(lock_dir: Path, gpu: str) -> Path:
    """One lock file per GPU; an entry may be a uuid ("GPU-...") as well as an index."""
    return lock_dir / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '_', gpu)}.lock"


def try_claim(lock_dir: Path, gpus: Sequence[str]) -> tuple[str, int] | None:
    """The first of `gpus` whose lock nobody holds, with the open descriptor that holds it now
    (None: all held). flock locks belong to the open file, so a second open of the same file,
    in this process or another, is refused until the first is closed."""
    for gpu in gpus:
        fd = os.open(lock_path(lock_dir, gpu), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # Who holds it, for an operator reading the file; the pid survives the exec.
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        return gpu, fd
    return None


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = FlagParser(prog="python -m services.gpu_claim", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_flag("--dir", env="GPU_CLAIM_DIR", default="/gpu-claims",
               help="lock directory shared by every worker of this host")
    p.add_argument("--poll", type=float, default=5.0,
                   help="seconds between tries while every GPU is held")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command to run (put it after --)")
    return a, command


def main(argv: list[str] | None = None) -> int:
    a, command = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gpus = visible_gpus()
    if not gpus:
        log.error("no CUDA GPU visible: is the NVIDIA Container Toolkit installed and the "
                  "GPU reservation in place (compose.gpu.yaml)?")
        return 1
    lock_dir = Path(a.dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    waiting = False
    while (claim := try_claim(lock_dir, gpus)) is None:
        if not waiting:
            log.warning("all %d GPU(s) (%s) are held by other workers; waiting for one to be "
                        "freed (scale the workers to at most the GPUs)", len(gpus),
                        ", ".join(gpus))
            waiting = True
        time.sleep(a.poll)
    gpu, fd = claim
    os.set_inheritable(fd, True)    # the worker holds the lock for as long as it runs
    log.info("GPU %s is this worker's (%s); running %s", gpu, lock_path(lock_dir, gpu),
             " ".join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, {**os.environ, "CUDA_VISIBLE_DEVICES": gpu})
    return 1    # not reached: exec replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())

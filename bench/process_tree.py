"""Every process of a cluster and the CPU time each used: the launcher's service processes and
all their descendants (engine cores, front ends, any helper a service spawns), found in /proc
by parent pid, so that processes a service starts show up without the benchmark knowing them.

Each process is labelled by its command line: the module after `-m` (or the script's name),
plus the values of flags that tell processes of one module apart (`--worker-id`, a replica or
front-end index: `DISTINGUISHING`). A process with neither (a multiprocessing child, a fork)
is labelled under its parent (`scheduler_svc/spawn_main`); labels still alike get `#2`, `#3`
in pid order. `TreeCpu` snapshots the tree's CPU seconds (user + system, all threads) by
process; bench/host_ceiling.py reads one snapshot before a timed run and one after.

Linux only. Standard library only: bench/splitserve_runs.py reads its per-process CPU here too.
"""

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Flags whose values tell processes of one module apart: ids, indexes, ranks, replicas,
# front ends ("--worker-id worker0", "--replica 1", "--frontend-index 2").
DISTINGUISHING = re.compile(r"^--(?:[\w-]*-)?(?:id|index|rank|replica|replica-id|"
                            r"front-?end[\w-]*)$")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """What /proc/PID/stat says of one process."""

    pid: int
    ppid: int
    cpu_s: float           # user + system seconds, every thread, so far
    start_ticks: int       # start time since boot (with the pid: one process, never reused)


def parse_stat(text: str, ticks_per_s: float) -> ProcStat:
    """/proc/PID/stat's line; the command name in parentheses may hold spaces and ')'."""
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15, starttime 22.
    return ProcStat(int(head.split("(", 1)[0]), int(fields[1]),
                    (int(fields[11]) + int(fields[12])) / ticks_per_s, int(fields[19]))


def read_stat(pid: int) -> ProcStat | None:
    """The process's stat, None where it is gone."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def descendants(parents: Mapping[int, int], roots: Iterable[int]) -> list[int]:
    """`roots` and every process below them, given each process's parent, in pid order."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [pid for pid in roots if pid in parents]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return sorted(found)


def own_label(argv: Sequence[str]) -> str | None:
    """"module flag-values" from a command line, or None when it names no module or
    script (a fork, a multiprocessing child run with -c)."""
    name = None
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            name = argv[i + 1]
            break
        if arg == "-c":
            return None
        if not arg.startswith("-"):
            name = Path(arg).name
            break
    if name is None:
        return None
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if DISTINGUISHING.match(arg)]
    values += [arg.split("=", 1)[1] for arg in argv
               if "=" in arg and DISTINGUISHING.match(arg.split("=", 1)[0])]
    return " ".join([name, *values])


def child_label(argv: Sequence[str], comm: str) -> str:
    """A process without a module of its own: the name it gave itself (a command name that is
    not the interpreter's), else the multiprocessing entry point its -c code names, else its
    command name."""
    if not comm.startswith("python"):
        return comm
    match = re.search(r"(spawn_main|forkserver|resource_tracker)", " ".join(argv))
    return match.group(1) if match else comm


def tree_labels(pids: Sequence[int], parents: Mapping[int, int],
                argvs: Mapping[int, Sequence[str]], comms: Mapping[int, str]) -> dict[int, str]:
    """Every pid's label (module docstring); a parent's label is made before its children's
    whatever their pids."""
    labels: dict[int, str] = {}

    def label_of(pid: int) -> str:
        if pid not in labels:
            argv = argvs.get(pid, ())
            label = own_label(argv)
            parent = parents.get(pid, -1)
            above = label_of(parent) if parent in pid_set else None
            if above is not None and (label is None or label == above):
                label = f"{above}/{child_label(argv, comms.get(pid, '?'))}"
            labels[pid] = label or child_label(argv, comms.get(pid, "?"))
        return labels[pid]

    pid_set = set(pids)
    unique: dict[int, str] = {}
    seen: dict[str, int] = {}
    for pid in sorted(pids):
        label = label_of(pid)
        count = seen[label] = seen.get(label, 0) + 1
        unique[pid] = label if count == 1 else f"{label}#{count}"
    return unique


class TreeCpu:
    """The process trees under `roots`: one snapshot of each process's CPU seconds."""

    def __init__(self, roots: Iterable[int]) -> None:
        self.roots = list(roots)

    def snapshot(self) -> dict[tuple[int, int], tuple[str, float]]:
        """(pid, start ticks) -> (label, CPU seconds so far), for every process now alive."""
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := read_stat(int(entry))) is not None:
                stats[stat.pid] = stat
        pids = descendants({pid: s.ppid for pid, s in stats.items()}, self.roots)
        argvs, comms = {}, {}
        for pid in pids:
            try:
                argvs[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                    errors="replace").split("\0")[:-1]
                comms[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue                      # ended meanwhile: labelled by what is known
        labels = tree_labels(pids, {pid: stats[pid].ppid for pid in pids}, argvs, comms)
        return {(pid, stats[pid].start_ticks): (labels[pid], stats[pid].cpu_s) for pid in pids}


def cpu_used(before: Mapping[tuple[int, int], tuple[str, float]],
             after: Mapping[tuple[int, int], tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each process used between two snapshots, by label: a process started in
    between counts from 0; one that ended in between is lost (its time with it)."""
    return {label: cpu - before.get(key, (label, 0.0))[1]
            for key, (label, cpu) in sorted(after.items())}

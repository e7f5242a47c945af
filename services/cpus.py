"""How many CPUs this process may really use: its affinity mask, capped by a container's CPU
quota (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`).

`os.cpu_count()` counts the host's cores. A worker in a container limited to 2 CPUs on a
64-core host that starts 64 threads runs them in 2 CPUs' worth of time slices, and its
threads wait for each other at every barrier; so the default thread count comes from here.
"""

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs (1.5 = one
    and a half), or None where none is set or it cannot be read."""
    quotas = []
    directory = _own_cgroup_dir(root)
    while directory is not None:
        try:                                        # v2: "max 100000" or "150000 100000"
            quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except (OSError, ValueError, ZeroDivisionError):
            pass
        directory = directory.parent if directory != root else None
    try:                                            # v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            quotas.append(quota_us / period_us)
    except (OSError, ValueError):
        pass
    return min(quotas) if quotas else None


def _own_cgroup_dir(root: Path) -> Path | None:
    """The cgroup v2 directory of this process (`0::/path` in /proc/self/cgroup), or the root
    (inside a container the root is the container's own)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].strip("/")
                return own if own.is_dir() else root
    except OSError:
        pass
    return root

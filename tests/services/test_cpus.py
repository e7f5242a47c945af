"""CPUs a process may use: affinity capped by a cgroup CPU quota (fake cgroup trees)."""

import os
from pathlib import Path

from services.cpus import available_cpus, cgroup_cpu_quota


def test_no_quota_means_the_affinity_mask(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None
    assert available_cpus(tmp_path) == len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_a_v2_quota_caps_the_count(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")      # 1.5 CPUs
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("20000 100000\n")       # a fifth: still one thread
    assert available_cpus(tmp_path) == 1


def test_a_v1_quota_caps_the_count(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.0
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_cpu_quota(tmp_path) is None


def test_unreadable_values_are_no_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert cgroup_cpu_quota(tmp_path) is None

"""bench/process_tree.py: a cluster's processes found by parent pid, labelled by command line,
and their CPU time between two snapshots."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.process_tree import (
    TreeCpu,
    cpu_used,
    descendants,
    own_label,
    parse_stat,
    tree_labels,
)

PY = "/usr/bin/python3.11"


def test_parse_stat_takes_fields_after_the_last_parenthesis() -> None:
    fields = ["S", "42"] + ["0"] * 9 + ["250", "50"] + ["0"] * 6 + ["12345", "0"]
    stat = parse_stat("7 (a) b (c)) " + " ".join(fields), 100.0)
    assert (stat.pid, stat.ppid, stat.cpu_s, stat.start_ticks) == (7, 42, 3.0, 12345)


def test_descendants_walk_every_level_and_nothing_else() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants(parents, [10]) == [10, 11, 12, 13]
    assert descendants(parents, [10, 21, 99]) == [10, 11, 12, 13, 21]


def test_own_label_is_the_module_and_its_distinguishing_flags() -> None:
    assert own_label([PY, "-m", "scheduler_svc", "--port", "1", "--tp", "2"]) == "scheduler_svc"
    assert own_label([PY, "-m", "worker_svc", "--model", "m", "--worker-id", "worker1"]) \
        == "worker_svc worker1"
    assert own_label([PY, "-m", "x", "--replica=2", "--frontend-index", "0"]) == "x 0 2"
    assert own_label([PY, "-u", "bench/run.py", "--rank", "3"]) == "run.py 3"
    assert own_label([PY, "-c", "from multiprocessing.spawn import spawn_main"]) is None


def test_tree_labels_put_forks_and_spawned_children_under_their_parent() -> None:
    scheduler = [PY, "-m", "scheduler_svc", "--port", "5"]
    spawned = [PY, "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
               "--multiprocessing-fork"]
    argvs = {100: scheduler, 101: spawned, 102: spawned, 103: scheduler,
             104: [PY, "-m", "scheduler_svc.engine", "--replica", "0"], 105: spawned}
    comms = {pid: "python3.11" for pid in argvs} | {105: "engine-core-1"}
    parents = {100: 1, 101: 100, 102: 100, 103: 100, 104: 100, 105: 104}
    labels = tree_labels(sorted(argvs), parents, argvs, comms)
    assert labels == {100: "scheduler_svc", 101: "scheduler_svc/spawn_main",
                      102: "scheduler_svc/spawn_main#2", 103: "scheduler_svc/python3.11",
                      104: "scheduler_svc.engine 0", 105: "scheduler_svc.engine 0/engine-core-1"}
    # A child listed before its parent (pids wrap around) still gets its parent's label.
    assert tree_labels([5, 900], {5: 900, 900: 1}, {5: spawned, 900: scheduler},
                       {5: "python3", 900: "python3"})[5] == "scheduler_svc/spawn_main"


def test_cpu_used_counts_new_processes_from_zero() -> None:
    before = {(1, 10): ("a", 2.0), (2, 20): ("gone", 5.0)}
    after = {(1, 10): ("a", 2.5), (3, 30): ("new", 0.25)}
    assert cpu_used(before, after) == {"a": 0.5, "new": 0.25}


def test_a_live_tree_is_found_and_labelled(tmp_path: Path) -> None:
    (tmp_path / "child.py").write_text("import time\nwhile True:\n    time.sleep(0.01)\n")
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, 'child.py', "
            "'--replica', '3']); time.sleep(30)")
    root = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, start_new_session=True)
    try:
        tree = TreeCpu([root.pid])
        deadline = time.monotonic() + 20
        while len(snapshot := tree.snapshot()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        labels = sorted(label for label, _ in snapshot.values())
        assert len(labels) == 2 and "child.py 3" in labels, labels
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()

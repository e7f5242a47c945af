"""The local launcher's split of this machine's CPUs among the workers it starts."""

from services.cpus import available_cpus
from services.launcher import ClusterSpec, ServiceProcesses


def test_workers_share_the_cpus_instead_of_each_taking_all() -> None:
    cpus = available_cpus()
    assert ServiceProcesses(ClusterSpec()).threads_per_worker == cpus
    two = ServiceProcesses(ClusterSpec(tp=2))
    assert two.threads_per_worker == max(1, cpus // 2)
    many = ServiceProcesses(ClusterSpec(pp=2, num_replicas=4 * cpus))
    assert many.threads_per_worker == 1
    assert ServiceProcesses(ClusterSpec(tp=2, threads_per_worker=3)).threads_per_worker == 3

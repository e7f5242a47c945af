"""Fakes for the membership and router tests: an engine that records what it is given."""

from scheduler_svc.membership import Membership
from scheduler_svc.placement import Replica, ReplicaState


class FakeEngine:
    """What the cluster reads of a ReplicaEngine, and what it calls."""

    def __init__(self, replica_id: int) -> None:
        self.replica_id = replica_id
        self.kv_ok = True
        self.submitted: list[str] = []
        self.failed_over: str | None = None
        self.accepts = True

    def submit(self, request) -> bool:  # type: ignore[no-untyped-def]
        if not self.accepts:
            return False
        self.submitted.append(request.request_id)
        return True

    def fail_over(self, reason: str) -> None:
        self.failed_over = reason

    def stop(self) -> None:
        pass


class NoSocket:
    def close(self) -> None:
        pass


def add_replica(cluster: Membership, engine: FakeEngine) -> None:
    replica_id = engine.replica_id
    replica = Replica(replica_id, 1, NoSocket())  # type: ignore[arg-type]
    replica.engine = engine  # type: ignore[assignment]
    replica.state = ReplicaState.READY
    cluster.replicas[replica_id] = replica

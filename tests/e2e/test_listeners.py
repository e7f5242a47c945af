"""No service listens on every interface unless told to: a local cluster with a tp=2 replica
(whose first rank runs torch.distributed's rendezvous store) binds every socket of every
process, the rendezvous and gloo's included, to the addresses it was given (127.0.0.1 here).
Once, torch's store listened on `:::PORT`, unauthenticated, for anyone on the host's network.
"""

from pathlib import Path

import pytest

from tests.e2e.harness import greedy_request, run_cluster, stream_tokens
from tests.e2e.listeners import listening, wildcard_listeners

pytestmark = pytest.mark.e2e


def test_no_service_listens_on_a_wildcard_address(tmp_path: Path) -> None:
    with run_cluster(tmp_path, tp=2) as cluster:
        ids, _, _ = stream_tokens(cluster.stub, greedy_request([1, 504, 3458, 282], 4))
        assert len(ids) == 4                     # the ranks met: the store was up
        pids = [p.pid for p in cluster.procs.procs.values()]
        everything = {name: listening(p.pid) for name, p in cluster.procs.procs.items()}
        assert wildcard_listeners(pids) == {}, everything
        for name, sockets in everything.items():
            assert sockets and {host for host, _ in sockets} == {"127.0.0.1"}, (name, sockets)

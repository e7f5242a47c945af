"""Whose call a request is, for its turn in its engine core's waiting queue (clients take
turns: scheduler_svc.engine.fair_queue): the client declared in the gRPC metadata
`splitserve-client` (http_svc declares its HTTP client's host), else the API key's owner,
else the peer's address with its port: a connection (one gRPC channel) is a client, so two
programs on one host take turns too.

A declared id is trusted: it only orders the queue. A caller that declares many gets a turn
for each, as that many clients would; with keys, ids are names within the key (prefixed with
its owner's digest), so no caller joins another key's queue.
"""

from collections.abc import Sequence

from scheduler_svc.engine.wire import MAX_CLIENT_LEN
from scheduler_svc.frontend.validation import InvalidRequest
from services.api_keys import CLIENT_METADATA_KEY, MAX_DECLARED_CLIENT_LEN, Owner


def call_client(metadata: Sequence[tuple[str, str]] | None, owner: Owner | None,
                peer: str) -> str:
    """Whose call this is, for its requests' turn (module docstring); InvalidRequest for a
    declared id past MAX_DECLARED_CLIENT_LEN."""
    declared = next((v for k, v in metadata or () if k == CLIENT_METADATA_KEY), "")
    if len(declared) > MAX_DECLARED_CLIENT_LEN:
        raise InvalidRequest(f"metadata '{CLIENT_METADATA_KEY}' is {len(declared)} "
                             f"characters long; at most {MAX_DECLARED_CLIENT_LEN}")
    if owner is not None:
        return f"{owner[:16]}/{declared}" if declared else owner
    if declared:
        return declared
    return peer[:MAX_CLIENT_LEN]

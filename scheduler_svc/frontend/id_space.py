"""Each API key's own request-id space (scheduler_svc.frontend.servicer's mapping).

With API keys on, two keys may use the same request id at the same time, and neither may
learn that the other's id exists: the servicer runs a keyed client's request under the
internal id `<owner tag>/<client id>`, the tag being the first `TAG_LEN` hex digits of the
key's digest (services.api_keys.Owner; never the key). The core, its live table, the engine
ids and n > 1's choice ids (`<internal id>-<i>`) all use the internal id; an Abort looks up
the caller's own internal id only; responses and error messages name the client's id.

64 bits of digest tell a server's few configured keys apart (a clash between two keys is
about as likely as guessing one of them). Without keys, ids are used as they come.

The tag counts towards the id's length limit (services.wire.MAX_ID_LEN), so a keyed client's
ids may be `TAG_LEN + 1` characters shorter; `check_length` says so by the client's figures.
"""

import uuid

from scheduler_svc.frontend.validation import MAX_CHOICE_SUFFIX, InvalidRequest
from services.api_keys import Owner
from services.wire import MAX_ID_LEN

TAG_LEN = 16                           # hex digits of the owner's digest
SEPARATOR = "/"


def internal_id(owner: Owner | None, client_id: str) -> str:
    """The id the front end runs a request of `client_id` under; `client_id` itself when
    `owner` is None or empty (no keys)."""
    if not owner:
        return client_id
    return f"{owner[:TAG_LEN]}{SEPARATOR}{client_id}"


def max_client_len(owner: Owner | None, n: int = 1) -> int:
    """The longest id a client of `owner` may send for a request with `n` choices."""
    limit = MAX_ID_LEN - (MAX_CHOICE_SUFFIX if n > 1 else 0)
    return limit - (TAG_LEN + len(SEPARATOR) if owner else 0)


def check_length(owner: Owner | None, client_id: str, n: int = 1) -> None:
    """InvalidRequest naming the client's own limit, before the internal id would trip the
    core's (which counts the tag)."""
    limit = max_client_len(owner, n)
    if owner and len(client_id) > limit:
        extra = ": with n > 1 each choice's id adds a suffix" if n > 1 else ""
        raise InvalidRequest(f"request_id longer than {limit} characters{extra}")


def client_request_id(owner: Owner | None, client_id: str) -> str:
    """The id a keyed client's request goes by: its own, or a fresh one where it sent none
    (the core would make one, but keyed, the client's must be known before the tag is
    added). Without keys, `client_id` unchanged (the core fills an empty one in)."""
    return client_id or (uuid.uuid4().hex if owner else "")


def client_message(message: str, internal: str, client_id: str) -> str:
    """An error message from the core with the internal id replaced by the client's."""
    if internal == client_id:
        return message
    return message.replace(repr(internal), repr(client_id)).replace(internal, client_id)

"""The clients' API keys: who may use the public APIs (the scheduler's gRPC `Generation`
service and http_svc's OpenAI-compatible HTTP API).

Keys come from `--api-key` (repeatable) or `SPLITSERVE_API_KEY` (comma-separated; the flag
wins, as for every flag). No key configured: both APIs are open, as they always were.

A client presents its key the way OpenAI's and vLLM's clients do, `Authorization: Bearer
<key>`: an HTTP header, or the gRPC metadata `authorization` with the same value. http_svc
passes its client's header on to the scheduler, so one key list serves both.

`ApiKeys.check` compares the SHA-256 digest of what was presented with every configured key's
digest, each with `hmac.compare_digest` and always all of them: how long a check takes says
nothing of how much of a key was right, nor which key matched. The digest (`Owner`, hex) also
names the client whose request an Abort may cancel; the key itself is never stored with a
request, logged or echoed in an error.

Not the cluster token (services.cluster_token): that one guards the internal plane.
"""

import argparse
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Any

METADATA_KEY = "authorization"     # gRPC metadata keys are lower case
# The client a caller declares (gRPC metadata), for its requests' turn in the engine cores'
# waiting queues (scheduler_svc.frontend.call_client); http_svc declares each HTTP client's.
CLIENT_METADATA_KEY = "splitserve-client"
MAX_DECLARED_CLIENT_LEN = 128       # characters of a declared client id
SCHEME = "bearer"                  # matched case-insensitively, as HTTP auth schemes are
ENV = "SPLITSERVE_API_KEY"

Owner = str                        # a key's digest, hex: who made a request

MISSING = ("no API key was presented: send 'Authorization: Bearer <key>' (HTTP header or "
           "gRPC metadata 'authorization')")
INVALID = "the API key presented is not valid"


def digest(key: str) -> bytes:
    return hashlib.sha256(b"splitserve api key\0" + key.encode()).digest()


def key_list(text: str) -> tuple[str, ...]:
    """`--api-key`'s value or SPLITSERVE_API_KEY's: one key or several, comma-separated.
    Refuses an empty key and one with spaces or characters a header cannot carry."""
    keys = tuple(part.strip() for part in text.split(","))
    for i, key in enumerate(keys):
        if not key:
            raise argparse.ArgumentTypeError(f"API key {i + 1} of {len(keys)} is empty")
        if not all("!" <= c <= "~" for c in key):
            raise argparse.ArgumentTypeError(
                f"API key {i + 1} of {len(keys)} has a space or a character outside "
                f"printable ASCII (a header value cannot carry it)")
    return keys


class AppendKeys(argparse.Action):
    """`--api-key K`, repeatable, each value possibly comma-separated. The first one on the
    command line replaces the environment's keys (flag over variable), later ones add."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest)
        given = tuple(values)
        if current is self.default or current is None:
            setattr(namespace, self.dest, given)
        else:
            setattr(namespace, self.dest, tuple(current) + given)


def bearer(value: str | bytes | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value; None if absent or another
    scheme."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != SCHEME or not token:
        return None
    return token


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token of gRPC invocation metadata (its first `authorization` entry)."""
    for name, value in metadata or ():
        if name == METADATA_KEY:
            return bearer(value)
    return None


def call_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """`metadata=` for a call to the public gRPC API with `key` (none: empty)."""
    return () if key is None else ((METADATA_KEY, f"Bearer {key}"),)


class ApiKeys:
    """The configured keys, kept as digests. Falsy when none is configured (the APIs are
    open)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._digests = tuple(dict.fromkeys(digest(k) for k in keys))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, presented: str | None) -> Owner | None:
        """The presented key's owner if it is one of ours, else None. Constant time in what
        was presented: every configured key is compared, matched or not."""
        if presented is None:
            return None
        candidate = digest(presented)
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(candidate, known)
        return candidate.hex() if matched else None

    def refusal(self, presented: str | None) -> str | None:
        """Why a call is refused (None: it is not): no key, or a key that is not ours."""
        if not self._digests:
            return None
        if presented is None:
            return MISSING
        return None if self.check(presented) is not None else INVALID

    def owner(self, presented: str | None) -> Owner | None:
        """Who made a request: its key's digest; None when keys are off (nobody owns)."""
        return self.check(presented) if self._digests else None

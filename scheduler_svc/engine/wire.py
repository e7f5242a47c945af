"""The engine core's messages: with the front ends (requests in, one packed output message per
step out) and with the cluster process (how the engine core is started, what it reports).

MessagePack-encoded msgspec structs on the base and limits of `services.wire`, decoded by
`services.codec` (type and size validation, the cluster's frame tag); never pickled. Arrays of
a step's rows travel as packed little-endian bytes (`pack_ints` / `unpack_ints`): one buffer
each, decoded without a Python object per row, their lengths checked by the receiver.

Front end -> engine core (its command socket, a PULL): `FrontendHello` first, then
`EngineRequest` (a request to run, new or moved off a lost replica) and `EngineAbort`;
`GrammarVocabulary` once before the first request with a grammar. The cluster sends
`EngineStop` on the same socket.
Engine core -> front end (the front end's output socket, a PULL): `EngineOutputs`, one per
step that produced something for that front end's requests; its `down` says the engine core
stops and every request it still held must move.
Engine core -> cluster (the cluster's report socket): `EngineReport`.
Cluster -> engine core (its stdin, once): `EngineLaunch`.
"""

from typing import Annotated

import numpy as np
from msgspec import Meta

from scheduler_svc.engine.config import EngineConfig
from services.kv_wire import Epoch
from services.wire import (
    MAX_ID_LEN,
    MAX_REQUESTS_PER_STEP,
    Count,
    RequestId,
    SamplingSpec,
    TokenId,
    TokenIds,
    TokenLogprobs,
    _Wire,
)

MAX_FRONTENDS = 256                  # front-end processes of one scheduler
MAX_GRAMMAR_BYTES = 32 << 20         # a compiled grammar (xgrammar's JSON)
MAX_VOCABULARY_BYTES = 256 << 20     # a tokenizer's vocabulary for grammars (xgrammar's JSON)
MAX_STOP_TOKEN_IDS = 1024            # token ids one request stops at
MAX_REASON_LEN = 4096                # characters of an error or a reason to stop
MAX_CLIENT_LEN = 256                 # characters of a client key (EngineRequest.client)

Handle = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]   # a request, as its front end knows it
FrontendIndex = Annotated[int, Meta(ge=0, lt=MAX_FRONTENDS)]
Address = Annotated[str, Meta(min_length=1, max_length=256)]   # a ZMQ endpoint
Reason = Annotated[str, Meta(max_length=MAX_REASON_LEN)]
# Packed rows: little-endian int64 (handles) or int32 (token ids).
PackedRows = Annotated[bytes, Meta(max_length=8 * MAX_REQUESTS_PER_STEP)]


def pack_ints(values: list[int] | np.ndarray, dtype: str) -> bytes:
    """`values` as a packed little-endian array ("<i8" or "<i4")."""
    return np.asarray(values, dtype=dtype).tobytes()


def unpack_ints(data: bytes, dtype: str, count: int, what: str) -> np.ndarray:
    """A packed array of exactly `count` values; ValueError naming `what` otherwise."""
    itemsize = np.dtype(dtype).itemsize
    if len(data) != count * itemsize:
        raise ValueError(f"{what}: {len(data)} bytes for {count} values of {itemsize} bytes")
    return np.frombuffer(data, dtype=dtype)


# --------------------------------------------------------------------------- front end -> engine


class FrontendHello(_Wire):
    """Where a front end takes its requests' outputs. Sent first on each connection; a new
    `epoch` for the same index is a restarted front end: the requests of its earlier
    incarnation are aborted (their client streams are gone)."""

    frontend: FrontendIndex
    epoch: Epoch                        # the front end's start time (ns)
    output_address: Address             # its output PULL socket


class EngineRequest(_Wire):
    """A request to run: new, or moved off a lost replica with the outputs its client
    already has (they follow the prompt in `token_ids`)."""

    frontend: FrontendIndex
    handle: Handle                      # unique per front end; names the request's outputs
    request_id: RequestId               # the engine's id for it (kvcache_svc, workers, logs)
    token_ids: TokenIds                 # prompt, then outputs so far
    num_prompt_tokens: Annotated[int, Meta(ge=1, lt=1 << 31)]
    sampling: SamplingSpec              # what the workers sample with
    max_tokens: Annotated[int, Meta(ge=1, lt=1 << 31)]    # outputs in all, those so far included
    min_tokens: Annotated[int, Meta(ge=0, lt=1 << 31)]    # before EOS or a stop id may end it
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
    ignore_eos: bool
    cache_salt: Annotated[bytes, Meta(max_length=256)] = b""   # in block 0's hash
    # Structured output: the compiled grammar (xgrammar's serialized JSON) the outputs must
    # follow; the engine advances it over the outputs so far first. None: free text.
    grammar: Annotated[bytes, Meta(max_length=MAX_GRAMMAR_BYTES)] | None = None
    # Whose request it is, for its turn in the waiting queue (scheduler_svc.engine.fair_queue;
    # the front end sets it per call). Last, with a default: an older front end's message
    # still decodes, all of its requests one client.
    client: Annotated[str, Meta(max_length=MAX_CLIENT_LEN)] = ""


class EngineAbort(_Wire):
    """End these requests (the client went away, a stop string matched, Abort), named by
    their `EngineRequest.request_id`."""

    request_ids: Annotated[list[RequestId], Meta(max_length=MAX_REQUESTS_PER_STEP)]


class GrammarVocabulary(_Wire):
    """The tokenizer's vocabulary as xgrammar needs it for grammars (its TokenizerInfo's
    serialized JSON), sent by a front end before its first request with a grammar."""

    vocabulary: Annotated[bytes, Meta(max_length=MAX_VOCABULARY_BYTES)]


class EngineStop(_Wire):
    """From the cluster: the replica is going down (a worker was lost); stop."""

    reason: Reason


class StatsRequest(_Wire):
    """From the cluster: report your counters now (ServerInfo wants them fresh)."""

    seq: Count                          # echoed in the EngineReport


ToEngine = (FrontendHello | EngineRequest | EngineAbort | GrammarVocabulary | EngineStop
            | StatsRequest)

# --------------------------------------------------------------------------- engine -> front end


Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]   # a duration (NaN and inf are refused)


class Timing(_Wire, frozen=True):
    """Where a finished request's time went on its engine core (vLLM's request phases), in
    seconds on the engine core's clock: durations, not instants, so no two processes'
    clocks are compared."""

    queued_s: Seconds                   # arrival on this engine core -> first scheduled
    prefill_s: Seconds                  # first scheduled -> first token
    decode_s: Seconds                   # first token -> last token
    inference_s: Seconds                # first scheduled -> last token


class Finished(_Wire):
    """How one request ended in this step (its last token, if any, is in the step's rows)."""

    handle: Handle
    reason: Annotated[str, Meta(max_length=16)]   # "stop", "length" or "abort"
    stop_token_id: TokenId | None       # the stop token id that ended it, if one did
    num_prompt_tokens: Count
    num_output_tokens: Count
    num_cached_tokens: Count            # prompt tokens served from the prefix cache or store
    num_store_loaded_tokens: Count      # of those, loaded from the KV store
    error: Reason | None = None         # it ended without finishing (a failed step, ...)
    server_fault: bool = False          # the error is the server's (INTERNAL)
    invalid: bool = False               # it can never run on this replica (INVALID_ARGUMENT)
    timing: Timing | None = None        # None: it was never scheduled here


class RowLogprobs(_Wire):
    row: Annotated[int, Meta(ge=0, lt=MAX_REQUESTS_PER_STEP)]   # index into the step's rows
    logprobs: TokenLogprobs


class HandlePromptLogprobs(_Wire):
    """A request's prompt logprobs, on its first output: per prompt token from the second."""

    handle: Handle
    token_ids: TokenIds
    logprobs: Annotated[list[TokenLogprobs], Meta(max_length=1 << 20)]
    ranks: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(max_length=1 << 20)]


class EngineOutputs(_Wire):
    """What one step produced for one front end's requests."""

    replica_id: Count
    engine_epoch: Epoch                 # the engine core instance that sent it
    num_rows: Annotated[int, Meta(ge=0, le=MAX_REQUESTS_PER_STEP)]
    handles: PackedRows                 # int64 per row: whose token it is
    token_ids: PackedRows               # int32 per row: the token
    finished: Annotated[list[Finished], Meta(max_length=MAX_REQUESTS_PER_STEP)] = []
    logprobs: Annotated[list[RowLogprobs], Meta(max_length=MAX_REQUESTS_PER_STEP)] = []
    prompt_logprobs: Annotated[list[HandlePromptLogprobs],
                               Meta(max_length=MAX_REQUESTS_PER_STEP)] = []
    # The engine core stops: every request of this front end it held and did not finish
    # above must run elsewhere (its outputs so far were all sent before this message).
    down: Reason | None = None


FromEngine = EngineOutputs

# --------------------------------------------------------------------------- engine <-> cluster


class EngineLaunch(_Wire):
    """What the cluster hands a new engine core process on its stdin."""

    config: EngineConfig
    engine_epoch: Epoch                 # this engine core instance
    parent_pid: Count                   # the cluster process (the engine dies with it)
    worker_output_address: Address      # where the replica's ranks send (bound here)
    report_address: Address             # the cluster's report socket
    kvcache_address: Address
    worker_step_addresses: Annotated[list[Address], Meta(max_length=1 << 10)]  # rank order
    tp_size: Annotated[int, Meta(ge=1, lt=1 << 10)]
    # The interface of its command socket: the cluster's internal one (its front ends and the
    # cluster are on this host).
    command_host: Annotated[str, Meta(min_length=1, max_length=255)] = "127.0.0.1"
    log_level: Annotated[str, Meta(max_length=16)] = "info"


class EngineStats(_Wire, frozen=True):
    """An engine core's counters, reported to the cluster (ServerInfo, /metrics)."""

    num_kv_blocks: Count                 # the replica's pool, null block included
    num_usable_blocks: Count             # num_kv_blocks - 1: the null block holds nothing
    num_free_blocks: Count
    num_running: Count
    num_waiting: Count
    num_preemptions: Count               # since the engine started
    num_steps: Count
    num_kv_recoveries: Count             # pools re-created in kvcache_svc
    kv_ok: bool                          # kvcache_svc holds the pool
    forward_gap_ms_total: float          # worker idle time between steps (StepTimings.gap_ms)
    num_forward_gaps: Count
    num_prompt_tokens_admitted: Count    # prefix-cache queries, in tokens
    num_cached_tokens_admitted: Count    # prefix-cache hits, in tokens
    num_store_hit_tokens: Count = 0      # admitted as loads from the KV store
    num_store_miss_tokens: Count = 0     # admitted prompt tokens in neither cache nor store
    num_store_loaded_tokens: Count = 0   # of the hits, loaded by every rank
    num_store_load_fallbacks: Count = 0  # loads that came back short (the rest recomputed)
    num_plans: Count = 0                 # plan calls made to kvcache_svc


class EngineReport(_Wire):
    """Engine core -> cluster: its state (ready once its pool and caches are up; `down` with
    the reason when it stops) and its counters."""

    replica_id: Count
    engine_epoch: Epoch
    ready: bool
    command_address: Address | None     # its command socket, for the front ends
    stats: EngineStats | None = None
    down: Reason | None = None
    stats_seq: Count = 0                # the StatsRequest these counters answer (0: none)


def engine_request_id(request_id: str, frontend: int, handle: int) -> str:
    """The engine's id of a front end's request: unique across front ends, and starting with
    the client's id (logs; the worker's test fault injection matches its prefix)."""
    suffix = f"#{frontend:x}.{handle:x}"
    return request_id[:MAX_ID_LEN - len(suffix)] + suffix

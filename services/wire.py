"""Step messages: every per-step message between the scheduler and the workers, and the types
and limits every wire message shares.

MessagePack-encoded msgspec structs (array-like, tagged). `services.codec` decodes them with
type validation and the size limits declared here; nothing is ever pickled. Tensors never
travel in these messages (pipeline activations go over torch.distributed; stored KV chunks
travel as raw frames beside a KV store header).

Scheduler -> worker: `StepInput`, `InitCache`.        Worker -> scheduler: `StepOutput`,
`CacheReady`, `WorkerFailure`, `KvLoaded`. The scheduler's messages to kvcache_svc and its KV
events are in `services.kv_wire`; the KV store's own messages (chunks of KV and their raw data
frames) in `services.kv_store_wire`.

Step messages are diffs (shared/DESIGN.md section 2): a request travels in full once as a
`NewRequest` (again after preemption, since preemption drops the worker's state); afterwards
only what changed travels as a `RunningRequest`, or, for a steady decode (one token at the end
of what the worker holds, no new block, nothing to write: most rows of most steps), as a row of
`DecodeRows`: its slot and progress in packed arrays, validated as arrays, its token back in
`StepOutput.decode_token_ids`.
"""

from typing import Annotated

import msgspec
from msgspec import Meta

from services.block_hash import BLOCK_HASH_BYTES

MAX_TOKENS_PER_REQUEST = 1 << 20   # token ids in one request (prompt + output)
MAX_BLOCKS_PER_REQUEST = MAX_TOKENS_PER_REQUEST  # block ids held by one request (block_size >= 1)
MAX_REQUESTS_PER_STEP = 1 << 14    # requests named in one message
MAX_ID_LEN = 256                   # characters of a request or worker id
MAX_TOP_LOGPROBS = 20              # alternatives per sampled token
MAX_CACHE_SALT_BYTES = 256         # UTF-8 bytes of a request's cache salt (a tenant id or secret)
MAX_TOKEN_MASK_BYTES = 1 << 18     # one packed token bitmask: vocabularies up to 2M tokens
MAX_LOGIT_BIAS = 1024              # token ids one request may bias
MAX_LOGIT_BIAS_VALUE = 100.0       # |bias| added to a logit, as OpenAI's API bounds it
MAX_REPETITION_PENALTY = 1e6       # any finite value > 0 is meaningful; this only bounds it
MAX_SLOTS = 1 << 20                # a replica's request slots (NewRequest.slot)
MAX_MIN_TOKENS_IDS = 2048          # ids masked until min_tokens: EOS ids + stop token ids

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 31)]
BlockId = Annotated[int, Meta(ge=0, lt=1 << 31)]
# A chained SHA-256 block hash (services.block_hash): msgpack bin of exactly 32 bytes.
BlockHash = Annotated[bytes, Meta(min_length=BLOCK_HASH_BYTES, max_length=BLOCK_HASH_BYTES)]
Count = Annotated[int, Meta(ge=0, lt=1 << 40)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_TOKENS_PER_REQUEST)]
BlockIds = Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
BlockHashes = Annotated[list[BlockHash], Meta(max_length=MAX_BLOCKS_PER_REQUEST)]
RequestIds = Annotated[list[RequestId], Meta(max_length=MAX_REQUESTS_PER_STEP)]
# KV cache groups (services.kv_groups): a request holds one block table per group, and every
# message that carries block ids carries one list per group, in the layout's group order (a
# uniform model: one list). Receivers check the count against their layout.
MAX_KV_GROUPS = 64                 # groups of one model's layout
GroupBlockIds = Annotated[list[BlockIds], Meta(min_length=1, max_length=MAX_KV_GROUPS)]
Window = Annotated[int, Meta(ge=0, lt=1 << 31)]  # tokens a query reads back; 0 = full attention


class _Wire(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    """Base of every wire struct: positional encoding, tagged with the class name."""


# --------------------------------------------------------------------------- scheduler <-> worker


class SamplingSpec(_Wire, frozen=True):
    """What a worker needs to sample one request; validated by the scheduler's API edge."""

    temperature: Annotated[float, Meta(ge=0.0)]       # 0 = greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)]     # nucleus mass kept
    top_k: Annotated[int, Meta(ge=-1)]                # -1 or 0 = off
    seed: Annotated[int, Meta(ge=0)] | None  # per-request generator seed
    num_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None  # None = no logprobs
    # Added after the first five (positional encoding: new fields go last, with defaults). The
    # worker's sampler applies them in this order, as vLLM does: logit_bias, repetition, then
    # frequency and presence penalties (on the raw logits), temperature, min_p, top-k, top-p.
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0   # drop tokens below min_p x best prob
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0   # per output token seen
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0  # per output occurrence
    # Divides positive / multiplies negative logits of tokens in prompt or output; 1 = off.
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] = 1.0
    # (token id, value added to its logit); ids unique and within the vocabulary.
    logit_bias: Annotated[list[tuple[TokenId, Annotated[float, Meta(
        ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]]],
        Meta(max_length=MAX_LOGIT_BIAS)] = []
    # Prompt logprobs: each prompt token's logprob (from the second on) plus this many top
    # alternatives, returned in StepOutput.prompt_logprobs by the steps that compute them.
    num_prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # min_tokens, as vLLM's sampler applies it: while the request has fewer outputs than
    # this, the logits of `min_tokens_ids` (the model's EOS ids and the request's stop token
    # ids, EOS even under ignore_eos) are -inf, so none of them can be sampled.
    min_tokens: Annotated[int, Meta(ge=0, lt=1 << 31)] = 0
    min_tokens_ids: Annotated[list[TokenId], Meta(max_length=MAX_MIN_TOKENS_IDS)] = []


class NewRequest(_Wire):
    """A request the worker has no state for: first schedule, or resume after preemption."""

    request_id: RequestId
    token_ids: TokenIds                 # every known token: prompt + output so far
    num_prompt_tokens: Count            # prompt length (tokens after it are outputs)
    sampling: SamplingSpec
    # Per KV group, every block of the request's table in token order; a sliding group has
    # the null block 0 where its window no longer reads (kvcache_svc freed those).
    block_ids: GroupBlockIds
    num_computed_tokens: Count          # tokens whose KV is already in the cache (prefix hit)
    # Tokens to compute this step; 0 exactly when the step loads KV from the store instead.
    num_new_tokens: Annotated[int, Meta(ge=0, lt=1 << 31)]
    cache_salt: Annotated[bytes, Meta(max_length=MAX_CACHE_SALT_BYTES)] = b""  # in block 0's hash
    # Tokens after num_computed_tokens whose KV each rank fetches from the KV store into the
    # request's blocks this step (its own slice), reporting how many it got in a `KvLoaded`.
    num_load_tokens: Count = 0
    # The replica's name for it while the workers hold it, unique among held requests (-1:
    # none): `DecodeRows` name it by this.
    slot: Annotated[int, Meta(ge=-1, lt=MAX_SLOTS)] = -1


class RunningRequest(_Wire):
    """A request the worker already holds; only what changed since its last step."""

    request_id: RequestId
    num_computed_tokens: Count          # tokens whose KV is in the cache before this step
    num_new_tokens: Annotated[int, Meta(ge=1, lt=1 << 31)]  # tokens to compute this step
    new_block_ids: GroupBlockIds        # per KV group, blocks appended since the last step
    # Tokens sampled since this request's last step, for non-last pipeline ranks, which do not
    # sample; written at `num_computed_tokens`. Always empty with one pipeline stage.
    new_token_ids: TokenIds


# Packed little-endian int32 arrays of a step's decode rows.
PackedInt32 = Annotated[bytes, Meta(max_length=4 * MAX_REQUESTS_PER_STEP)]


class DecodeRows(_Wire):
    """Running requests that compute exactly one token each, the last the worker holds for
    them (so it samples the next), with no new block and no token to write: one entry per row
    of two packed little-endian int32 arrays, of one length."""

    slots: PackedInt32                  # each row's request, by its NewRequest.slot
    num_computed_tokens: PackedInt32    # tokens in the cache before this step, per row


class TokenMask(_Wire):
    """The tokens one request may sample in one step (its grammar's next allowed tokens).

    `bitmask` is packed little-endian int32 words: token i is allowed when bit i % 32 of word
    i // 32 is set. Exactly ceil(vocab_size / 32) words, vocab_size being the model's logits
    width (the worker refuses any other length); ids past the tokenizer's vocabulary are 0."""

    request_id: RequestId
    bitmask: Annotated[bytes, Meta(min_length=4, max_length=MAX_TOKEN_MASK_BYTES)]


class StepInput(_Wire):
    """One engine step for one replica; every rank of the replica receives the same message
    (but for `token_masks`, which only the last pipeline stage's ranks get)."""

    step_id: Count                      # per replica, strictly increasing
    new_requests: Annotated[list[NewRequest], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    running: Annotated[list[RunningRequest], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    finished_ids: RequestIds            # finished, aborted or preempted: drop their state first
    # Structured output: the tokens each constrained request may sample this step, at most one
    # mask per request and only for requests that sample in this step. Only the last pipeline
    # stage receives them (the scheduler sends the other ranks an empty list).
    token_masks: Annotated[list[TokenMask], Meta(max_length=MAX_REQUESTS_PER_STEP)] = []
    # Steady decodes, after `running` in the step's order (None: none).
    decodes: DecodeRows | None = None


class InitCache(_Wire):
    """Allocate the KV tensors: the replica-wide block count is now agreed."""

    num_blocks: Annotated[int, Meta(ge=2, lt=1 << 31)]   # including the null block 0
    block_size: Annotated[int, Meta(ge=1, le=1024)]      # tokens per block


class TokenLogprobs(_Wire):
    """Log probabilities for one sampled token."""

    logprob: float                      # of the sampled token
    top_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_TOP_LOGPROBS)]
    top_logprobs: Annotated[list[float], Meta(max_length=MAX_TOP_LOGPROBS)]


IDLE_GAP_S = 1.0  # a longer pause between steps is an idle server, not a scheduling gap


class StepTimings(_Wire):
    """Where the worker's time went in one step, in milliseconds."""

    prepare_ms: float                   # applying the diff and building input tensors
    forward_ms: float                   # model forward (all layers of this rank)
    sample_ms: float                    # logits + sampling (last stage only)
    num_tokens: Count                   # tokens computed in the step
    # From the end of this rank's previous forward (sampling included) to the start of this
    # one, this step's preparation included: the time the model sat idle between forwards.
    # 0 for a rank's first step and after more than IDLE_GAP_S without a step.
    gap_ms: float = 0.0


class StepError(_Wire):
    """Why a worker of a one-rank replica could not run a step. It dropped the step's requests
    (and skips them in later steps until they come back as finished ids) and serves on."""

    message: Annotated[str, Meta(max_length=4096)]   # the exception, for logs and the client
    # The forward had written every scheduled token's KV when it failed (e.g. in sampling), so
    # blocks the step's plan put in the prefix index hold valid KV.
    kv_written: bool


class PromptLogprobs(_Wire):
    """The logprobs of the prompt tokens one step computed for one request: entry i is for
    the prompt token at `first_position + i` given the tokens before it."""

    request_id: RequestId
    first_position: Annotated[int, Meta(ge=1, lt=1 << 31)]
    logprobs: Annotated[list[TokenLogprobs], Meta(max_length=MAX_TOKENS_PER_REQUEST)]
    # Each prompt token's rank in its distribution (1 = the most likely), as vLLM reports it.
    ranks: Annotated[list[Annotated[int, Meta(ge=1)]], Meta(max_length=MAX_TOKENS_PER_REQUEST)]


class StepOutput(_Wire):
    """The last stage's answer to one StepInput (tp_rank 0 only)."""

    step_id: Count
    worker_id: Annotated[str, Meta(max_length=MAX_ID_LEN)]
    # Requests that sampled a token this step, in step order; a request whose scheduled tokens
    # end inside its prompt (a non-final prefill chunk) samples nothing and is not listed.
    request_ids: RequestIds
    sampled_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    logprobs: Annotated[list[TokenLogprobs | None], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    timings: StepTimings
    # The step failed on the worker (request_ids is then empty): the scheduler fails exactly
    # the step's requests. Set by the worker, never for a replica of more than one rank.
    error: StepError | None = None
    # Prompt logprobs the step computed, for requests that asked (SamplingSpec).
    prompt_logprobs: Annotated[list[PromptLogprobs], Meta(max_length=MAX_REQUESTS_PER_STEP)] = []
    # The token of each of the step's decode rows (StepInput.decodes), in their order, packed
    # little-endian int32; -1 for a row the worker skipped (a request a failed step dropped).
    decode_token_ids: PackedInt32 = b""


class CacheReady(_Wire):
    """The worker allocated its KV tensors after InitCache."""

    worker_id: Annotated[str, Meta(max_length=MAX_ID_LEN)]
    num_blocks: Count


class WorkerFailure(_Wire):
    """A step a rank of a multi-rank replica could not run: its peers may be stuck in a
    collective, so the scheduler takes the replica down. `peer_lost`: a collective with
    another rank failed (the peer died or the link broke), which is no fault of the step's
    requests, so they move elsewhere with the rest; otherwise the step's own requests fail."""

    worker_id: Annotated[str, Meta(max_length=MAX_ID_LEN)]
    step_id: Count
    message: Annotated[str, Meta(max_length=4096)]
    peer_lost: bool = False


class KvLoaded(_Wire):
    """Every rank's answer to a step that loads KV from the store (`NewRequest.
    num_load_tokens`), sent once its loads are done: per request, how many leading tokens of
    the load are now in its blocks (the rest failed: gone, damaged, timed out). The scheduler
    takes the smallest count over the ranks and recomputes from there."""

    worker_id: Annotated[str, Meta(max_length=MAX_ID_LEN)]
    step_id: Count
    request_ids: RequestIds
    num_loaded_tokens: Annotated[list[Count], Meta(max_length=MAX_REQUESTS_PER_STEP)]


ToWorker = StepInput | InitCache
FromWorker = StepOutput | CacheReady | WorkerFailure | KvLoaded

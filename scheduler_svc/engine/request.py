"""Request state owned by the engine core: token ids, progress, blocks, sampling and the
token-level stop settings. No text: stop strings and detokenizing belong to the front end
that owns the request's client (scheduler_svc.frontend).

`num_computed_tokens` is the one progress counter (shared/DESIGN.md section 2): it advances
when a step is scheduled and catches up with `num_tokens`; preemption resets it to 0.
"""

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_svc.engine.wire import Timing
from services.block_hash import NONE_HASH, hash_full_blocks
from services.kv_chunks import prefix_hash
from services.wire import SamplingSpec, TokenLogprobs

if TYPE_CHECKING:
    from scheduler_svc.engine.grammar import GrammarState


# The clock of a request's phases (`Request.timing`); a test may stop it to compare runs.
clock = time.monotonic


class FinishReason(enum.Enum):
    STOP = "stop"        # EOS, a stop token id (or, in the front end, a stop string)
    LENGTH = "length"    # max_tokens or the context length reached
    ABORT = "abort"      # the client aborted or cancelled


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One request's sampling and token-level stop settings, as the engine core uses them
    (validated by the front end: scheduler_svc.frontend.validation; the front end's
    SamplingParams extends these with its text-side settings)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()    # (token id, bias), ids unique
    prompt_logprobs: int | None = None   # alternatives per prompt token; None: none asked

    def to_spec(self, eos_token_ids: tuple[int, ...] | None = None) -> SamplingSpec:
        """The worker's spec; with the model's `eos_token_ids` (the engine's, for a worker)
        also min_tokens and the ids it masks until then (EOS even under ignore_eos, as vLLM
        masks it)."""
        masked: list[int] = []
        if eos_token_ids is not None and self.min_tokens:
            masked = sorted({*eos_token_ids, *self.stop_token_ids})
        return SamplingSpec(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            seed=self.seed, num_logprobs=self.logprobs, min_p=self.min_p,
                            presence_penalty=self.presence_penalty,
                            frequency_penalty=self.frequency_penalty,
                            repetition_penalty=self.repetition_penalty,
                            logit_bias=list(self.logit_bias),
                            num_prompt_logprobs=self.prompt_logprobs,
                            min_tokens=self.min_tokens if masked else 0, min_tokens_ids=masked)

    @classmethod
    def from_spec(cls, spec: SamplingSpec, max_tokens: int, min_tokens: int,
                  stop_token_ids: tuple[int, ...], ignore_eos: bool) -> "SamplingParams":
        """The worker's sampling spec plus the engine's stop settings (an EngineRequest's)."""
        return cls(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                   seed=spec.seed, max_tokens=max_tokens, min_tokens=min_tokens,
                   stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                   logprobs=spec.num_logprobs, min_p=spec.min_p,
                   presence_penalty=spec.presence_penalty,
                   frequency_penalty=spec.frequency_penalty,
                   repetition_penalty=spec.repetition_penalty,
                   logit_bias=tuple((t, v) for t, v in spec.logit_bias),
                   prompt_logprobs=spec.num_prompt_logprobs)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request, on its way to the request's front end
    (scheduler_svc.engine.outputs packs a step's outputs per front end)."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_store_loaded_tokens: int = 0   # of num_cached_tokens, loaded from the KV store
    error: str | None = None           # the request ended without finishing (replica lost, ...)
    server_fault: bool = False         # the error is a fault of the server (a failed step),
                                       # not an unavailable one (INTERNAL, not UNAVAILABLE)
    invalid: bool = False              # the replica refused the request as it can never run
                                       # there (longer than its KV pool): INVALID_ARGUMENT
    # On the request's first output, when it asked for them: (prompt token id, its logprobs)
    # for every prompt token from the second on.
    prompt_logprobs: list[tuple[int, TokenLogprobs, int]] | None = None   # (id, lps, rank)
    timing: Timing | None = None       # a final output's: where its time went (None: never
                                       # scheduled)
    frontend: int = 0                  # the request's front end and its handle there
    handle: int = 0


class Request:
    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "sampling", "eos_token_ids",
        "max_num_tokens", "arrival_time", "status", "num_computed_tokens", "block_ids",
        "block_hashes", "num_committed_blocks", "num_cached_tokens", "on_worker",
        "num_store_loaded_tokens",
        "finish_reason", "stop_reason", "num_preemptions", "block_size",
        "hash_blocks", "num_in_flight", "num_pending_tokens", "num_migrations",
        "cache_salt", "num_freed_blocks", "grammar", "prompt_logprobs", "prompt_ranks",
        "frontend", "handle", "slot", "scheduled_time", "first_token_time", "client",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_model_len: int, block_size: int,
                 hash_blocks: bool, cache_salt: bytes = b"",
                 num_prompt_tokens: int | None = None, frontend: int = 0,
                 handle: int = 0, client: str = "") -> None:
        """`prompt_token_ids`: the prompt, then any outputs the client already has (a request
        moved off a lost replica); `num_prompt_tokens` says where the prompt ends (None: all
        of them are prompt). `frontend`, `handle`: where its outputs go. `client`: whose
        request it is, for its turn in the waiting queue (scheduler_svc.engine.fair_queue)."""
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)       # prompt + outputs
        self.num_prompt_tokens = (len(prompt_token_ids) if num_prompt_tokens is None
                                  else num_prompt_tokens)
        self.frontend = frontend
        self.handle = handle
        self.client = client
        self.slot = -1          # its name while the workers hold it (NewRequest.slot)
        self.sampling = sampling
        self.eos_token_ids = eos_token_ids
        # The request stops at max_tokens outputs or at the context length, whichever is first.
        self.max_num_tokens = min(max_model_len, self.num_prompt_tokens + sampling.max_tokens)
        self.arrival_time = clock()
        self.scheduled_time: float | None = None     # first admitted (kept over preemptions)
        self.first_token_time: float | None = None   # its first token here was appended
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Per KV group, the block table kvcache_svc gave it (services.kv_groups); a sliding
        # group's leading `num_freed_blocks[group]` entries are the null block 0 (given back).
        self.block_ids: list[list[int]] = []
        self.num_freed_blocks: list[int] = []
        self.block_size = block_size
        self.hash_blocks = hash_blocks
        # The client's tenant salt (UTF-8; empty = none), hashed into block 0: requests with
        # different salts never share cached blocks (services.block_hash).
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []          # hashes of full blocks of token_ids
        self.num_committed_blocks = 0                # of those, how many kvcache_svc indexed
        self.num_cached_tokens: int | None = None    # prefix hit at first admission
        self.num_store_loaded_tokens = 0              # of those, loaded from the KV store
        self.on_worker = False                       # the worker holds state for it
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.num_in_flight = 0           # steps holding this request whose output is not back
        self.num_pending_tokens = 0      # of those, steps that will sample a token for it
        self.num_migrations = 0
        # Structured output: its place in the grammar (scheduler_svc.engine.grammar), set when
        # the engine takes the request in; None = free text.
        self.grammar: GrammarState | None = None
        # Prompt logprobs gathered so far (positions 1, 2, ...), when the request asked.
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_ranks: list[int] = []
        self._extend_hashes()

    def add_prompt_logprobs(self, first_position: int, logprobs: list[TokenLogprobs],
                            ranks: list[int]) -> None:
        """A step's prompt logprobs, from `first_position` on. A prompt computed again
        (preemption, migration) repeats positions already held: only new ones are kept."""
        skip = len(self.prompt_logprobs) + 1 - first_position
        if skip < 0 or first_position + len(logprobs) > self.num_prompt_tokens:
            return      # not contiguous with what is held, or past the prompt: a bad report
        self.prompt_logprobs += logprobs[skip:]
        self.prompt_ranks += ranks[skip:]

    def prompt_logprobs_output(self) -> list[tuple[int, TokenLogprobs, int]] | None:
        """What the first output carries: (token id, logprobs, rank) per prompt token from
        the second on; None unless the request asked for them."""
        if self.sampling.prompt_logprobs is None:
            return None
        return list(zip(self.token_ids[1:self.num_prompt_tokens], self.prompt_logprobs,
                        self.prompt_ranks, strict=False))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_table_blocks(self) -> int:
        """Entries of each group's block table: the tokens its blocks cover, in blocks."""
        return len(self.block_ids[0]) if self.block_ids else 0

    @property
    def num_held_blocks(self) -> int:
        """Blocks it holds over all groups (what preempting it gives back, shared prefix
        blocks aside)."""
        return sum(len(ids) - num_freed
                   for ids, num_freed in zip(self.block_ids, self.num_freed_blocks, strict=True))

    def set_blocks(self, block_ids: list[list[int]]) -> None:
        """Its tables as admitted: every group's leading null entries are given back."""
        self.block_ids = [list(ids) for ids in block_ids]
        self.num_freed_blocks = [next((i for i, b in enumerate(ids) if b), len(ids))
                                 for ids in block_ids]

    def append_blocks(self, new_block_ids: list[list[int]], first_kept: list[int]) -> None:
        """A grow's appended blocks, after each group gave back its entries before
        `first_kept[group]` (as kvcache_svc does: `kv_groups.first_kept_block`)."""
        for group, (ids, new_ids) in enumerate(zip(self.block_ids, new_block_ids,
                                                   strict=True)):
            first, end = self.num_freed_blocks[group], min(first_kept[group], len(ids))
            if end > first:
                ids[first:end] = [0] * (end - first)
                self.num_freed_blocks[group] = end
            ids.extend(new_ids)

    @property
    def in_flight(self) -> bool:
        return self.num_in_flight > 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = clock()
        if self.hash_blocks and self.num_tokens % self.block_size == 0:
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        if not self.hash_blocks:
            return
        parent = self.block_hashes[-1] if self.block_hashes else NONE_HASH
        self.block_hashes.extend(hash_full_blocks(
            self.token_ids, self.block_size, parent, start_block=len(self.block_hashes),
            cache_salt=self.cache_salt))

    def tail_hash(self) -> bytes | None:
        """The chained hash of every token when the last block is partial: the KV store's key
        of a partial last chunk (services.kv_chunks); None when the block is full, or its
        tokens unknown or unhashed."""
        num_full = self.num_tokens // self.block_size
        if (not self.hash_blocks or self.num_tokens % self.block_size == 0
                or len(self.block_hashes) != num_full
                or min(self.token_ids[num_full * self.block_size:]) < 0):
            return None
        return prefix_hash(self.block_hashes, self.token_ids, self.num_tokens, self.block_size,
                           self.cache_salt)

    def mark_scheduled(self) -> None:
        """It was admitted for the first time: its queue time ends."""
        self.scheduled_time = clock()

    def timing(self) -> Timing | None:
        """Its phases as of now, its end (vLLM's queue, prefill, decode and inference times);
        None if it was never scheduled. One that ends before its first token spent it all in
        prefill."""
        scheduled = self.scheduled_time
        if scheduled is None:
            return None
        now = clock()
        first = now if self.first_token_time is None else self.first_token_time
        return Timing(queued_s=max(0.0, scheduled - self.arrival_time),
                      prefill_s=max(0.0, first - scheduled), decode_s=max(0.0, now - first),
                      inference_s=max(0.0, now - scheduled))

    def reset_for_preemption(self) -> None:
        """Back to waiting with no blocks; outputs are kept and recomputed on resume.

        Only a request with no step in flight may be preempted. Such a step still writes its
        blocks, and when its output comes back `Scheduler._leave_step` takes it off
        `num_in_flight` / `num_pending_tokens`; zeroed here, they would go negative then, and
        the resumed request would be planned one token short and sample before its last
        token. So they are checked, not reset (`reset_for_migration` may reset them: the
        steps of a lost replica never come back)."""
        if self.num_in_flight or self.num_pending_tokens:
            raise RuntimeError(
                f"request {self.request_id} preempted with {self.num_in_flight} step"
                f"{'' if self.num_in_flight == 1 else 's'} in flight "
                f"({self.num_pending_tokens} tokens pending); only idle requests may be "
                "preempted")
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids, self.num_freed_blocks = [], []
        self.num_committed_blocks = 0
        self.on_worker = False
        self.num_preemptions += 1

    def reset_for_migration(self) -> None:
        """Its replica is gone: back to waiting with no blocks and nothing in flight, to run
        again from prompt + the tokens so far (tests; a real move goes through the front end,
        which sends the tokens its client already has to another replica's engine)."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids, self.num_freed_blocks = [], []
        self.num_committed_blocks = 0
        self.on_worker = False
        self.slot = -1
        self.num_in_flight = 0
        self.num_pending_tokens = 0
        self.num_migrations += 1

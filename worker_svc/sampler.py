"""Per-request sampling over a batch of logits rows; called by the runner on the last stage.

Requests that ask for logit_bias or penalties first have their rows adjusted
(worker_svc.penalties, on the token history the worker keeps). Greedy (temperature 0, or
below MIN_TEMPERATURE) is argmax, ties to the lowest token id. Otherwise logits are divided by
the temperature, cut by top-k, min_p and top-p, and one token is drawn
by inverse CDF from a single float64 uniform. Each seeded request draws that uniform from its
own `SeededUniforms`, exactly one per sampled token, so its tokens depend only on its seed and
its logits, never on the rest of the batch, and a stream re-created after preemption starts at
the right draw (`new_generator`). Everything is computed in float32 (cumulative sums in
float64). Logprobs are always those of the raw model distribution (vLLM's default).
"""

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.wire import SamplingSpec, TokenLogprobs
from worker_svc.kernels.elementwise import argmax_float
from worker_svc.min_tokens import Banned, ban
from worker_svc.penalties import TokenHistory, adjust_logits, adjusts_logits, apply_min_p

# Top-p first looks at this many most likely tokens; rows whose nucleus is larger fall back to
# a full sort (slow on CPU: a 49k-entry row takes milliseconds).
_TOP_P_CANDIDATES = 256
# Below this a temperature samples greedily: logits / 1e-45 overflow to inf and the softmax is
# NaN. The scheduler already maps such temperatures to 0 (the same floor, as in vLLM); this
# keeps a worker safe from any sender.
MIN_TEMPERATURE = 1e-5
MAX_SEED = (1 << 64) - 1


class SeededUniforms:
    """One request's stream of float64 uniforms in [0, 1), keyed by its 64-bit seed.

    Draw k is BLAKE2b keyed with the seed over the counter k. Every seed bit counts (torch's
    CPU generator keeps only the low 32 bits of its seed, so seeds 5 and 2**63 + 5 drew the
    same tokens), distinct seeds give independent streams, and resuming after preemption sets
    the counter instead of replaying draws."""

    __slots__ = ("_key", "num_drawn")

    def __init__(self, seed: int, num_drawn: int = 0) -> None:
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed {seed} is not a uint64")
        self._key = seed.to_bytes(8, "little")
        self.num_drawn = num_drawn

    def next(self) -> float:
        digest = hashlib.blake2b(self.num_drawn.to_bytes(8, "little"), digest_size=8,
                                 key=self._key).digest()
        self.num_drawn += 1
        return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53   # 53 bits: a float64


def new_generator(seed: int, num_samples_done: int = 0) -> SeededUniforms:
    """A request's uniform stream, past the `num_samples_done` draws it already made."""
    return SeededUniforms(seed, num_samples_done)


def is_greedy(spec: SamplingSpec) -> bool:
    return spec.temperature < MIN_TEMPERATURE


def is_plain_greedy(spec: SamplingSpec) -> bool:
    """Greedy with nothing else to compute: the argmax of the raw logits is the whole answer
    (the runner keeps such batches on the device)."""
    return is_greedy(spec) and spec.num_logprobs is None and not adjusts_logits(spec)


def sample(logits: torch.Tensor, specs: Sequence[SamplingSpec],
           generators: Sequence[SeededUniforms | None],
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
           histories: Sequence[TokenHistory] | None = None,
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [rows, vocab] in any float dtype, one row per request, in `specs` order.

    `generators[i]` is request i's own uniform stream, or None for unseeded requests (drawn
    from torch's default generator). `argmax` ([rows, vocab] -> [rows], first maximum, as
    torch.argmax) serves a batch that is all greedy without logprobs straight from `logits`'
    dtype (the C kernel); by default the rows are widened to float32 first. `histories[i]` is
    request i's known tokens, needed (and only read) where its spec has penalties. Returns the
    sampled token ids and, per row, its logprobs or None where the request asked for none.
    """
    if all(is_plain_greedy(s) for s in specs):
        return (argmax or argmax_float)(logits).tolist(), [None] * len(specs)
    token_ids, logprobs = sample_on_device(logits, specs, generators, histories)
    return token_ids.tolist(), [None] * len(specs) if logprobs is None else logprobs.lists()


def sample_on_device(logits: torch.Tensor, specs: Sequence[SamplingSpec],
                     generators: Sequence[SeededUniforms | None],
                     histories: Sequence[TokenHistory] | None = None,
                     banned: Banned | None = None,
                     ) -> tuple[torch.Tensor, "DeviceLogprobs | None"]:
    """`sample` without waiting for the device: the token ids stay there ([rows] int64) and
    the logprobs of the rows that asked are device tensors whose copy to the host has
    started (None: no row asked). Only host lists travel to the device, without a blocking
    copy; nothing is read back. The launch-ahead path of a step that is not plain greedy
    (worker_svc.step_output). `banned`: logits entries that cannot be sampled (min_tokens,
    worker_svc.min_tokens), masked after the raw logprobs are taken."""
    raw = logits = logits.float()
    if banned is not None:
        logits = ban(raw, banned)
    adjusted_rows = [i for i, spec in enumerate(specs) if adjusts_logits(spec)]
    if adjusted_rows:
        if histories is None:
            raise ValueError("penalties need the requests' token histories")
        rows = to_device(adjusted_rows, torch.int64, logits.device)
        base = logits
        logits = base.clone() if base is raw else base
        logits[rows] = adjust_logits(base.index_select(0, rows),
                                     [specs[i] for i in adjusted_rows],
                                     [histories[i] for i in adjusted_rows])
    random_rows = [i for i, spec in enumerate(specs) if not is_greedy(spec)]
    if len(random_rows) == len(specs):
        token_ids = _sample_random(logits, specs, generators)
    else:
        token_ids = logits.argmax(dim=-1)              # [rows]; first maximum wins ties
        if random_rows:
            rows = to_device(random_rows, torch.int64, logits.device)
            token_ids[rows] = _sample_random(
                logits.index_select(0, rows), [specs[i] for i in random_rows],
                [generators[i] for i in random_rows])
    return token_ids, DeviceLogprobs.of(raw, token_ids, specs)


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small host list on `device`, queued behind the device's work rather than waiting
    for it (a blocking copy to a GPU first waits for the forward queued before it)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _sample_random(logits: torch.Tensor, specs: Sequence[SamplingSpec],
                   generators: Sequence[SeededUniforms | None]) -> torch.Tensor:
    """Temperature, top-k, min_p, top-p, then one inverse-CDF draw per row -> [rows] token
    ids."""
    vocab = logits.shape[-1]
    device = logits.device
    temperatures = to_device([spec.temperature for spec in specs], torch.float32, device)
    x = logits / temperatures[:, None]                 # [rows, vocab]

    top_ks = [spec.top_k if 0 < spec.top_k < vocab else vocab for spec in specs]
    if min(top_ks) < vocab:
        top_values = x.topk(min(max(k for k in top_ks if k < vocab), vocab), dim=-1).values
        kth = to_device([k - 1 if k < vocab else 0 for k in top_ks], torch.int64, device)
        threshold = top_values.gather(1, kth[:, None])  # [rows, 1]
        # (masked_fill, not a boolean index: that would read the mask back to the host)
        threshold = threshold.masked_fill(
            (to_device(top_ks, torch.int64, device) >= vocab)[:, None], float("-inf"))
        x = x.masked_fill(x < threshold, float("-inf"))
    probs = x.softmax(dim=-1)                          # [rows, vocab]

    min_p_rows = [i for i, spec in enumerate(specs) if spec.min_p > 0.0]
    if min_p_rows:
        rows = to_device(min_p_rows, torch.int64, device)
        min_ps = to_device([specs[i].min_p for i in min_p_rows], torch.float32, device)
        probs[rows] = apply_min_p(probs.index_select(0, rows), min_ps)

    top_p_rows = [i for i, spec in enumerate(specs) if spec.top_p < 1.0]
    if top_p_rows:
        rows = to_device(top_p_rows, torch.int64, device)
        top_ps = to_device([specs[i].top_p for i in top_p_rows], torch.float32, device)
        probs[rows] = _apply_top_p(probs.index_select(0, rows), top_ps)

    uniforms = torch.empty(len(specs), dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i] = generator.next()
    cdf = probs.double().cumsum(dim=-1)                # [rows, vocab], not normalized
    # The draws are made on the host (seeded streams, torch's CPU generator), then moved.
    targets = uniforms.to(device, non_blocking=True)[:, None] * cdf[:, -1:]
    # right=True: the first token whose cdf exceeds the target, never a zero-probability one.
    token_ids = torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=vocab - 1)
    # A row with no finite mass (NaN or inf logits) would pick an arbitrary token: take its
    # argmax instead, which is what any temperature tends to.
    broken = ~(cdf[:, -1] > 0) | ~torch.isfinite(cdf[:, -1])
    if device.type == "cpu":           # reading `broken` is free here; on a GPU it would wait
        if bool(broken.any()):
            token_ids[broken] = logits[broken].argmax(dim=-1)
        return token_ids
    return torch.where(broken, logits.argmax(dim=-1), token_ids)


def _apply_top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus: the most likely tokens whose mass before
    them is below top_p (so at least one survives). probs: [rows, vocab]; top_ps: [rows]."""
    if probs.device.type != "cpu":
        # Rank the whole vocabulary: fast on a GPU, and no read-back to ask whether to.
        values = probs.sort(dim=-1, descending=True).values
    else:
        values = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values
        if bool(((values.cumsum(dim=-1) - values)[:, -1] < top_ps).any()):
            # Some nucleus may reach past the candidates: the whole vocabulary (rare, slow).
            values = probs.sort(dim=-1, descending=True).values
    mass_before = values.cumsum(dim=-1) - values                       # [rows, candidates]
    num_keep = (mass_before < top_ps[:, None]).sum(dim=-1)             # [rows], >= 1
    cut = values.gather(1, (num_keep - 1)[:, None])                    # [rows, 1]
    return probs.masked_fill(probs < cut, 0.0)


@dataclass(slots=True)
class DeviceLogprobs:
    """The logprobs a step's rows asked for (log_softmax of the raw logits: the sampled
    token's and the top-n alternatives'), on their way to the host: `lists` reads them."""

    num_rows: int
    rows: list[int]                   # the rows that asked, ascending
    counts: list[int]                 # each such row's top-n
    sampled: torch.Tensor             # [len(rows)] float32
    top_values: torch.Tensor | None   # [len(rows), max n]; None when every n is 0
    top_ids: torch.Tensor | None
    copied: torch.cuda.Event | None   # the copies above are on the host (a GPU's)

    @staticmethod
    def of(logits: torch.Tensor, token_ids: torch.Tensor,
           specs: Sequence[SamplingSpec]) -> "DeviceLogprobs | None":
        wanted = [i for i, spec in enumerate(specs) if spec.num_logprobs is not None]
        if not wanted:
            return None
        rows = to_device(wanted, torch.int64, logits.device)
        logprobs = logits.index_select(0, rows).log_softmax(dim=-1)      # [wanted, vocab]
        counts = [specs[i].num_logprobs or 0 for i in wanted]
        sampled = logprobs.gather(1, token_ids.index_select(0, rows)[:, None])[:, 0]
        top_values = top_ids = None
        if max(counts):
            top_values, top_ids = logprobs.topk(max(counts), dim=-1)
        # One copy to the host for the whole batch, started now, read at `lists`.
        sampled, top_values, top_ids = (_to_host(t) for t in (sampled, top_values, top_ids))
        copied = None
        if logits.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        return DeviceLogprobs(len(specs), wanted, counts, sampled, top_values, top_ids, copied)

    def lists(self) -> list[TokenLogprobs | None]:
        """Per row of the step, its logprobs or None (waits for the copy: call at finish)."""
        if self.copied is not None:
            self.copied.synchronize()
        sampled = self.sampled.tolist()
        result: list[TokenLogprobs | None] = [None] * self.num_rows
        for j, (i, n) in enumerate(zip(self.rows, self.counts, strict=True)):
            result[i] = TokenLogprobs(
                logprob=sampled[j],
                top_token_ids=self.top_ids[j, :n].tolist() if self.top_ids is not None else [],
                top_logprobs=(self.top_values[j, :n].tolist()
                              if self.top_values is not None else []))
        return result


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Start `tensor`'s copy to pinned host memory (a GPU's); a CPU tensor is itself."""
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)

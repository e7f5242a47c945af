"""The fp8 KV cache's cost in accuracy, on the GPU: the services in bfloat16 with an 8-bit
cache (`--kv-cache-dtype fp8` = e4m3, and fp8_e5m2) against the same services with a
bfloat16 cache, on the same weights (tests/gpu/conftest.py's model), one request at a time.

Each run asks greedy tokens with the most logprobs (tests/gpu/logits.py). While the two runs'
tokens agree, both computed the next logits on the same context, so every difference there
is the cache's: compared are the logprobs of the ids both runs return at that position, up
to and including the first position where the greedy tokens differ (after it the contexts
differ). Asserted: the mean |logprob difference| over those entries, and top-1 agreement
at the positions whose bfloat16-cache top-1/top-2 margin is at least TIE_MARGIN (closer
pairs are near-ties that any rounding may flip; counted, not failed). A run whose logprobs
equal the bfloat16 cache's bit for bit fails too: then the flag did not reach the cache.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.rpc.splitserve.v1 import generation_pb2
from tests.gpu.cluster import gpu_cluster
from tests.gpu.logits import services_logprobs

pytestmark = pytest.mark.gpu

NUM_PROMPTS = 8
TIE_MARGIN = 0.1
# kv_cache_dtype: (most mean |logprob difference|, least top-1 agreement outside near-ties).
# Measured with this test on a CPU (SPLITSERVE_GPU_TEST_DEVICE=cpu: the workers' bfloat16
# CPU path, the random full-depth SmolLM2 shape; AMD Zen 5, 2026-11-29): e4m3 mean 0.10 (max
# 0.50 over 2,554 entries), top-1 129/132; e5m2 mean 0.20 (max 0.82 over 1,004), top-1
# 57/62. bfloat16 against fp32 is ~0.2 at most (tests/gpu/logits.py), so e4m3's 3 mantissa
# bits cost about that again. Bounds at twice the error and twice the disagreement measured:
# provisional until a GPU run; a cache read wrong (a scale, a format) gives differences of
# several units and agreement near chance.
BOUNDS = {"fp8": (0.2, 0.95), "fp8_e5m2": (0.4, 0.83)}

Run = list[tuple[list[int], list[generation_pb2.TokenLogprob]]]


def logprobs_of(entry: generation_pb2.TokenLogprob, token: int) -> dict[int, float]:
    """Every id a position returns (the chosen token and its top alternatives) -> logprob."""
    return {token: entry.logprob, **{t.token_id: t.logprob for t in entry.top}}


@dataclass
class CacheComparison:
    diffs: list[float] = field(default_factory=list)    # |ours - bf16 cache| per shared entry
    num_positions: int = 0          # positions with the same context in both runs
    num_decided: int = 0            # of those, the bf16 cache's margin >= TIE_MARGIN
    num_decided_agree: int = 0
    num_flips: int = 0              # positions where the greedy tokens differ (<= 1 a prompt)

    @property
    def mean_diff(self) -> float:
        return sum(self.diffs) / max(1, len(self.diffs))

    @property
    def agreement(self) -> float:
        return self.num_decided_agree / max(1, self.num_decided)

    def describe(self) -> str:
        return (f"mean |logprob diff| {self.mean_diff:.3e}, max {max(self.diffs, default=0):.3e} "
                f"over {len(self.diffs)} entries at {self.num_positions} positions; top-1 "
                f"{self.num_decided_agree}/{self.num_decided} outside near-ties, "
                f"{self.num_flips} flips in all")


def compare_runs(reference: Run, ours: Run) -> CacheComparison:
    """Position by position while the contexts agree (see the module docstring)."""
    result = CacheComparison()
    for (ref_tokens, ref_entries), (tokens, entries) in zip(reference, ours, strict=True):
        for ref_token, ref_entry, token, entry in zip(ref_tokens, ref_entries, tokens, entries,
                                                      strict=True):
            expected = logprobs_of(ref_entry, ref_token)
            got = logprobs_of(entry, token)
            result.diffs += [abs(got[i] - expected[i]) for i in expected.keys() & got.keys()]
            best, second = (sorted(expected.values(), reverse=True) + [float("-inf")])[:2]
            decided = best - second >= TIE_MARGIN
            result.num_positions += 1
            result.num_decided += decided
            result.num_decided_agree += decided and token == ref_token
            if token != ref_token:
                result.num_flips += 1
                break
    return result


def greedy_runs(cluster, prompts: Sequence[Sequence[int]]) -> Run:  # type: ignore[no-untyped-def]
    return [services_logprobs(cluster, p) for p in prompts]


@pytest.fixture(scope="module")
def bf16_cache_run(tmp_path_factory: pytest.TempPathFactory, model_path: Path,
                   prompts: list[list[int]]) -> Run:
    with gpu_cluster(tmp_path_factory.mktemp("bf16-cache"), model_path,
                     dtype="bfloat16") as cluster:
        return greedy_runs(cluster, prompts[:NUM_PROMPTS])


@pytest.mark.parametrize("kv_cache_dtype", list(BOUNDS))
def test_fp8_kv_cache_logits_against_bf16_cache(
        kv_cache_dtype: str, tmp_path: Path, model_path: Path, prompts: list[list[int]],
        bf16_cache_run: Run, record_property: Callable[[str, object], None]) -> None:
    max_mean, min_agreement = BOUNDS[kv_cache_dtype]
    with gpu_cluster(tmp_path, model_path, dtype="bfloat16",
                     scheduler_args=["--kv-cache-dtype", kv_cache_dtype]) as cluster:
        result = compare_runs(bf16_cache_run, greedy_runs(cluster, prompts[:NUM_PROMPTS]))
    print(f"fp8 logits check, {kv_cache_dtype} cache against bf16: {result.describe()}")
    record_property("comparison", result.describe())      # into junit.xml, passed or not
    assert any(result.diffs), (f"{kv_cache_dtype}: logprobs equal to the bf16 cache's bit "
                               "for bit: the cache is not 8-bit")
    assert result.mean_diff <= max_mean and result.agreement >= min_agreement, (
        f"{kv_cache_dtype}: {result.describe()} (bounds: mean <= {max_mean}, top-1 >= "
        f"{min_agreement})")

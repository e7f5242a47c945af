"""--seed (vLLM's): the seeds the front end gives random requests that bring none come from a
stream seeded by it, one per front end, so the same requests in the same order sample alike
in every run; without it they are unpredictable. Seeded and greedy requests are untouched."""

from scheduler_svc.__main__ import parse_args
from scheduler_svc.frontend.validation import Limits, RawSampling, seed_stream, validate_sampling


def seeds(limits: Limits, count: int = 4) -> list[int | None]:
    return [validate_sampling(RawSampling(temperature=0.8), 5, limits).seed
            for _ in range(count)]


def limits(seed: int | None, frontend: int = 0) -> Limits:
    return Limits("m", 100, 64, seeds=seed_stream(seed, frontend))


def test_a_seeded_server_gives_the_same_seeds_in_every_run() -> None:
    first = seeds(limits(1234))
    assert first == seeds(limits(1234)) and len(set(first)) == len(first)
    assert all(s is not None and 0 <= s < 1 << 64 for s in first)
    assert first != seeds(limits(1235))
    assert first != seeds(limits(1234, frontend=1))     # each front end its own stream


def test_without_seed_each_request_still_gets_an_unpredictable_one() -> None:
    unseeded = seeds(limits(None)) + seeds(limits(None))
    assert all(s is not None for s in unseeded) and len(set(unseeded)) == len(unseeded)


def test_a_requests_own_seed_and_greedy_requests_are_untouched() -> None:
    lim = limits(1234)
    assert validate_sampling(RawSampling(temperature=0.8, seed=9), 5, lim).seed == 9
    assert validate_sampling(RawSampling(temperature=0.0), 5, lim).seed is None


def test_the_flag_reaches_the_front_ends_config() -> None:
    assert parse_args(["--seed", "77"]).server.seed == 77
    assert parse_args([]).server.seed is None

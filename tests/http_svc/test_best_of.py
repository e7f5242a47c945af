"""best_of as vLLM V1 takes it (http_svc.sampling): served when it equals n, refused by name
otherwise (below n invalid, above n not served: no choice is ranked away)."""

from typing import Any

import pytest

from http_svc.errors import ApiError
from http_svc.protocol import CompletionRequest
from http_svc.sampling import Sampling, completion_sampling


def completion(**fields: Any) -> Sampling:
    return completion_sampling(CompletionRequest.model_validate({"prompt": "x", **fields}))


@pytest.mark.parametrize("n", [1, 3])
def test_best_of_equal_to_n_is_served_as_n_choices(n: int) -> None:
    assert completion(n=n, best_of=n).n == n
    assert completion(n=n).n == n


@pytest.mark.parametrize(("fields", "message"), [
    ({"n": 2, "best_of": 3}, "best_of is not supported yet: only best_of == n (2) is served"),
    ({"best_of": 4}, "best_of is not supported yet: only best_of == n (1) is served"),
    ({"n": 3, "best_of": 2}, "best_of must be >= n (3), got 2"),
    ({"best_of": 0}, "best_of must be >= n (1), got 0"),
])
def test_any_other_best_of_is_a_400_naming_it(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError) as refused:
        completion(**fields)
    assert refused.value.status == 400 and refused.value.param == "best_of"
    assert refused.value.message.startswith(message)

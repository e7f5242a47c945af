"""A replica's arithmetic (scheduler_svc.cluster.placement): contiguous stage ranges with
uneven splits, and the rendezvous on rank 0's host."""

import pytest

from scheduler_svc.cluster.placement import rendezvous_address, split_layers


@pytest.mark.parametrize("num_layers, pp, expected", [
    (30, 1, [(0, 30)]),
    (30, 2, [(0, 15), (15, 30)]),
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
    (30, 7, [(0, 5), (5, 10), (10, 14), (14, 18), (18, 22), (22, 26), (26, 30)]),
])
def test_split_layers(num_layers: int, pp: int, expected: list[tuple[int, int]]) -> None:
    ranges = split_layers(num_layers, pp)
    assert ranges == expected
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_rendezvous_on_rank0_host() -> None:
    address = rendezvous_address("tcp://10.1.2.3:5555")
    assert address.startswith("tcp://10.1.2.3:") and int(address.rsplit(":", 1)[1]) > 0

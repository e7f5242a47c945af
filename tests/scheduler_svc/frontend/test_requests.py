"""A front end's live requests (scheduler_svc.frontend.requests): one home for every live
request, by handle and by the client's id, where each runs (the router's load measure) and
which are parked. The front end's use of it (cancel, outputs, moves) is test_core*.py."""

from scheduler_svc.frontend.requests import LiveRequests
from scheduler_svc.frontend.tokenizer import TextTokenizer
from tests.scheduler_svc.frontend.fakes import front_request

A, B = (0, 100), (1, 100)      # (replica id, engine epoch)


def test_ids_are_unique_while_live(tokenizer: TextTokenizer) -> None:
    live = LiveRequests()
    first = front_request(tokenizer, "a", [5, 6], handle=live.new_handle())
    assert live.add(first)
    again = front_request(tokenizer, "a", [5, 6], handle=live.new_handle())
    assert again.handle != first.handle
    assert not live.add(again)                   # the client's id is taken
    assert len(live) == 1 and live.num_parked == 1 and "a" in live
    live.remove(first)
    live.remove(first)                           # twice is harmless
    assert len(live) == 0 and live.num_parked == 0 and "a" not in live
    assert live.add(again) and live.get(again.handle) is again and live.by_id("a") is again
    assert live.get(first.handle) is None


def test_place_park_and_remove_keep_the_counts(tokenizer: TextTokenizer) -> None:
    live = LiveRequests()
    r = front_request(tokenizer, "r", [5], handle=live.new_handle())
    s = front_request(tokenizer, "s", [5], handle=live.new_handle())
    live.add(r)
    live.add(s)
    live.place(r, A)
    live.place(s, A)
    assert (live.num_on(A), live.num_parked, r.placement) == (2, 0, A)
    assert live.placed_on(A) == [r, s] and live.placements() == {A}
    live.park(r)                                  # its engine core went down
    assert (live.num_on(A), live.num_parked, r.placement) == (1, 1, None)
    assert live.parked() == [r]
    live.place(r, B)                              # moved
    assert (live.num_on(A), live.num_on(B), live.num_parked) == (1, 1, 0)
    assert live.placements() == {A, B}
    live.remove(s)
    assert live.num_on(A) == 0 and live.placements() == {B}
    live.remove(r)
    assert live.placements() == set() and live.num_parked == 0 and len(live) == 0


def test_parked_leaves_out_the_placed_and_the_finished(tokenizer: TextTokenizer) -> None:
    live = LiveRequests()
    waiting, placed, done = (front_request(tokenizer, rid, [5], handle=live.new_handle())
                             for rid in ("waiting", "placed", "done"))
    for r in (waiting, placed, done):
        live.add(r)
    live.place(placed, A)
    done.done = True                              # its last output is on its stream
    assert live.parked() == [waiting] and live.num_parked == 2


def test_token_ids_are_the_prompt_and_the_outputs_so_far(tokenizer: TextTokenizer) -> None:
    r = front_request(tokenizer, "r", [5, 6])
    r.output_token_ids += [9, 10]
    assert r.token_ids == [5, 6, 9, 10] and r.prompt_token_ids == [5, 6]

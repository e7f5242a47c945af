"""A front end's live requests (scheduler_svc.frontend.requests): one home for every live
request, by handle and by the client's id, where each runs (the router's load measure) and
which are parked. The front end's use of it (cancel, outputs, moves) is test_core*.py."""

import random

from scheduler_svc.frontend.requests import LiveRequests
from scheduler_svc.frontend.streams import OutputStream, RequestOutput
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


class RecordingStream(OutputStream):
    """Records every output the request hands over: (tokens, text)."""

    def __init__(self, interval: int | None) -> None:
        super().__init__(interval)
        self.handed: list[tuple[list[int], str]] = []

    def put(self, out: RequestOutput) -> None:
        self.handed.append((list(out.new_token_ids), out.text))
        super().put(out)


def test_a_plain_decode_token_takes_the_same_path_as_a_step_of_one_token(
        tokenizer: TextTokenizer) -> None:
    """`take_token` (every plain decode step's row) against `take` with one token: the same
    outputs, text, stop string and abort, with stop strings, min_tokens, kept stops and
    stream intervals drawn at random."""
    rng = random.Random(37)
    text = tokenizer.encode("One fish, two fish. Red fish — blue fish! Ünïcode 漢字 🙂 END. " * 3)
    for case in range(60):
        start = rng.randrange(len(text) - 40)
        tokens = text[start:start + rng.randrange(5, 40)]
        sampling = {"stop": tuple(rng.sample(["fish", ". R", "END", "🙂", "zz"],
                                             rng.randrange(0, 3))),
                    "min_tokens": rng.randrange(0, 6),
                    "include_stop_str_in_output": rng.random() < 0.5}
        interval = rng.choice([1, 1, 3, None])
        slow, fast = (front_request(tokenizer, f"r{case}", [5, 6], **sampling)
                      for _ in range(2))
        slow.stream, fast.stream = RecordingStream(interval), RecordingStream(interval)
        slow.placement = fast.placement = A
        for token in tokens:
            assert fast.take_token(token) == slow.take([token], [None], None, None)
        assert fast.output_token_ids == slow.output_token_ids
        assert fast.stop_string == slow.stop_string
        assert fast.stream.handed == slow.stream.handed, (case, sampling, interval)
        assert fast.unsent(True).text == slow.unsent(True).text

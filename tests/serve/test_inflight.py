"""``worker/serve/inflight.py`` on its own: the requests a worker holds. Room and read-ahead (what the
reader may take), one step's outputs and refusals as one batch (the terminal event acknowledging the
entry, the room opened when a request starts or ends), tokens counted for the metrics, and requests
let go of when their entries are no longer held: heartbeats and events stop for them."""

from __future__ import annotations

from structlog.testing import capture_logs

from pagedserve.shared.protocol import ReplyTarget, Resume, WireRequest
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.outputs import CompletionOutput, RequestOutput
from pagedserve.worker.core.scheduling.plan import SampledToken
from pagedserve.worker.serve.events import InFlight
from pagedserve.worker.serve.inflight import InFlightTable


def flight(request_id: str, resume: Resume | None = None) -> InFlight:
    request = WireRequest(id=request_id, model="m", params=SamplingParams(max_tokens=8),
                          reply=ReplyTarget("channel", f"replies:{request_id}"), prompt_token_ids=[1, 2, 3], resume=resume)
    return InFlight(f"e-{request_id}", request)


def output(request_id: str, tokens: list[int], new: list[int], finished: bool = False, logprobs=None) -> RequestOutput:
    reason = "length" if finished else None
    completion = CompletionOutput(0, "", tokens, reason, 0.0, logprobs, "", tuple(new))
    return RequestOutput(request_id, [1, 2, 3], [completion], finished, None, None, None)


def table(max_inflight: int = 4, read_ahead: int = 2, *ids: str) -> InFlightTable:
    held = InFlightTable(max_inflight, read_ahead, lambda token: f"<{token}>")
    for request_id in ids:
        held.add(flight(request_id))
    return held


def test_room_is_what_is_free_but_no_more_than_the_read_ahead_of_requests_not_started():
    held = table(4, 2)
    assert (held.free(), held.readable(), len(held)) == (4, 2, 0)
    held.add(flight("a"))
    assert (held.free(), held.readable()) == (3, 1)
    held.add(flight("b"))
    assert (held.free(), held.readable()) == (2, 0)  # two waiting to start: read no more
    held.batch_for([output("a", [7], [7])], [])  # a started
    assert (held.free(), held.readable()) == (2, 1)
    held.add(flight("c"))
    held.add(flight("d"))
    assert (held.free(), held.readable()) == (0, -1)  # full: negative means none
    assert list(held) == ["a", "b", "c", "d"] and "c" in held and "x" not in held
    assert held.get("c").entry_id == "e-c" and held.get("x") is None


def test_a_steps_outputs_are_one_batch_and_the_end_acknowledges_the_entry_and_opens_the_room():
    """Every event names its request's entry; the bridge acknowledges it with the terminal one."""
    held = table(4, 2, "a", "b")
    batch = held.batch_for([output("a", [7], [7]), output("b", [9], [9])], [])
    assert [(o.target.name, o.event.id, o.event.seq, o.event.done, o.entry_id) for o in batch] == [
        ("replies:a", "a", 0, False, "e-a"), ("replies:b", "b", 0, False, "e-b")]
    assert held.room.is_set() and held.tokens_out == 2
    held.room.clear()
    batch = held.batch_for([output("a", [7, 8], [8], finished=True), output("b", [9], [])], [])  # b: nothing new
    assert [(o.event.id, o.event.seq, o.event.done, o.entry_id) for o in batch] == [("a", 1, True, "e-a")]
    assert held.room.is_set() and "a" not in held and held.tokens_out == 3
    held.room.clear()
    held.batch_for([output("b", [9, 10], [10])], [])  # already started, not ending: no room to announce
    assert not held.room.is_set()
    assert held.batch_for([output("gone", [1], [1])], []) == []  # not held (aborted, finished): nothing sent


def test_a_refusal_ends_its_request_with_an_error_numbered_after_what_was_sent():
    held = table(4, 2, "a")
    held.add(flight("r", Resume([5, 6], 3)))
    batch = held.batch_for([], [("a", "too long"), ("r", "bad resume")])
    assert [(o.event.id, o.event.seq, o.event.done, o.event.error, o.entry_id) for o in batch] == [
        ("a", 0, True, "too long", "e-a"), ("r", 3, True, "bad resume", "e-r")]
    assert len(held) == 0 and held.room.is_set() and held.tokens_out == 0


def test_requests_whose_entries_are_lost_are_let_go_of_once_and_send_nothing_more():
    held = table(4, 2, "a", "b", "c")
    assert held.beating() == ["e-a", "e-b", "e-c"]
    with capture_logs() as logs:
        assert held.let_go({"e-b", "e-x"}) == ["b"]
        assert held.let_go({"e-b"}) == []  # said once
    assert [(e["event"], e["log_level"], e["request_id"], e["entry_id"]) for e in logs] == [
        ("entry no longer held; request stopped without events", "warning", "b", "e-b")]
    assert held.beating() == ["e-a", "e-c"] and "b" in held  # computed on until the engine aborts it
    held.room.clear()
    batch = held.batch_for([output("b", [4], [4]), output("a", [7], [7])], [])
    assert [o.event.id for o in batch] == ["a"] and held.tokens_out == 1 and held.room.is_set()
    assert held.batch_for([output("b", [4, 5], [5], finished=True)], []) == [] and "b" not in held


def test_logprob_entries_carry_each_tokens_text_from_the_tables_decoder():
    held = table(4, 2, "a")
    (sent,) = held.batch_for([output("a", [7], [7], logprobs=[SampledToken(7, -0.5, {7: -0.5, 3: -1.0})])], [])
    assert sent.event.outputs[0].logprobs == [
        {"token_id": 7, "token": "<7>", "logprob": -0.5, "top": {7: -0.5, 3: -1.0}, "top_tokens": {7: "<7>", 3: "<3>"}}]

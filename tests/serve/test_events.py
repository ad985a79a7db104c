"""``worker/serve/events.py`` on its own: engine outputs -> wire events. One event per request per
step, numbered from the request's resume point; a finish reported once per output; usage, the
queue time (once) and the prompt's logprobs on the events that carry them; token texts decoded
once per id. The service tests show the same events on the wire."""

from __future__ import annotations

from pagedserve.shared.protocol import OutputDelta, ReplyTarget, Resume, WireRequest
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.outputs import CompletionOutput, RequestOutput
from pagedserve.worker.core.scheduling.plan import SampledToken
from pagedserve.worker.core.scheduling.token_pieces import TokenPieces
from pagedserve.worker.serve.events import InFlight, error_event, event_for, lost_event, request_finish_reason


def flight(resume: Resume | None = None, created: float = 100.0, n: int = 1) -> InFlight:
    request = WireRequest(id="r", model="m", params=SamplingParams(n=n, max_tokens=8), reply=ReplyTarget("channel", "c"),
                          prompt_token_ids=[1, 2, 3], created=created, resume=resume)
    return InFlight("e-1", request, accepted_at=created + 0.5)


def completion(index=0, tokens=(), text="", new=(), delta="", reason=None, logprobs=None) -> CompletionOutput:
    return CompletionOutput(index, text, list(tokens), reason, 0.0, logprobs, delta, tuple(new))


def output(*outputs, finished=False, queued_s=None, error=None, prompt_logprobs=None, cached=None) -> RequestOutput:
    return RequestOutput("r", [1, 2, 3], list(outputs), finished, error, queued_s, prompt_logprobs, num_cached_tokens=cached)


def piece(token_id: int) -> str:
    return f"<{token_id}>"


def test_each_step_is_one_event_numbered_in_order_with_the_queue_time_once():
    f = flight()
    first = event_for(f, output(completion(tokens=[7], text="a", new=[7], delta="a"), queued_s=0.25), piece)
    assert (first.id, first.seq, first.done, first.usage, first.queue_s) == ("r", 0, False, None, 0.75)
    assert first.outputs == [OutputDelta(0, [7], "a", None, None)]
    second = event_for(f, output(completion(tokens=[7, 8], text="ab", new=[8], delta="b"), queued_s=0.25), piece)
    assert (second.seq, second.queue_s) == (1, None)  # the queue time goes out once
    assert event_for(f, output(completion(tokens=[7, 8], text="ab")), piece) is None  # nothing new: no event
    assert f.next_seq == 2
    late = flight(created=200.0)
    late.accepted_at = 150.0  # a clock that went back: never a negative wait
    assert event_for(late, output(completion(new=[1], delta="x"), queued_s=0.1), piece).queue_s == 0.1


def test_the_end_carries_each_finish_once_usage_and_the_prompts_logprobs():
    f = flight(n=2)
    one = event_for(f, output(completion(0, [7], "a", [7], "a", "length"), completion(1, [9], "c", [9], "c")), piece)
    assert [(d.index, d.finish_reason) for d in one.outputs] == [(0, "length"), (1, None)] and not one.done
    prompt = [None, SampledToken(2, -0.5, {2: -0.5, 4: -1.0}), SampledToken(3, -0.25, {3: -0.25})]
    end = event_for(f, output(completion(0, [7], "a", reason="length"), completion(1, [9, 10], "cd", [10], "d", "stop"),
                              finished=True, prompt_logprobs=prompt, cached=2), piece)
    assert [(d.index, d.token_ids, d.finish_reason) for d in end.outputs] == [(1, [10], "stop")]  # 0 already reported
    assert end.done and end.finish_reason == "length" and end.usage == {"prompt_tokens": 3, "completion_tokens": 3,
                                                                                   "cached_tokens": 2}
    assert end.prompt_logprobs == [None, {"token_id": 2, "token": "<2>", "logprob": -0.5, "top": {2: -0.5, 4: -1.0},
                                          "top_tokens": {2: "<2>", 4: "<4>"}},
                                   {"token_id": 3, "token": "<3>", "logprob": -0.25, "top": {3: -0.25},
                                    "top_tokens": {3: "<3>"}}]
    bare = event_for(flight(), output(completion(reason="abort"), finished=True, error="gone"), piece)
    assert (bare.done, bare.finish_reason, bare.error, bare.prompt_logprobs) == (True, "abort", "gone", None)


def test_a_resumed_request_numbers_its_events_after_what_the_client_holds():
    f = flight(resume=Resume([7, 8], 5))
    assert event_for(f, output(completion(tokens=[7, 8, 9], new=[9], delta="x")), piece).seq == 5
    assert f.next_seq == 6


def test_logprob_entries_are_this_steps_tokens_with_their_texts():
    entries = [SampledToken(7, -0.1, {7: -0.1}), SampledToken(8, -0.2, {8: -0.2, 9: -2.0}), SampledToken(5, -0.3, None)]
    event = event_for(flight(), output(completion(tokens=[7, 8, 5], new=[8, 5], delta="yz", logprobs=entries)), piece)
    assert event.outputs[0].logprobs == [
        {"token_id": 8, "token": "<8>", "logprob": -0.2, "top": {8: -0.2, 9: -2.0}, "top_tokens": {8: "<8>", 9: "<9>"}},
        {"token_id": 5, "token": "<5>", "logprob": -0.3, "top": {}, "top_tokens": {}}]
    finish_only = event_for(flight(), output(completion(tokens=[7], reason="stop", logprobs=entries[:1]), finished=True), piece)
    assert finish_only.outputs[0].logprobs is None  # no new token this step: no entries


def test_the_worst_finish_names_the_request_and_errors_say_if_they_can_resume():
    assert request_finish_reason(output(completion(0, reason="stop"), completion(1, reason="error"))) == "error"
    assert request_finish_reason(output(completion(0, reason="abort"), completion(1, reason="stop"))) == "abort"
    assert request_finish_reason(output(completion(0, reason="length"), completion(1, reason="stop"))) == "length"
    assert request_finish_reason(output()) is None
    err = error_event("r", 4, "bad prompt")
    assert (err.seq, err.outputs, err.done, err.finish_reason, err.error, err.resumable) == (4, [], True, "error", "bad prompt", False)
    assert err.usage == {"prompt_tokens": 0, "completion_tokens": 0}
    assert err.delivery == 0 and error_event("r", 4, "bad prompt", delivery=3).delivery == 3
    lost = lost_event(flight().request, 2)
    assert (lost.seq, lost.resumable, lost.error, lost.delivery) == (-1, True, "the worker serving this request died mid-stream", 2)
    assert lost_event(flight(n=2).request, 2).resumable is False


def test_a_token_is_decoded_once_whatever_its_count():
    calls = []

    class Tokenizer:
        def decode(self, ids):
            calls.append(ids)
            return f"t{ids[0]}"

    pieces = TokenPieces(Tokenizer())
    assert [pieces(5), pieces(5), pieces(6)] == ["t5", "t5", "t6"] and calls == [[5], [6]]


def test_every_event_says_which_delivery_of_its_entry_sent_it():
    taken_over = InFlight("e-1", flight().request, deliveries=2)
    assert event_for(taken_over, output(completion(tokens=[7], new=[7], delta="a")), piece).delivery == 2
    assert event_for(flight(), output(completion(tokens=[7], new=[7], delta="a")), piece).delivery == 1

"""The wire protocol: what goes out comes back equal, and every malformed message is a
``ProtocolError`` naming its field (never another exception a worker would die of)."""

import msgpack
import pytest

from pagedserve.shared.protocol import (
    MAX_ID_LEN, VERSION, OutputDelta, ProtocolError, ReplyTarget, Resume, WireCancel, WireEvent, WireRequest,
    decode_events, encode_events,
)
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams


def request(**overrides) -> WireRequest:
    base = dict(id="r-1", model="m", params=SamplingParams(max_tokens=3, stop=("x",), seed=5), reply=ReplyTarget("channel", "c"),
                prompt_token_ids=[1, 2, 3], created=12.5, deadline=99.0, priority=2, tenant="t")
    return WireRequest(**{**base, **overrides})


def raw(**fields) -> bytes:
    base = {"v": VERSION, "id": "r", "model": "m", "prompt": "hi", "reply": {"channel": "c"}}
    return msgpack.packb({k: v for k, v in {**base, **fields}.items() if v is not ...})


@pytest.mark.parametrize("source", [dict(prompt="hello"), dict(prompt_token_ids=[4, 5]),
                                    dict(messages=[{"role": "user", "content": "hi"}])])
def test_requests_round_trip(source):
    sent = request(**{"prompt_token_ids": None, **source})
    assert WireRequest.decode(sent.encode()) == sent


def test_a_resumed_request_round_trips():
    sent = request(resume=Resume([7, 8], 2))
    assert WireRequest.decode(sent.encode()) == sent


def test_events_and_cancels_round_trip():
    events = [WireEvent("a", 0, [OutputDelta(0, [1, 2], "hi", None, [{"token_id": 1, "logprob": -0.5, "top": {1: -0.5}}])]),
              WireEvent("b", 3, [], True, "error", "the worker died", {"prompt_tokens": 2, "completion_tokens": 4}),
              WireEvent("c", -1, [], True, "error", "the worker died", None, True),
              WireEvent("d", 0, [OutputDelta(0, [7], "x")], queue_s=0.25)]
    assert decode_events(encode_events(events)) == events
    assert WireCancel.decode(WireCancel("a", "client gone").encode()) == WireCancel("a", "client gone")
    assert ReplyTarget.from_wire({"stream": "s"}) == ReplyTarget("stream", "s")


@pytest.mark.parametrize("data, field, words", [
    (b"\xc1", None, "malformed msgpack"),  # not msgpack
    (msgpack.packb([1, 2]), None, "must be a msgpack map"),  # not a map
    (raw(v=2), "v", "unsupported protocol version 2"),
    (raw(v=...), "v", "unsupported protocol version None"),
    (raw(id=7), "id", "id is required and must be a str"),
    (raw(id=""), "id", f"id must be 1..{MAX_ID_LEN} characters"),
    (raw(id="x" * (MAX_ID_LEN + 1)), "id", f"id must be 1..{MAX_ID_LEN} characters"),
    (raw(model=None), "model", "model is required and must be a str"),
    (raw(prompt=None), "prompt", "give exactly one of prompt, prompt_token_ids, messages"),  # none at all
    (raw(prompt_token_ids=[1]), "prompt", "give exactly one of prompt, prompt_token_ids, messages"),  # two
    (raw(prompt=5), "prompt", "prompt must be a string"),
    (raw(prompt=None, prompt_token_ids=[1, "2"]), "prompt_token_ids", "prompt_token_ids must be a list of integers"),
    (raw(prompt=None, prompt_token_ids=[1, True]), "prompt_token_ids", "prompt_token_ids must be a list of integers"),
    (raw(prompt=None, messages=[]), "messages", "messages must be a non-empty list of {role, content} string maps"),
    (raw(prompt=None, messages=[{"role": "user"}]), "messages", "messages must be a non-empty list"),
    (raw(prompt=None, messages="hi"), "messages", "messages must be a non-empty list"),
    (raw(created="now"), "created", "created has the wrong type"),
    (raw(deadline=True), "deadline", "deadline has the wrong type"),
    (raw(priority=1.5), "priority", "priority has the wrong type"),
    (raw(tenant=3), "tenant", "tenant has the wrong type"),
    (raw(adapter=["sql"]), "adapter", "adapter has the wrong type"),
    (raw(params=[1]), "params", "params must be a map"),
    (raw(params={"bogus": 1}), "bogus", "unknown sampling parameter(s): bogus"),
    (raw(params={"temperature": -1}), "temperature", "temperature must be in [0.0, 100.0], got -1"),
    (raw(params={"stop_token_ids": 5}), "stop_token_ids", "stop_token_ids must be a list"),
    (raw(params={"stop": 5}), "stop", "stop must be a list"),
    (raw(params={1: 2}), "params", "sampling parameter names must be strings"),
    (raw(resume=[1]), "resume", 'resume must be {"token_ids": [int], "seq": int}'),
    (raw(resume={"token_ids": [1, "x"], "seq": 1}), "resume", "resume.token_ids must be a list of integers"),
    (raw(resume={"token_ids": [1], "seq": -1}), "resume", "resume.seq must be an integer >= 0"),
    (raw(resume={"token_ids": [1], "seq": True}), "resume", "resume.seq must be an integer >= 0"),
    (raw(resume={"token_ids": [1], "seq": 1}, params={"n": 2}), "resume", "only n = 1 requests"),
    (raw(resume={"token_ids": [1], "seq": 1}, params={"best_of": 2}), "resume", "only n = 1 requests"),
    (raw(resume={"token_ids": [1], "seq": 1}, params={"use_beam_search": True, "beam_width": 2}), "resume",
     "only n = 1 requests"),
    (raw(resume={"token_ids": [1, 2], "seq": 1}, params={"max_tokens": 2}), "resume",
     "resume.token_ids must be fewer than max_tokens"),
    (raw(reply=None), "reply", 'reply must be {"channel": name} or {"stream": name}'),
    (raw(reply={"channel": "a", "stream": "b"}), "reply", 'reply must be {"channel": name} or {"stream": name}'),
    (raw(reply={"email": "x"}), "reply", 'reply must be {"channel": name} or {"stream": name}'),
    (raw(reply={"channel": ""}), "reply", 'reply must be {"channel": name} or {"stream": name}'),
])
def test_malformed_requests_are_invalid_request_errors_naming_the_field(data, field, words):
    """``ProtocolError`` for the envelope, its parent ``InvalidRequestError`` for the sampling
    parameters: what the worker turns into an error event and a dead letter."""
    with pytest.raises(InvalidRequestError) as err:
        WireRequest.decode(data)
    assert err.value.field == field and words in str(err.value)


def test_minimal_messages_take_the_documented_defaults():
    req = WireRequest.decode(raw(id="x" * MAX_ID_LEN))  # the longest id is allowed
    assert (req.created, req.deadline, req.priority, req.tenant, req.params, req.resume, req.adapter) == \
        (0.0, None, 0, None, SamplingParams(), None, None)
    event = WireEvent.from_wire({"v": VERSION, "id": "a", "seq": 0})
    assert (event.outputs, event.done, event.finish_reason, event.error, event.usage, event.resumable) == \
        ([], False, None, None, None, False)
    assert WireCancel.decode(msgpack.packb({"v": VERSION, "id": "a"})).reason == "cancelled"
    assert set(msgpack.unpackb(request().encode())) == {"v", "id", "model", "params", "reply", "prompt",
                                                        "prompt_token_ids", "messages", "created", "deadline",
                                                        "priority", "tenant", "resume", "adapter"}


def test_malformed_cancels_are_protocol_errors():
    for data in (b"", msgpack.packb({"v": VERSION}), msgpack.packb({"v": VERSION, "id": 3}), msgpack.packb({"id": "a"})):
        with pytest.raises(ProtocolError):
            WireCancel.decode(data)

"""The wire protocol: what goes out comes back equal, and every malformed message is a
``ProtocolError`` naming its field (never another exception a worker would die of)."""

import msgpack
import pytest

from shared.protocol import (
    MAX_ID_LEN, VERSION, OutputDelta, ProtocolError, ReplyTarget, WireCancel, WireEvent, WireRequest, decode_events,
    encode_events,
)
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams


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


def test_events_and_cancels_round_trip():
    events = [WireEvent("a", 0, [OutputDelta(0, [1, 2], "hi", None, [{"token_id": 1, "logprob": -0.5, "top": {1: -0.5}}])]),
              WireEvent("b", 3, [], True, "length", None, {"prompt_tokens": 2, "completion_tokens": 4})]
    assert decode_events(encode_events(events)) == events
    assert WireCancel.decode(WireCancel("a", "client gone").encode()) == WireCancel("a", "client gone")
    assert ReplyTarget.from_wire({"stream": "s"}) == ReplyTarget("stream", "s")


@pytest.mark.parametrize("data, field", [
    (b"\xc1", None),  # not msgpack
    (msgpack.packb([1, 2]), None),  # not a map
    (raw(v=2), "v"),
    (raw(v=...), "v"),
    (raw(id=7), "id"),
    (raw(id=""), "id"),
    (raw(id="x" * (MAX_ID_LEN + 1)), "id"),
    (raw(model=None), "model"),
    (raw(prompt=None), "prompt"),  # no prompt at all
    (raw(prompt_token_ids=[1]), "prompt"),  # two of them
    (raw(prompt=5), "prompt"),
    (raw(prompt=None, prompt_token_ids=[1, "2"]), "prompt_token_ids"),
    (raw(prompt=None, prompt_token_ids=[1, True]), "prompt_token_ids"),
    (raw(prompt=None, messages=[]), "messages"),
    (raw(prompt=None, messages=[{"role": "user"}]), "messages"),
    (raw(prompt=None, messages="hi"), "messages"),
    (raw(created="now"), "created"),
    (raw(deadline=True), "deadline"),
    (raw(priority=1.5), "priority"),
    (raw(tenant=3), "tenant"),
    (raw(params=[1]), "params"),
    (raw(params={"bogus": 1}), "bogus"),
    (raw(params={"temperature": -1}), "temperature"),
    (raw(params={"stop_token_ids": 5}), "stop_token_ids"),
    (raw(params={"stop": 5}), "stop"),
    (raw(params={1: 2}), "params"),
    (raw(reply=None), "reply"),
    (raw(reply={"channel": "a", "stream": "b"}), "reply"),
    (raw(reply={"email": "x"}), "reply"),
    (raw(reply={"channel": ""}), "reply"),
])
def test_malformed_requests_are_invalid_request_errors_naming_the_field(data, field):
    """``ProtocolError`` for the envelope, its parent ``InvalidRequestError`` for the sampling
    parameters: what the worker turns into an error event and a dead letter."""
    with pytest.raises(InvalidRequestError) as err:
        WireRequest.decode(data)
    assert err.value.field == field


def test_malformed_cancels_are_protocol_errors():
    for data in (b"", msgpack.packb({"v": VERSION}), msgpack.packb({"v": VERSION, "id": 3}), msgpack.packb({"id": "a"})):
        with pytest.raises(ProtocolError):
            WireCancel.decode(data)

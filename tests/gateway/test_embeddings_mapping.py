"""The embeddings route's mapping on its own (``gateway/routes/embeddings.py``), no stack: the inputs
as one prefill-only request, a terminal event's vector or the 502 for its absence, and OpenAI's answer
written out whole in both encodings. test_embeddings.py checks the vectors through a live stack
against transformers."""

from __future__ import annotations

import base64
import struct

import pytest

from pagedserve.gateway.bodies.openai import EmbeddingsRequest
from pagedserve.gateway.bodies.validation import validated
from pagedserve.gateway.http.api_error import ApiError
from pagedserve.gateway.routes.embeddings import embedding_list, encoded, parsed_request, vector_of
from pagedserve.shared.protocol import WireEvent
from pagedserve.shared.sampling import SamplingParams


def request(**body) -> EmbeddingsRequest:
    return validated(EmbeddingsRequest, {"model": "m", "input": "pages", **body})


def test_the_inputs_go_as_one_greedy_prefill_only_request_pooled_as_asked():
    parsed = parsed_request(request(input=["a", "b"], user="u", priority=-3), max_inputs=2)
    assert (parsed.chat, parsed.model, parsed.prompt, parsed.stream, parsed.include_usage) == (False, "m", ["a", "b"], False, False)
    assert (parsed.priority, parsed.timeout, parsed.user, parsed.ignored) == (-3, None, "u", ())
    assert parsed.params == SamplingParams(max_tokens=1, temperature=0.0, pooling="last")
    mean = parsed_request(request(pooling="mean"), max_inputs=1)
    assert mean.params.pooling == "mean" and mean.priority == 0 and mean.user is None


def test_fields_nobody_here_knows_are_named_as_ignored_in_order():
    assert parsed_request(request(zeta=1, alpha=2), 1).ignored == ("alpha", "zeta")


@pytest.mark.parametrize("given, count", [("one text", 1), ([5, 6, 7], 1), ([[5, 6], [7]], 2), (["a", "b", "c"], 3)])
def test_more_inputs_than_a_request_may_hold_is_a_400_naming_input(given, count):
    assert parsed_request(request(input=given), max_inputs=count).prompt == given
    with pytest.raises(ApiError) as error:
        parsed_request(request(input=given), max_inputs=count - 1)
    assert (error.value.status, error.value.param, error.value.message) == (
        400, "input", f"{count} inputs; at most {count - 1} per request")
    assert error.value.type == "invalid_request_error"


def test_a_terminal_events_vector_is_taken_and_its_absence_is_a_502_from_the_worker():
    assert vector_of(WireEvent("r", 1, done=True, finish_reason="stop", embedding=[0.6, 0.8])) == [0.6, 0.8]
    for event, message in [(WireEvent("r", 1, done=True, finish_reason="error", error="out of blocks", embedding=[1.0]),
                            "out of blocks"),
                           (WireEvent("r", 1, done=True, finish_reason="stop"), "the worker sent no embedding"),
                           (WireEvent("r", 1, done=True, finish_reason="error"), "the worker sent no embedding")]:
        with pytest.raises(ApiError) as error:
            vector_of(event)
        err = error.value
        assert (err.status, err.message, err.param, err.code, err.type) == (502, message, None, "worker_error", "server_error")


def test_the_answer_holds_each_inputs_vector_in_order_and_the_prompts_tokens():
    vectors = {1: [0.0, 1.0], 0: [0.6, -0.8]}
    body = embedding_list(request(input=["a", "b"], encoding_format="float"), vectors, [[1, 2, 3], [4, 5]])
    assert body == {"object": "list", "model": "m", "usage": {"prompt_tokens": 5, "total_tokens": 5},
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.6, -0.8]},
                             {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]}]}
    assert embedding_list(request(), {0: [0.5]}, [[9]])["data"][0]["embedding"] == [0.5]  # no format given: floats


def test_base64_is_the_little_endian_float32_bytes():
    vector = [0.25, -1.5, 3.0]
    text = encoded(vector, "base64")
    assert base64.b64decode(text) == struct.pack("<3f", *vector) == bytes.fromhex("0000803e0000c0bf00004040")
    assert text == "AACAPgAAwL8AAEBA"
    assert encoded(vector, "float") is vector and encoded(vector, None) is vector
    body = embedding_list(request(encoding_format="base64"), {0: vector}, [[1, 2]])
    assert body["data"] == [{"object": "embedding", "index": 0, "embedding": "AACAPgAAwL8AAEBA"}]

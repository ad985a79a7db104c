"""``POST /v1/embeddings``: a decoder model's embeddings, as vLLM's pooling runner makes them: each
input's final hidden states pooled (the last token's, or with pagedserve's ``pooling: "mean"`` their
mean) and normalised to unit length. The inputs go through the same queue and continuous batching
as generation, prefill only (``SamplingParams.pooling``: the request ends once its prompt is in,
with no token); ``encoding_format`` ``float`` or ``base64`` (little-endian float32, which the
OpenAI SDK asks for by default). The handler sends and collects; the functions below it map the
request and the worker's terminal events to the answer."""

from __future__ import annotations

import base64
import struct
import time

from aiohttp import web

from pagedserve.gateway.bodies.openai import EmbeddingsRequest
from pagedserve.gateway.bodies.parse import ParsedRequest, prompt_count
from pagedserve.gateway.bodies.validation import validated
from pagedserve.gateway.http.api_error import ApiError
from pagedserve.gateway.service.generation import STATE, account, generation, read_json
from pagedserve.shared.protocol import WireEvent
from pagedserve.shared.sampling import SamplingParams


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = validated(EmbeddingsRequest, await read_json(request))
    parsed = parsed_request(req, state.limits.max_choices)
    vectors: dict[int, list[float]] = {}
    async with generation(request, parsed) as sent:
        async for index, event in sent.events:
            account(state, parsed, event, sent.tally, time.monotonic())
            if event.done:
                vectors[index] = vector_of(event)
        state.metrics.e2e.labels(parsed.model).observe(time.monotonic() - sent.tally.started)
        body = embedding_list(req, vectors, sent.prompts)
    return web.json_response(body)


def parsed_request(req: EmbeddingsRequest, max_inputs: int) -> ParsedRequest:
    """The inputs as one request of prefill-only prompts (greedy, one token's room, pooled); more
    inputs than a request's choices may number is a 400 naming ``input``."""
    count = prompt_count(req.input)
    if count > max_inputs:
        raise ApiError(400, f"{count} inputs; at most {max_inputs} per request", "input")
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=req.pooling or "last")
    return ParsedRequest(False, req.model, req.input, params, False, False, req.priority or 0, None, req.user,
                         ignored=tuple(sorted(req.model_extra or ())))


def vector_of(event: WireEvent) -> list[float]:
    """A terminal event's vector; a 502 where the worker failed the input or sent none."""
    if event.finish_reason == "error" or event.embedding is None:
        raise ApiError(502, event.error or "the worker sent no embedding", None, "worker_error", "server_error")
    return event.embedding


def embedding_list(req: EmbeddingsRequest, vectors: dict[int, list[float]], prompts: list[list[int]]) -> dict:
    """OpenAI's answer: one ``embedding`` object per input in the inputs' order, encoded as asked,
    and the prompts' tokens as usage."""
    data = [{"object": "embedding", "index": i, "embedding": encoded(vectors[i], req.encoding_format)}
            for i in range(len(prompts))]
    tokens = sum(len(p) for p in prompts)
    return {"object": "list", "data": data, "model": req.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def encoded(vector: list[float], encoding: str | None) -> list[float] | str:
    """``base64``: the vector's little-endian float32 bytes; otherwise (``float``, or none given) the list."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector

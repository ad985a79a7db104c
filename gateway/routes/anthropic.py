"""``POST /v1/messages``: Anthropic's Messages API, so Claude-style clients and SDKs point here.

The body (``bodies.anthropic.MessagesRequest``) is read as the chat completion it amounts to
(``chat_body``: the system prompt first, ``tool_use`` blocks as an assistant's tool calls,
``tool_result`` blocks as tool messages, ``tool_choice`` any/tool as required/named) and goes the
chat's way: the same template, sampling, tool parsing, reasoning split and queue. The answer comes
back as a ``message`` of content blocks (``thinking``, ``text``, ``tool_use``) with ``stop_reason``
``end_turn``, ``max_tokens``, ``tool_use`` or ``stop_sequence`` (with the ``stop_sequence`` that
matched, as the worker says) and ``usage`` with ``cache_read_input_tokens`` apart; streamed, as
Anthropic's events (``message_start``, ``content_block_start``/``_delta``/``_stop``, ``message_delta``,
``message_stop``). Errors are in Anthropic's shape (``error_body``). Not given: images and documents
(a 400).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from pagedserve.gateway.answers.text import Pieces, parsed_tools, whole_answer
from pagedserve.gateway.bodies.anthropic import MessagesRequest
from pagedserve.gateway.bodies.parse import ParsedRequest, joined_text, parse
from pagedserve.gateway.bodies.validation import validated
from pagedserve.gateway.http import sse
from pagedserve.gateway.http.api_error import ApiError
from pagedserve.gateway.routes.answer_parts import Collected, deltas
from pagedserve.gateway.service.generation import STATE, generation, read_json

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def chat_body(req: MessagesRequest) -> dict:
    """The chat completion body ``req`` amounts to."""
    messages = [{"role": "system", "content": joined_text(req.system)}] if req.system else []
    for turn in req.messages:
        messages.extend(_turn(turn))
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens, "stream": req.stream,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences,
            "priority": req.priority, "seed": req.seed, "user": req.metadata.user_id if req.metadata else None}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ApiError(400, 'tool_choice of type "tool" needs the tool\'s name', "tool_choice")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return {k: v for k, v in body.items() if v is not None}


def _turn(turn) -> list[dict]:
    """One Anthropic turn as chat messages: a user's tool results first (each a tool message), then
    its text; an assistant's text and its calls in one message (its thinking blocks left out: the
    template sees earlier answers without their thinking)."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    kinds = {kind: [b for b in turn.content if b.type == kind]
             for kind in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")}
    text = "\n".join(b.text for b in kinds["text"])
    if turn.role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in kinds["tool_use"]]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    if kinds["tool_use"] or kinds["thinking"] or kinds["redacted_thinking"]:
        raise ApiError(400, "tool_use and thinking blocks belong to the assistant's turns", "messages")
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": joined_text(b.content)} for b in kinds["tool_result"]]
    return out + ([{"role": "user", "content": text}] if kinds["text"] or not out else [])


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = validated(MessagesRequest, await read_json(request))
    state.note_ignored(tuple(sorted(req.model_extra or ())))
    parsed = parse(chat_body(req), True, state.limits, state.sampling_defaults)
    async with generation(request, parsed) as sent:
        reply = Reply(parsed, sent.id.replace("chatcmpl-", "msg_", 1), state.settings.tool_call_parser,
                      state.settings.reasoning_parser)
        if parsed.stream:
            response = await sse.open_stream(request)
            return await sse.until_client_gone(request, response, _stream(response, state, parsed, reply, sent))
        async for _ in deltas(state, parsed, sent, reply):
            pass
        state.metrics.e2e.labels(parsed.model).observe(time.monotonic() - sent.tally.started)
        return web.json_response(reply.message(len(sent.prompts[0]), sent.tally.cached_tokens))


class Reply(Collected):
    """One message's answer as it comes: its text, how it ended, its blocks."""

    def __init__(self, parsed: ParsedRequest, message_id: str, tool_parser: str, reasoning_parser: str | None) -> None:
        super().__init__()
        self.parsed, self.id, self.tool_parser, self.reasoning_parser = parsed, message_id, tool_parser, reasoning_parser
        self.tools = parsed_tools(parsed.tools)

    def head(self, input_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.parsed.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}

    def stop_reason(self, calls: list) -> str:
        if calls and self.finish == "stop":
            return "tool_use"
        if self.finish == "stop" and self.stop_string is not None:
            return "stop_sequence"
        return STOP_REASONS.get(self.finish or "stop", "end_turn")

    def message(self, input_tokens: int, cached_tokens: int = 0) -> dict:
        thinking, content, calls = whole_answer(self.text, self.reasoning_parser, self.tools, self.tool_parser)
        blocks = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
        blocks += [{"type": "text", "text": content}] if content else []
        blocks += [tool_use(call) for call in calls]
        reason = self.stop_reason(calls)
        return {**self.head(input_tokens), "content": blocks, "stop_reason": reason,
                "stop_sequence": self.stop_string if reason == "stop_sequence" else None,
                "usage": self.usage(input_tokens, cached_tokens)}

    def usage(self, input_tokens: int, cached_tokens: int) -> dict:
        """Anthropic's usage: ``input_tokens`` are those not read from the cache (the prompt is their
        sum with ``cache_read_input_tokens``); nothing is written to a cache on request here."""
        return {"input_tokens": input_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
                "cache_creation_input_tokens": 0, "output_tokens": self.output_tokens}


def tool_use(call: dict) -> dict:
    """An OpenAI tool call (``tool_calls.new_call``) as Anthropic's ``tool_use`` block."""
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:  # cut by max_tokens: what came, as a string
        arguments = {"_partial": call["function"]["arguments"]}
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {"value": arguments}}


class Blocks:
    """A streamed message's content blocks: a block starts when text of its kind comes after
    another kind's, and stops before the next starts."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response, self.index, self.kind = response, -1, None

    async def write(self, kind: str, text: str) -> None:
        if not text:
            return
        if kind != self.kind:
            await self.close()
            self.index, self.kind = self.index + 1, kind
            start = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            await event(self.response, "content_block_start", index=self.index, content_block=start)
        await event(self.response, "content_block_delta", index=self.index,
                    delta={"type": f"{kind}_delta", kind: text})

    async def call(self, block: dict) -> None:
        await self.close()
        self.index += 1
        await event(self.response, "content_block_start", index=self.index, content_block={**block, "input": {}})
        await event(self.response, "content_block_delta", index=self.index,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        await event(self.response, "content_block_stop", index=self.index)

    async def close(self) -> None:
        if self.kind is not None:
            await event(self.response, "content_block_stop", index=self.index)
            self.kind = None


async def event(response: web.StreamResponse, kind: str, **fields) -> None:
    await response.write(sse.frame({"type": kind, **fields}, kind))


async def _stream(response: web.StreamResponse, state, parsed: ParsedRequest, reply: Reply, sent) -> None:
    await event(response, "message_start", message=reply.head(len(sent.prompts[0])))
    blocks, pieces = Blocks(response), Pieces(reply.reasoning_parser, reply.tools, reply.tool_parser)
    try:
        async for delta in deltas(state, parsed, sent, reply):
            thought, text, _ = pieces.feed(delta.text, delta.finish_reason is not None)
            await blocks.write("thinking", thought)
            await blocks.write("text", text)
        for call in pieces.calls:
            await blocks.call(tool_use(call))
        await blocks.close()
        reason = reply.stop_reason(pieces.calls)
        matched = reply.stop_string if reason == "stop_sequence" else None
        await event(response, "message_delta", delta={"stop_reason": reason, "stop_sequence": matched},
                    usage=reply.usage(len(sent.prompts[0]), sent.tally.cached_tokens))
        await event(response, "message_stop")
    except ApiError as err:
        await response.write(sse.frame(error_body(err), "error"))
    state.metrics.e2e.labels(parsed.model).observe(time.monotonic() - sent.tally.started)
    await response.write_eof()


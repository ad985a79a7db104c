"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

The body (``bodies.responses.ResponsesRequest``) is read as the chat completion it amounts to
(``chat_body``: ``instructions`` as the system prompt, then the stored conversation of
``previous_response_id``, then the input's items: messages, ``function_call`` as an assistant's
tool call, ``function_call_output`` as a tool message; ``text.format`` as ``response_format``;
function tools as chat tools) and goes the chat's way: the same template, sampling, structured
outputs, tool parsing, reasoning split and queue. The answer is a ``response`` whose ``output``
holds a ``reasoning`` item (with ``--reasoning-parser``), a ``message`` of ``output_text`` and
``function_call`` items; streamed, as the typed events the SDK reassembles (``response.created``,
``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed``...). With ``store`` (the
default) the answer and its conversation are kept in Redis for ``--responses-ttl`` seconds, so any
gateway answers ``GET`` and continues it; a continuation's prompt starts with the last turn's, so
routing sends it to the worker whose prefix cache holds it.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web
from redis.exceptions import RedisError

from pagedserve.gateway.answers.reasoning import ReasoningCount, ReasoningStream
from pagedserve.gateway.answers.text import Pieces, parsed_tools, whole_answer
from pagedserve.gateway.bodies.parse import ParsedRequest, joined_text, parse
from pagedserve.gateway.bodies.responses import ResponsesRequest
from pagedserve.gateway.bodies.validation import validated
from pagedserve.gateway.http import sse
from pagedserve.gateway.http.api_error import ApiError
from pagedserve.gateway.routes.answer_parts import Collected, deltas
from pagedserve.gateway.service.generation import STATE, generation, read_json
from pagedserve.shared.protocol import OutputDelta


def chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completion body ``req`` amounts to, after the stored conversation ``history``."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + conversation_of(req)
    body = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens, "stream": req.stream,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
            "user": req.user, "priority": req.priority, "parallel_tool_calls": req.parallel_tool_calls}
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "answer", "schema": fmt.schema_ or {}}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.parameters or {"type": "object"}}}
                         for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
    return {k: v for k, v in body.items() if v is not None}


def conversation_of(req: ResponsesRequest) -> list[dict]:
    """The input's items as chat messages (consecutive calls in one assistant message)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for item in req.input:
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            out.append({"role": item.role, "content": joined_text(item.content)})
    return out


class Answer(Collected):
    """One response as it comes: its text, how it ended, its output items and the response object."""

    def __init__(self, req: ResponsesRequest, parsed: ParsedRequest, tool_parser: str, reasoning_parser: str | None) -> None:
        super().__init__()
        self.req, self.parsed, self.tool_parser, self.reasoning_parser = req, parsed, tool_parser, reasoning_parser
        self.id, self.created = "resp_" + uuid.uuid4().hex, int(time.time())
        self.tools = parsed_tools(parsed.tools)
        self.message_id, self.reasoning_id = "msg_" + uuid.uuid4().hex, "rs_" + uuid.uuid4().hex
        self.settled: tuple[str | None, str | None, list[dict]] | None = None  # parts(), once known
        self.thinking = ReasoningCount(ReasoningStream(reasoning_parser)) if reasoning_parser else None

    def add(self, delta: OutputDelta) -> None:
        super().add(delta)
        if self.thinking is not None:
            self.thinking.add(delta.text, len(delta.token_ids), final=delta.finish_reason is not None)

    @property
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def parts(self) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning, text, tool calls) of the whole answer, found once (a call keeps its id)."""
        if self.settled is None:
            self.settled = whole_answer(self.text, self.reasoning_parser, self.tools, self.tool_parser)
        return self.settled

    def reasoning_item(self, text: str) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": self.status}

    def message_item(self, text: str, status: str | None = None) -> dict:
        return {"type": "message", "id": self.message_id, "status": status or self.status, "role": "assistant",
                "content": [output_text(text)] if status is None else []}

    def call_item(self, call: dict) -> dict:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def response(self, input_tokens: int, output: list[dict] | None = None, status: str | None = None,
                 cached_tokens: int = 0) -> dict:
        """The response object: ``output`` and ``status`` given while it streams, else the answer's;
        ``cached_tokens``: the prompt tokens the prefix cache served (known once it ended)."""
        if output is None:
            thinking, content, calls = self.parts()
            output = ([self.reasoning_item(thinking)] if thinking else []) + \
                     ([self.message_item(content)] if content else []) + [self.call_item(c) for c in calls]
        req, status = self.req, status or self.status
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.parsed.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "temperature": self.parsed.params.temperature,
            "top_p": self.parsed.params.top_p, "tool_choice": _dump(req.tool_choice) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "text": {"format": _dump(req.text.format) if req.text and req.text.format else {"type": "text"}},
            "store": req.store is not False, "metadata": req.metadata or {}, "user": req.user,
            "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": self.thinking.tokens if self.thinking else 0},
                      "total_tokens": input_tokens + self.output_tokens},
        }

    def turn(self) -> list[dict]:
        """The answer as chat messages, for the stored conversation."""
        _, content, calls = self.parts()
        return [{"role": "assistant", "content": content or "", **({"tool_calls": calls} if calls else {})}]


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _dump(value):
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = validated(ResponsesRequest, await read_json(request))
    state.note_ignored(tuple(sorted(req.model_extra or ())))
    history = await _history(state, req.previous_response_id)
    body = chat_body(req, history)
    parsed = parse(body, True, state.limits, state.sampling_defaults)
    async with generation(request, parsed) as sent:
        answer = Answer(req, parsed, state.settings.tool_call_parser, state.settings.reasoning_parser)
        prompt_tokens = len(sent.prompts[0])
        if parsed.stream:
            response = await sse.open_stream(request)
            writes = _stream(response, state, parsed, answer, sent, history + conversation_of(req))
            return await sse.until_client_gone(request, response, writes)
        async for _ in deltas(state, parsed, sent, answer):
            pass
        state.metrics.e2e.labels(parsed.model).observe(time.monotonic() - sent.tally.started)
        result = answer.response(prompt_tokens, cached_tokens=sent.tally.cached_tokens)
        await _store(state, answer, result, history + conversation_of(req))
        return web.json_response(result)


async def _history(state, response_id: str | None) -> list[dict]:
    if response_id is None:
        return []
    stored = await state.redis.get(state.keys.stored_response(response_id))
    if stored is None:
        raise ApiError(400, f"no stored response {response_id!r} (never stored, deleted, or expired)",
                       "previous_response_id", "previous_response_not_found")
    return json.loads(stored)["messages"]


async def _store(state, answer: Answer, result: dict, before: list[dict]) -> None:
    """Keep the answer and its conversation (``store``); Redis unreachable: a 503 saying the answer
    was made but not kept (streamed: an ``error`` event after its text), never a half-written stream."""
    if answer.req.store is False:
        return
    record = json.dumps({"response": result, "messages": before + answer.turn()}, ensure_ascii=False)
    try:
        await state.redis.set(state.keys.stored_response(answer.id), record, ex=max(1, int(state.settings.responses_ttl_s)))
    except RedisError as err:
        raise ApiError(503, f"the response {answer.id} was made but could not be stored ({type(err).__name__}); "
                            "send it again, or with store: false", None, "store_failed", "service_unavailable") from None


async def retrieve(request: web.Request) -> web.Response:
    state, response_id = request.app[STATE], request.match_info["response_id"]
    stored = await state.redis.get(state.keys.stored_response(response_id))
    if stored is None:
        raise ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found")
    return web.json_response(json.loads(stored)["response"])


async def delete(request: web.Request) -> web.Response:
    state, response_id = request.app[STATE], request.match_info["response_id"]
    if not await state.redis.delete(state.keys.stored_response(response_id)):
        raise ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


class Events:
    """A streamed response's typed events, numbered (``sequence_number``), and its output items:
    an item is added when text of its kind first comes and done before the next begins."""

    def __init__(self, response: web.StreamResponse, answer: Answer) -> None:
        self.response, self.answer, self.number = response, answer, 0
        self.items: list[dict] = []  # done items
        self.open: dict | None = None  # the item being written: reasoning or message
        self.text = ""

    async def send(self, kind: str, **fields) -> None:
        await self.response.write(sse.frame({"type": kind, "sequence_number": self.number, **fields}, kind))
        self.number += 1

    async def write(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.open is None or self.open["type"] != kind:
            await self.close()
            start = self.answer.reasoning_item("") if kind == "reasoning" else self.answer.message_item("", "in_progress")
            self.open, self.text = start, ""
            await self.send("response.output_item.added", output_index=len(self.items), item=start)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("")
            await self.send("response.content_part.added", item_id=start["id"], output_index=len(self.items),
                            content_index=0, part=part)
        self.text += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        await self.send(event, item_id=self.open["id"], output_index=len(self.items), content_index=0, delta=text,
                        **({} if kind == "reasoning" else {"logprobs": []}))

    async def close(self) -> None:
        if self.open is None:
            return
        item, index, text = self.open, len(self.items), self.text
        reasoning = item["type"] == "reasoning"
        part = {"type": "reasoning_text", "text": text} if reasoning else output_text(text)
        await self.send("response.reasoning_text.done" if reasoning else "response.output_text.done", item_id=item["id"],
                        output_index=index, content_index=0, text=text, **({} if reasoning else {"logprobs": []}))
        await self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        done = self.answer.reasoning_item(text) if reasoning else self.answer.message_item(text)
        await self.send("response.output_item.done", output_index=index, item=done)
        self.items.append(done)
        self.open = None

    async def call(self, call: dict) -> None:
        await self.close()
        item, index = self.answer.call_item(call), len(self.items)
        await self.send("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
        await self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
        await self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"])
        await self.send("response.output_item.done", output_index=index, item=item)
        self.items.append(item)


async def _stream(response: web.StreamResponse, state, parsed: ParsedRequest, answer: Answer, sent,
                  before: list[dict]) -> None:
    events, prompt_tokens = Events(response, answer), len(sent.prompts[0])
    pieces = Pieces(answer.reasoning_parser, answer.tools, answer.tool_parser)
    thinking = content = ""
    started = answer.response(prompt_tokens, [], "in_progress")
    await events.send("response.created", response=started)
    await events.send("response.in_progress", response=started)
    try:
        async for delta in deltas(state, parsed, sent, answer):
            thought, text, _ = pieces.feed(delta.text, delta.finish_reason is not None)
            await events.write("reasoning", thought)
            await events.write("message", text)
            thinking, content = thinking + thought, content + text
        answer.settled = thinking or None, content or None, pieces.calls  # what was streamed is the answer
        for call in pieces.calls:
            await events.call(call)
        await events.close()
        result = answer.response(prompt_tokens, events.items, cached_tokens=sent.tally.cached_tokens)
        await _store(state, answer, result, before)
        await events.send(f"response.{answer.status}", response=result)
    except ApiError as err:
        await events.send("error", code=err.code, message=err.message, param=err.param)
    state.metrics.e2e.labels(parsed.model).observe(time.monotonic() - sent.tally.started)
    await response.write_eof()

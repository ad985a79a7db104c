"""``POST /v1/completions`` and ``POST /v1/chat/completions``: validate, then send the request
(``gateway/service/generation.py``) and stream its events back as SSE chunks or collect them into one response.

A request with several prompts becomes one wire request per prompt (choice index = prompt index
x n + output index).
"""

from __future__ import annotations

import time
from dataclasses import replace

from aiohttp import web

from pagedserve.gateway.answers.openai_chunks import Choice, Renderer, usage
from pagedserve.gateway.answers.text import Pieces
from pagedserve.gateway.bodies.parse import ApiError, ParsedRequest, parse
from pagedserve.gateway.http import sse
from pagedserve.gateway.service.generation import STATE, Tally, account, generation, read_json


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    parsed = parse(await read_json(request), chat, state.limits, state.sampling_defaults)
    async with generation(request, parsed) as sent:
        renderer = Renderer(chat, sent.id, int(time.time()), parsed.model, parsed.params.logprobs,
                            parsed.tools, state.settings.tool_call_parser, state.settings.reasoning_parser)
        if parsed.stream:
            return await _stream(request, state, parsed, renderer, sent.events, sent.tally, [len(p) for p in sent.prompts])
        return await _collect(state, parsed, renderer, sent.events, sent.prompts, sent.tally)


async def _collect(state, parsed: ParsedRequest, renderer: Renderer, events, prompts: list[list[int]],
                   tally: Tally) -> web.Response:
    n = parsed.params.n
    choices = [Choice(i) for i in range(len(prompts) * n)]
    prompt_tokens = completion_tokens = 0
    prompt_entries: dict[int, list] = {}
    async for index, event in events:
        account(state, parsed, event, tally, time.monotonic())
        if event.done and event.finish_reason == "error":
            raise ApiError(502, event.error or "the worker failed", None, "worker_error", "server_error")
        for delta in event.outputs:
            choices[index * n + delta.index].add(delta)
        if event.done and event.usage:
            prompt_tokens += event.usage["prompt_tokens"]
            completion_tokens += event.usage["completion_tokens"]
        if event.prompt_logprobs is not None:
            prompt_entries[index] = event.prompt_logprobs
    state.metrics.e2e.labels(parsed.model).observe(time.monotonic() - tally.started)
    if parsed.echo:
        _echo(state, parsed, choices, prompts, prompt_entries)
    return web.json_response(renderer.response(choices, usage(prompt_tokens, completion_tokens, tally.cached_tokens)))


def _echo(state, parsed: ParsedRequest, choices: list[Choice], prompts: list[list[int]],
          prompt_entries: dict[int, list]) -> None:
    """Put each prompt before its choices: its text as sent (decoded when sent as token ids) and,
    with logprobs, its tokens' entries (the first token has no logprob)."""
    sent = parsed.prompt if isinstance(parsed.prompt, list) else [parsed.prompt]
    for index, ids in enumerate(prompts):
        text = sent[index] if isinstance(sent[index], str) else state.tokenizer.decode(ids)
        entries = []
        if parsed.params.prompt_logprobs is not None:
            wire = prompt_entries.get(index) or [None]
            first = {"token_id": ids[0], "token": state.tokenizer.decode(ids[:1]), "logprob": None, "top": None,
                     "top_tokens": {}}
            entries = [first, *wire[1:]]
        for k in range(parsed.params.n):
            choices[index * parsed.params.n + k].echo(text, entries)


async def _stream(request, state, parsed: ParsedRequest, renderer: Renderer, events, tally: Tally,
                  prompt_lens: list[int]) -> web.StreamResponse:
    response = await sse.open_stream(request)
    writes = _write_stream(response, state, parsed, renderer, events, tally, prompt_lens)
    return await sse.until_client_gone(request, response, writes)


async def _write_stream(response: web.StreamResponse, state, parsed: ParsedRequest, renderer: Renderer, events,
                        tally: Tally, prompt_lens: list[int]) -> None:
    n = parsed.params.n
    first_sent: set[int] = set()
    offsets: dict[int, int] = {}
    generated: dict[int, int] = {}  # tokens so far per choice, for continuous usage stats
    pieces: dict[int, Pieces] = {}  # per choice: its thinking, answer and calls as they stream
    prompt_tokens = completion_tokens = 0
    try:
        async for index, event in events:
            account(state, parsed, event, tally, time.monotonic())
            if event.done and event.finish_reason == "error":
                await response.write(sse.frame(ApiError(502, event.error or "the worker failed", None, "worker_error", "server_error").body()))
                break
            for delta in event.outputs:
                choice = index * n + delta.index
                reason = delta.finish_reason
                if choice not in pieces:
                    pieces[choice] = Pieces(renderer.reasoning_parser, renderer.tools, renderer.tool_parser)
                thought, text, calls = pieces[choice].feed(delta.text, reason is not None)
                delta = replace(delta, text=text, finish_reason=None if calls else reason)
                chunk = renderer.chunk(choice, delta, choice not in first_sent, parsed.include_usage, offsets.get(choice, 0),
                                       thought)
                first_sent.add(choice)
                offsets[choice] = offsets.get(choice, 0) + len(delta.text)
                generated[choice] = generated.get(choice, 0) + len(delta.token_ids)
                if parsed.continuous_usage:
                    chunk["usage"] = usage(prompt_lens[index], generated[choice])
                await response.write(sse.frame(chunk))
                if calls:
                    await response.write(sse.frame(renderer.tool_calls_chunk(choice, calls, reason, parsed.include_usage)))
            if event.done and event.usage:
                prompt_tokens += event.usage["prompt_tokens"]
                completion_tokens += event.usage["completion_tokens"]
        else:
            if parsed.include_usage:
                await response.write(sse.frame(renderer.usage_chunk(usage(prompt_tokens, completion_tokens, tally.cached_tokens))))
    except ApiError as err:
        await response.write(sse.frame(err.body()))
    state.metrics.e2e.labels(parsed.model).observe(time.monotonic() - tally.started)
    await response.write(sse.DONE)
    await response.write_eof()

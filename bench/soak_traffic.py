"""The soak's traffic (``bench/soak.py``): a user sends one request after another, each of a kind
drawn at random (seeded per user), and every request's outcome is counted: ``ok``, ``backpressure``
(429/503: the gateway refusing work before doing any), ``client_cut`` (this client left on purpose,
mid-stream or mid-wait), ``deadline`` (the request's ``timeout`` ended it), ``failed`` (anything
else: a 5xx, another 4xx for a valid body, a stream without its end, an exception)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

SYSTEMS = [f"You are assistant {i}. " + "Answer briefly and keep to the facts of paged memory. " * 6 for i in range(3)]
WORDS = "page block table copy write swap cache prefix token batch stream worker queue".split()
SCHEMA = {"type": "object", "properties": {"size": {"type": "integer"}}, "required": ["size"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "evict", "parameters": {
    "type": "object", "properties": {"block": {"type": "integer"}}, "required": ["block"]}}}


@dataclass
class Outcomes:
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.counts[f"{kind}:{outcome}"] = self.counts.get(f"{kind}:{outcome}", 0) + 1
        if outcome == "failed":
            self.failures.append(f"{kind}: {detail}"[:300])


def _ask(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))


def _status(r: httpx.Response) -> str | None:
    if r.status_code in (429, 503):
        return "backpressure"
    return None if r.status_code == 200 else "failed"


async def _stream(http: httpx.AsyncClient, path: str, body: dict, end_of: tuple[str, ...],
                  leave_after: int | None = None) -> tuple[str, str]:
    """Send a streamed request; (outcome, detail). ``end_of``: the events that end it well
    ("[DONE]" for OpenAI's chunks, or the last event's types); ``leave_after``: chunks read before
    this client goes away."""
    seen = 0
    async with http.stream("POST", path, json=body) as r:
        if (outcome := _status(r)) is not None:
            return outcome, f"{r.status_code} {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            seen += 1
            if leave_after is not None and seen >= leave_after:
                return "client_cut", ""
            data = line[6:]
            if data == "[DONE]" or (data.startswith("{") and json.loads(data).get("type") in end_of):
                return "ok", ""
            if '"error"' in data[:20]:
                return "failed", data[:200]
    return "failed", f"the stream ended without {end_of} after {seen} events"


async def one(http: httpx.AsyncClient, model: str, rng: random.Random) -> tuple[str, str, str]:
    """One request of a kind drawn from ``rng``: (kind, outcome, detail)."""
    kind = rng.choice(["chat_stream", "chat_stream", "completion_n", "beam", "structured", "tools", "responses",
                       "messages", "disconnect", "deadline", "cancel"])
    chat = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": _ask(rng)}]
    base = {"model": model, "priority": rng.randint(-5, 5), "seed": rng.randint(0, 1000), "temperature": 1.0}
    if kind == "chat_stream":
        return (kind, *await _stream(http, "/v1/chat/completions", {**base, "messages": chat, "stream": True,
                                                                     "max_tokens": rng.randint(8, 40)}, ("[DONE]",)))
    if kind == "disconnect":
        return (kind, *await _stream(http, "/v1/completions", {**base, "prompt": _ask(rng), "stream": True,
                                                               "max_tokens": 64, "ignore_eos": True}, ("[DONE]",), 2))
    if kind == "responses":
        body = {**base, "input": chat[1]["content"], "instructions": chat[0]["content"], "max_output_tokens": 16,
                "store": False}
        if rng.random() < 0.5:
            return (kind, *await _stream(http, "/v1/responses", {**body, "stream": True},
                                         ("response.completed", "response.incomplete")))
    if kind == "messages":
        body = {**base, "temperature": 0.7, "system": chat[0]["content"], "messages": chat[1:], "max_tokens": 16}
        if rng.random() < 0.5:
            return (kind, *await _stream(http, "/v1/messages", {**body, "stream": True}, ("message_stop",)))
    bodies = {
        "completion_n": ("/v1/completions", {**base, "prompt": _ask(rng), "n": 2, "max_tokens": rng.randint(8, 24)}),
        "beam": ("/v1/completions", {**base, "prompt": _ask(rng), "use_beam_search": True, "beam_width": 2,
                                     "temperature": 0.0, "max_tokens": 8}),
        "structured": ("/v1/chat/completions", {**base, "messages": chat, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "size", "schema": SCHEMA}}}),
        "tools": ("/v1/chat/completions", {**base, "messages": chat, "max_tokens": 40, "tools": [TOOL],
                                           "tool_choice": "required"}),
        "deadline": ("/v1/completions", {**base, "prompt": _ask(rng), "max_tokens": 300, "ignore_eos": True, "timeout": 0.3}),
        "cancel": ("/v1/completions", {**base, "prompt": _ask(rng), "max_tokens": 200, "ignore_eos": True}),
        "responses": ("/v1/responses", body if kind == "responses" else {}),
        "messages": ("/v1/messages", body if kind == "messages" else {}),
    }
    path, body = bodies[kind]
    try:
        r = await asyncio.wait_for(http.post(path, json=body), 0.3 if kind == "cancel" else None)
    except asyncio.TimeoutError:  # this client went away mid-wait, on purpose
        return kind, "client_cut", ""
    if (outcome := _status(r)) is not None:
        return kind, outcome if kind != "deadline" or r.status_code != 504 else "deadline", r.text[:200]
    if kind == "deadline":
        return kind, "deadline" if r.json()["choices"][0]["finish_reason"] == "abort" else "ok", ""
    return kind, "ok", ""


async def user(http: httpx.AsyncClient, model: str, index: int, go: asyncio.Event, end: float, outcomes: Outcomes) -> None:
    """Requests one after another until ``end``, pausing while ``go`` is clear (an idle point)."""
    rng = random.Random(1000 + index)
    while time.monotonic() < end:
        await go.wait()
        try:
            kind, outcome, detail = await one(http, model, rng)
        except (httpx.HTTPError, ValueError, KeyError) as err:
            kind, outcome, detail = "?", "failed", f"{type(err).__name__}: {err}"
        outcomes.add(kind, outcome, detail)

"""Wire protocol: msgpack messages with a version field. Documented for other languages in
docs/protocol.md. These are wire types; the engine's types live in worker/.

- ``WireRequest``: one entry (field ``data``) on a model's request stream.
- ``WireEvent``: what comes back, batched: one pub/sub message (or result-stream entry, field
  ``data``) carries a msgpack *list* of events, one per request that changed in an engine step.
  Every request gets events with ``seq`` 0, 1, 2 … and exactly one with ``done: true``.
- ``WireCancel``: on the model's cancel channel, asks the worker holding ``id`` to abort it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams

VERSION = 1
MAX_ID_LEN = 256


class ProtocolError(InvalidRequestError):
    """A message that cannot be decoded or does not follow the schema."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"malformed msgpack: {err}") from None


@dataclass(frozen=True)
class ReplyTarget:
    kind: str  # "channel" (pub/sub) or "stream" (durable result stream)
    name: str

    def to_wire(self) -> dict:
        return {self.kind: self.name}

    @classmethod
    def from_wire(cls, value: Any) -> "ReplyTarget":
        if not isinstance(value, dict) or len(value) != 1:
            raise ProtocolError('reply must be {"channel": name} or {"stream": name}', "reply")
        (kind, name), = value.items()
        if kind not in ("channel", "stream") or not isinstance(name, str) or not name:
            raise ProtocolError('reply must be {"channel": name} or {"stream": name}', "reply")
        return cls(kind, name)


def can_resume(params: SamplingParams) -> bool:
    """Whether a request interrupted mid-stream can go on elsewhere from the tokens already sent:
    one output, no beam search, no ``best_of`` (those keep state that was never sent)."""
    return params.n == 1 and not params.use_beam_search and params.best_of is None


@dataclass(frozen=True)
class Resume:
    """Where a request taken over mid-stream goes on: the output tokens its client already has
    (they count towards ``max_tokens``, penalties and seeded draws) and the ``seq`` of the next event."""

    token_ids: list[int]
    seq: int

    @classmethod
    def from_wire(cls, value: Any, params: SamplingParams) -> "Resume":
        if not isinstance(value, dict):
            raise ProtocolError('resume must be {"token_ids": [int], "seq": int}', "resume")
        ids, seq = value.get("token_ids"), value.get("seq")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ProtocolError("resume.token_ids must be a list of integers", "resume")
        if type(seq) is not int or seq < 0:
            raise ProtocolError("resume.seq must be an integer >= 0", "resume")
        if not can_resume(params):
            raise ProtocolError("only n = 1 requests without beam search or best_of can resume", "resume")
        if len(ids) >= params.max_tokens:
            raise ProtocolError("resume.token_ids must be fewer than max_tokens", "resume")
        return cls(ids, seq)


@dataclass(frozen=True)
class WireRequest:
    id: str
    model: str
    params: SamplingParams
    reply: ReplyTarget
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    created: float = 0.0
    deadline: float | None = None  # wall-clock seconds (time.time())
    priority: int = 0
    tenant: str | None = None
    resume: Resume | None = None  # set by a client re-sending a request whose worker died mid-stream
    adapter: str | None = None  # a LoRA adapter the model's workers hold (WorkerInfo.adapters); None: the base model

    def encode(self) -> bytes:
        body = {k: v for k, v in asdict(self).items() if k not in ("params", "reply")}
        return pack({"v": VERSION, **body, "params": self.params.to_dict(), "reply": self.reply.to_wire()})

    @classmethod
    def decode(cls, data: bytes) -> "WireRequest":
        msg = _versioned(unpack(data))
        _require(msg, "id", str)
        if not msg["id"] or len(msg["id"]) > MAX_ID_LEN:
            raise ProtocolError(f"id must be 1..{MAX_ID_LEN} characters", "id")
        _require(msg, "model", str)
        sources = [k for k in ("prompt", "prompt_token_ids", "messages") if msg.get(k) is not None]
        if len(sources) != 1:
            raise ProtocolError("give exactly one of prompt, prompt_token_ids, messages", "prompt")
        _check_prompt(msg)
        for name, kinds in (("created", (int, float)), ("deadline", (int, float, type(None))),
                            ("priority", (int,)), ("tenant", (str, type(None))), ("adapter", (str, type(None)))):
            if name in msg and (isinstance(msg[name], bool) or not isinstance(msg[name], kinds)):
                raise ProtocolError(f"{name} has the wrong type", name)
        params = msg.get("params", {})
        if not isinstance(params, dict):
            raise ProtocolError("params must be a map", "params")
        sampling = SamplingParams.from_dict(params)
        resume = msg.get("resume")
        return cls(
            id=msg["id"], model=msg["model"], params=sampling,
            reply=ReplyTarget.from_wire(msg.get("reply")), prompt=msg.get("prompt"),
            prompt_token_ids=msg.get("prompt_token_ids"), messages=msg.get("messages"),
            created=float(msg.get("created", 0.0)), deadline=msg.get("deadline"),
            priority=msg.get("priority", 0), tenant=msg.get("tenant"),
            resume=None if resume is None else Resume.from_wire(resume, sampling), adapter=msg.get("adapter"),
        )


@dataclass(frozen=True)
class OutputDelta:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top": {id: logprob}}
    stop_reason: str | int | None = None  # with finish_reason "stop": the stop string or stop token id that matched


@dataclass(frozen=True)
class WireEvent:
    id: str
    seq: int  # 0, 1, 2 … per request; -1 on a terminal error sent by a worker that took over
    outputs: list[OutputDelta] = field(default_factory=list)
    done: bool = False
    finish_reason: str | None = None  # on the terminal event: stop | length | abort | error
    error: str | None = None
    usage: dict | None = None  # on the terminal event: prompt_tokens, completion_tokens, cached_tokens (the prefix cache's)
    resumable: bool = False  # on a takeover's error: the client may re-send with ``resume``
    queue_s: float | None = None  # on a request's first event: seconds from created to first scheduled
    # on the terminal event of a request with prompt_logprobs: None, then an entry (as in OutputDelta) per position
    prompt_logprobs: list[dict | None] | None = None
    embedding: list[float] | None = None  # on the terminal event of an embedding (params.pooling): the vector
    # the delivery count of the entry the sender holds (1: read first; each takeover adds one; 0:
    # not said): a reader takes the highest it has seen, so a worker that lost its entry while cut
    # off from Redis and sends late cannot mix its events into the new holder's
    delivery: int = 0

    def to_wire(self) -> dict:
        return {"v": VERSION, **asdict(self)}

    @classmethod
    def from_wire(cls, msg: Any) -> "WireEvent":
        msg = _versioned(msg)
        outputs = [OutputDelta(**o) for o in msg.get("outputs", [])]
        return cls(msg["id"], msg["seq"], outputs, msg.get("done", False), msg.get("finish_reason"),
                   msg.get("error"), msg.get("usage"), bool(msg.get("resumable", False)), _seconds(msg.get("queue_s")),
                   _prompt_logprobs(msg.get("prompt_logprobs")), _embedding(msg.get("embedding")),
                   _delivery(msg.get("delivery", 0)))


def _prompt_logprobs(value: Any) -> list[dict | None] | None:
    if value is not None and not (isinstance(value, list) and all(e is None or isinstance(e, dict) for e in value)):
        raise ProtocolError("prompt_logprobs must be a list of entries", "prompt_logprobs")
    return value


def _delivery(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError("delivery must be an integer >= 0", "delivery")
    return value


def _embedding(value: Any) -> list[float] | None:
    if value is not None and not (isinstance(value, list) and all(isinstance(v, float) for v in value)):
        raise ProtocolError("embedding must be a list of floats", "embedding")
    return value


def encode_events(events: list[WireEvent]) -> bytes:
    return pack([e.to_wire() for e in events])


def decode_events(data: bytes) -> list[WireEvent]:
    return [WireEvent.from_wire(m) for m in unpack(data)]


@dataclass(frozen=True)
class WireCancel:
    id: str
    reason: str = "cancelled"

    def encode(self) -> bytes:
        return pack({"v": VERSION, "id": self.id, "reason": self.reason})

    @classmethod
    def decode(cls, data: bytes) -> "WireCancel":
        msg = _versioned(unpack(data))
        _require(msg, "id", str)
        return cls(msg["id"], str(msg.get("reason", "cancelled")))


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _versioned(msg: Any) -> dict:
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a msgpack map")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"unsupported protocol version {msg.get('v')!r} (this worker speaks {VERSION})", "v")
    return msg


def _require(msg: dict, name: str, kind: type) -> None:
    if not isinstance(msg.get(name), kind):
        raise ProtocolError(f"{name} is required and must be a {kind.__name__}", name)


def _check_prompt(msg: dict) -> None:
    if msg.get("prompt") is not None and not isinstance(msg["prompt"], str):
        raise ProtocolError("prompt must be a string", "prompt")
    ids = msg.get("prompt_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(type(t) is int for t in ids)):
        raise ProtocolError("prompt_token_ids must be a list of integers", "prompt_token_ids")
    messages = msg.get("messages")
    if messages is not None and (
        not isinstance(messages, list) or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    ):
        raise ProtocolError("messages must be a non-empty list of {role, content} string maps", "messages")

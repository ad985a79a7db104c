"""OpenAI request bodies -> validated internal requests. Every problem is an ``ApiError`` (a 4xx in
OpenAI's error shape) naming the parameter. Fields nobody here knows are accepted and reported back
(``ParsedRequest.ignored``, logged once per name by the route), as vLLM does; OpenAI fields whose
effect we cannot give (``suffix``, ``tools`` on completions, ``echo`` on chat…) are accepted only at
their no-op value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.gateway.structured_fields import FIELDS as STRUCTURED_FIELDS, structured_outputs
from pagedserve.gateway.tool_calls import ToolRequest, template_messages, tool_request
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.prompts import is_token_id
from pagedserve.shared.sampling import BOUNDS, SamplingParams
from pagedserve.shared.structured import StructuredOutputs


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type_, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logprobs", "stream", "stream_options", "user", "priority",
          "timeout", "min_tokens", "ignore_eos", "stop_token_ids"}
BEAM = {"use_beam_search", "beam_width", "length_penalty", "early_stopping"}  # extension fields
COMPLETION_FIELDS = COMMON | BEAM | STRUCTURED_FIELDS | {"prompt", "best_of", "echo"}
CHAT_FIELDS = COMMON | BEAM | STRUCTURED_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                                   "tool_choice", "parallel_tool_calls"}
# OpenAI fields whose effect pagedserve does not give: accepted at these no-op values, a 400 otherwise.
INERT_VALUES = {
    "suffix": (None, ""), "logit_bias": (None, {}),
    "functions": (None, []), "function_call": (None, "none", "auto"),  # the deprecated forms of tools
}
COMPLETION_INERT = {"tools": (None, []), "tool_choice": (None, "none", "auto")}  # tools are for chat
CHAT_INERT = {"echo": (None, False)}  # echo is for completions
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "best_of"} | BEAM


PRIORITY_RANGE = (-1000, 1000)  # lower runs first
# Integer fields: a JSON Schema "integer" includes integral floats (``6.0``), so they are taken as ints.
INTEGER_FIELDS = frozenset({name for name, bound in BOUNDS.items() if bound.kind is int}
                           | {"max_completion_tokens", "top_logprobs", "priority"})
MAX_USER_LEN = 256


@dataclass(frozen=True)
class Limits:
    max_choices: int = 64  # prompts x n of one request: each prompt is its own queue entry
    max_n: int = 16
    max_tokens: int = 4096
    max_stop: int = 4
    max_stop_len: int = 256
    default_chat_max_tokens: int = 256


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    model: str
    prompt: Any  # completions: str | [str] | [int] | [[int]]; chat: messages
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    timeout: float | None
    user: str | None
    continuous_usage: bool = False  # include_usage + continuous_usage_stats: usage so far on every chunk (vLLM)
    ignored: tuple[str, ...] = ()  # body fields nobody here knows, accepted without effect
    tools: ToolRequest | None = None  # chat: the tools the template sees and how calls are made
    constraint_field: str | None = None  # the field params.structured came from (a 400 about it names it)
    echo: bool = False  # completions: the prompt comes back before each choice's text (and logprobs)


def parse(body: Any, chat: bool, limits: Limits, defaults: dict | None = None) -> ParsedRequest:
    """``defaults``: sampling parameters (the model's generation config) for fields the body leaves unset."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    body = {k: int(v) if k in INTEGER_FIELDS and is_token_id(v) and isinstance(v, float) else v for k, v in body.items()}
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    inert_fields = {**INERT_VALUES, **(CHAT_INERT if chat else COMPLETION_INERT)}
    for key, inert in inert_fields.items():
        if key in body and body[key] not in inert:
            raise ApiError(400, f"{key!r} is not supported (accepted only as {inert[1]!r})", key, "unsupported_parameter")
    ignored = tuple(sorted(k for k in body if k not in allowed and k not in inert_fields))
    model = _typed(body, "model", str, required=True)
    prompt = chat_messages(body) if chat else completion_prompt(body)
    stream = _typed(body, "stream", bool, default=False)
    options = _stream_options(body) if stream else (_stream_options(body) and {})  # checked; no chunks to shape without stream
    max_tokens = body.get("max_completion_tokens") if chat and "max_completion_tokens" in body else body.get("max_tokens")
    if max_tokens is None:
        max_tokens = limits.default_chat_max_tokens if chat else 16
    sampling = {**(defaults or {}), **{k: body[k] for k in SAMPLING_FIELDS if k in body and body[k] is not None}}
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > limits.max_stop or not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_len for s in stop):
            raise ApiError(400, f"stop must be a string or up to {limits.max_stop} non-empty strings of <= {limits.max_stop_len} characters", "stop")
        sampling["stop"] = stop
    n = 1 if body.get("n") is None else body["n"]
    for name in ("n", "best_of", "beam_width"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_n:
            raise ApiError(400, f"{name} must be <= {limits.max_n}", name)
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):  # both checked, one used
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limits.max_tokens):
            raise ApiError(400, f"{name} must be an integer in [1, {limits.max_tokens}]", name)
    sampling["logprobs"] = _logprobs(body, chat)
    echo = _echo(body, chat, stream, sampling)
    sampling["structured"], constraint_field, tools = _constraints(body, chat)
    try:
        params = SamplingParams(n=n, max_tokens=max_tokens, **sampling)
    except (InvalidRequestError, TypeError) as err:
        raise ApiError(400, str(err), getattr(err, "field", None)) from None
    choices = (len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1) * n
    if choices > limits.max_choices:
        raise ApiError(400, f"prompts x n is {choices}; at most {limits.max_choices} per request", "prompt" if not chat else "n")
    priority = _typed(body, "priority", int, default=0)
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise ApiError(400, f"priority must be in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]", "priority")
    user = _typed(body, "user", str, default=None)
    if user is not None and len(user) > MAX_USER_LEN:
        raise ApiError(400, f"user must be at most {MAX_USER_LEN} characters", "user")
    timeout = _typed(body, "timeout", (int, float), default=None)
    if timeout is not None and not 0 < timeout <= 3600:
        raise ApiError(400, "timeout must be in (0, 3600] seconds", "timeout")
    return ParsedRequest(chat, model, prompt, params, stream, bool(options.get("include_usage")), priority, timeout,
                         user, bool(options.get("include_usage") and options.get("continuous_usage_stats")), ignored, tools,
                         constraint_field, echo)


def _echo(body: dict, chat: bool, stream: bool, sampling: dict) -> bool:
    """Completions' ``echo``; with logprobs the prompt's tokens get them too (lm-evaluation-harness)."""
    echo = not chat and _typed(body, "echo", bool, default=False)
    if echo and stream:
        raise ApiError(400, "echo is not supported with stream (send it without streaming)", "echo", "unsupported_parameter")
    if echo and sampling["logprobs"] is not None:
        sampling["prompt_logprobs"] = sampling["logprobs"]
    return echo


def _constraints(body: dict, chat: bool) -> tuple[StructuredOutputs | None, str | None, ToolRequest | None]:
    """What constrains the output (a response format, or the grammar of a forced tool call: not
    both), the request field it came from, and the chat's tools."""
    refuse = lambda message, param: ApiError(400, message, param)  # noqa: E731
    structured, field = structured_outputs(body, refuse)
    tools = tool_request(body, refuse) if chat else None
    try:
        forced = tools.constraint() if tools is not None else None
    except InvalidRequestError as err:  # a tool's parameters are not a schema the grammar can follow
        raise ApiError(400, f"tools: {err}", "tools") from None
    if forced is not None and structured is not None:
        raise ApiError(400, "a forced tool call (tool_choice) and a response format cannot both constrain the output",
                       "tool_choice")
    return (forced, "tools", tools) if forced is not None else (structured, field, tools)


def _stream_options(body: dict) -> dict:
    options = _typed(body, "stream_options", dict, default={})
    unknown = set(options) - STREAM_OPTIONS
    if unknown or not all(isinstance(v, bool) or v is None for v in options.values()):
        raise ApiError(400, f"stream_options takes booleans {sorted(STREAM_OPTIONS)}", "stream_options")
    return options


def _typed(body: dict, name: str, kind, required: bool = False, default=None):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"{name!r} is required", name, "missing_required_parameter")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"{name!r} has the wrong type", name, "invalid_type")
    return value


def completion_prompt(body: dict):
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) and p for p in prompt):
            return prompt
        if all(is_token_id(t) for t in prompt):
            return prompt
        if all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompt):
            return prompt
    raise ApiError(400, "prompt must be a non-empty string, list of strings, token ids or lists of token ids", "prompt")


ROLES = ("system", "user", "assistant", "developer", "tool")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    return template_messages([_message(m, i) for i, m in enumerate(messages)])


def _message(message: dict, index: int) -> dict:
    """One message as the chat template sees it: its text, and an assistant's tool calls or a tool
    result's call id."""
    param = f"messages[{index}]"
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{param}.role must be one of {', '.join(ROLES)}", param)
    out = {"role": "system" if role == "developer" else role, "content": _content(message, param)}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not _well_formed_calls(calls):
            raise ApiError(400, f"{param}.tool_calls must be an assistant's list of "
                                '{"id", "type": "function", "function": {"name", "arguments"}}', param)
        out["tool_calls"] = calls
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ApiError(400, f"{param}: a tool message needs the tool_call_id it answers", param)
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _well_formed_calls(calls) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("id", ""), str)
        and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), str) for c in calls)


def _content(message: dict, param: str) -> str:
    """A message's text: a string, or text content parts joined by newlines (as vLLM joins them)."""
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if not (isinstance(content, list) and content and all(isinstance(p, dict) for p in content)):
        raise ApiError(400, f"{param}.content must be a string or a non-empty list of content parts", param)
    for part in content:
        if part.get("type") != "text":
            raise ApiError(400, f"{param}: only text content parts are supported, got {str(part.get('type'))[:40]!r}",
                           param, "unsupported_content_type")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}: a text part needs a string 'text'", param)
    return "\n".join(part["text"] for part in content)


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        wanted = _typed(body, "logprobs", bool, default=False)
        top = _typed(body, "top_logprobs", int, default=None)
        if top is not None and not wanted:
            raise ApiError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        return (top or 0) if wanted else None
    return _typed(body, "logprobs", int, default=None)

"""OpenAI request bodies -> validated internal requests: one pass of the body's models
(``gateway/bodies/openai.py``), then the rules across fields and this gateway's caps (``Limits``). Every
problem is an ``ApiError`` (a 4xx in OpenAI's error shape) naming the parameter. Fields nobody here knows are accepted and reported back
(``ParsedRequest.ignored``, logged once per name by the route), as vLLM does; OpenAI fields whose
effect we cannot give (``suffix``, ``tools`` on completions, ``echo`` on chat…) are accepted only at
their no-op value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.gateway.answers.tool_calls import ToolRequest, template_messages, tool_request
from pagedserve.gateway.bodies.openai import ChatRequest, CompletionRequest, StreamOptions
from pagedserve.gateway.bodies.structured_fields import structured_outputs
from pagedserve.gateway.bodies.validation import validated
from pagedserve.gateway.http.api_error import ApiError
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.structured import StructuredOutputs


# OpenAI fields whose effect pagedserve does not give: accepted at these no-op values, a 400 otherwise.
INERT_VALUES = {
    "suffix": (None, ""), "logit_bias": (None, {}),
    "functions": (None, []), "function_call": (None, "none", "auto"),  # the deprecated forms of tools
}
COMPLETION_INERT = {"tools": (None, []), "tool_choice": (None, "none", "auto")}  # tools are for chat
CHAT_INERT = {"echo": (None, False)}  # echo is for completions
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "best_of", "use_beam_search",
                   "beam_width", "length_penalty", "early_stopping")


@dataclass(frozen=True)
class Limits:
    max_choices: int = 64  # prompts x n of one request: each prompt is its own queue entry
    max_n: int = 16
    max_tokens: int = 4096
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
    template_kwargs: dict | None = None  # chat: the chat template's own variables (chat_template_kwargs)


def parse(body: Any, chat: bool, limits: Limits, defaults: dict | None = None) -> ParsedRequest:
    """``defaults``: sampling parameters (the model's generation config) for fields the body leaves unset."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    inert_fields = {**INERT_VALUES, **(CHAT_INERT if chat else COMPLETION_INERT)}
    for key, inert in inert_fields.items():
        if key in body and body[key] not in inert:
            raise ApiError(400, f"{key!r} is not supported (accepted only as {inert[1]!r})", key, "unsupported_parameter")
    req = validated(ChatRequest if chat else CompletionRequest, {k: v for k, v in body.items() if k not in inert_fields})
    ignored = tuple(sorted(req.model_extra or ()))
    prompt = chat_messages(req.messages) if chat else req.prompt
    options = req.stream_options or StreamOptions()  # without stream: checked, no chunks to shape
    max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = limits.default_chat_max_tokens if chat else 16
    sampling = {**(defaults or {}), **{k: v for k in SAMPLING_FIELDS if (v := getattr(req, k, None)) is not None}}
    if req.stop is not None:
        sampling["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    for name in ("n", "best_of", "beam_width"):
        if (getattr(req, name, None) or 0) > limits.max_n:
            raise ApiError(400, f"{name} must be <= {limits.max_n}", name)
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):  # both checked, one used
        if (getattr(req, name) or 0) > limits.max_tokens:
            raise ApiError(400, f"{name} must be an integer in [1, {limits.max_tokens}]", name)
    if chat and req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    sampling["logprobs"] = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    echo = _echo(bool(not chat and req.echo), bool(req.stream), sampling)
    sampling["structured"], constraint_field, tools = _constraints(req, chat)
    n = req.n or 1
    try:
        params = SamplingParams(n=n, max_tokens=max_tokens, **sampling)
    except (InvalidRequestError, TypeError) as err:
        raise ApiError(400, str(err), getattr(err, "field", None)) from None
    choices = prompt_count(prompt) * n  # a chat's messages are one prompt
    if choices > limits.max_choices:
        raise ApiError(400, f"prompts x n is {choices}; at most {limits.max_choices} per request", "prompt" if not chat else "n")
    include_usage = bool(req.stream and options.include_usage)
    return ParsedRequest(chat, req.model, prompt, params, bool(req.stream), include_usage, req.priority or 0, req.timeout,
                         req.user, include_usage and bool(options.continuous_usage_stats), ignored, tools,
                         constraint_field, echo, req.chat_template_kwargs if chat else None)


def prompt_count(prompt: Any) -> int:
    """Prompts in a completions ``prompt`` (or embeddings ``input``): a list of strings or of token
    lists holds one each; a string or one token list is one."""
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def _echo(echo: bool, stream: bool, sampling: dict) -> bool:
    """Completions' ``echo``; with logprobs the prompt's tokens get them too (lm-evaluation-harness)."""
    if echo and stream:
        raise ApiError(400, "echo is not supported with stream (send it without streaming)", "echo", "unsupported_parameter")
    if echo and sampling["logprobs"] is not None:
        sampling["prompt_logprobs"] = sampling["logprobs"]
    return echo


def _constraints(req: Any, chat: bool) -> tuple[StructuredOutputs | None, str | None, ToolRequest | None]:
    """What constrains the output (a response format, or the grammar of a forced tool call: not
    both), the request field it came from, and the chat's tools."""
    refuse = lambda message, param: ApiError(400, message, param)  # noqa: E731
    structured, field = structured_outputs(req, refuse)
    tools = tool_request(req, refuse) if chat else None
    try:
        forced = tools.constraint() if tools is not None else None
    except InvalidRequestError as err:  # a tool's parameters are not a schema the grammar can follow
        raise ApiError(400, f"tools: {err}", "tools") from None
    if forced is not None and structured is not None:
        raise ApiError(400, "a forced tool call (tool_choice) and a response format cannot both constrain the output",
                       "tool_choice")
    return (forced, "tools", tools) if forced is not None else (structured, field, tools)


def chat_messages(messages: list) -> list[dict]:
    """Validated messages (``bodies.openai.Message``) as the chat template sees them."""
    return template_messages([_message(m) for m in messages])


def _message(message: Any) -> dict:
    """One message as the chat template sees it: its text, and an assistant's tool calls or a tool
    result's call id."""
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": joined_text(message.content)}
    if getattr(message, "tool_calls", None) is not None:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


def joined_text(content: Any) -> str:
    """A message's text: a string, or text content parts (anything with ``.text``) joined by
    newlines (as vLLM joins them); "" for none."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)

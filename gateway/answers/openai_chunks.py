"""OpenAI response and chunk objects, built from wire events. Each choice also carries vLLM's
``stop_reason`` (the stop string or stop token id that ended it, else null), as vLLM's server's do."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.gateway.answers.text import parsed_tools, whole_answer
from pagedserve.gateway.answers.tool_calls import ToolRequest
from pagedserve.shared.protocol import OutputDelta


@dataclass
class Choice:
    """Everything one choice has produced so far."""

    index: int
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it

    def add(self, delta: OutputDelta) -> None:
        self.text += delta.text
        self.logprobs.extend(delta.logprobs or [])
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason

    def echo(self, prompt: str, entries: list[dict]) -> None:
        """``echo``: the prompt's text (and its tokens' logprob entries) before the generated ones."""
        self.text = prompt + self.text
        self.logprobs[:0] = entries


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; ``cached_tokens`` (a finished answer's): the prompt tokens the prefix
    cache served, as ``prompt_tokens_details``."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class Renderer:
    """Builds the objects of one response; ``chat`` picks the chat or the completions shapes."""

    def __init__(self, chat: bool, request_id: str, created: int, model: str, top_logprobs: int | None,
                 tools: ToolRequest | None = None, tool_parser: str = "hermes", reasoning_parser: str | None = None) -> None:
        """``top_logprobs``: alternatives per token asked for (None: no logprobs at all). Chat lists
        exactly that many; completions also keep the sampled token when it is not among them, as
        the legacy API and vLLM do. ``tools``: a chat with tools, whose answers may be tool calls.
        ``reasoning_parser``: a chat's thinking goes to ``reasoning_content`` (gateway/answers/reasoning.py)."""
        self.chat, self.id, self.created, self.model = chat, request_id, created, model
        self.top_logprobs = top_logprobs
        self.tools = parsed_tools(tools)
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser if chat else None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[Choice], use: dict) -> dict:
        out = []
        for c in choices:
            item = {"index": c.index, "logprobs": self.logprobs(c.logprobs, 0), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
            if self.chat:
                reasoning, content, calls = whole_answer(c.text, self.reasoning_parser, self.tools, self.tool_parser)
                item["message"] = {"role": "assistant", "content": content}
                if self.reasoning_parser:
                    item["message"]["reasoning_content"] = reasoning
                if calls:
                    item["message"]["tool_calls"] = calls
                    item["finish_reason"] = tool_finish(c.finish_reason)
            else:
                item["text"] = c.text
            out.append(item)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out, "usage": use}

    def chunk(self, index: int, delta: OutputDelta | None, first: bool, include_usage: bool, text_offset: int = 0,
              reasoning: str = "") -> dict:
        """``reasoning``: the thinking this delta carried (``delta.reasoning_content``), its text the answer's."""
        text = delta.text if delta else ""
        reason = delta.finish_reason if delta else None
        entries = (delta.logprobs or []) if delta else []
        item = {"index": index, "logprobs": self.logprobs(entries, text_offset), "finish_reason": reason,
                "stop_reason": delta.stop_reason if delta else None}
        if self.chat:
            item["delta"] = (({"role": "assistant"} if first else {}) | ({"reasoning_content": reasoning} if reasoning else {})
                             | ({"content": text} if text or first and not reasoning else {}))
        else:
            item["text"] = text
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [item]}
        if include_usage:
            body["usage"] = None
        return body

    def tool_calls_chunk(self, index: int, calls: list[dict], reason: str | None, include_usage: bool) -> dict:
        """The calls of a streamed choice, whole, with its finish reason."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        item = {"index": index, "logprobs": None, "finish_reason": tool_finish(reason), "delta": delta}
        body = {**self._head("chat.completion.chunk"), "choices": [item]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, use: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [], "usage": use}

    def logprobs(self, entries: list[dict], text_offset: int) -> dict | None:
        if self.top_logprobs is None:
            return None
        # The worker sends each token's text with its logprob ("token", "top_tokens"): no tokenizer here.
        if self.chat:
            return {"content": [
                {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                 "top_logprobs": [{"token": e["top_tokens"][t], "logprob": lp, "bytes": list(e["top_tokens"][t].encode())}
                                  for t, lp in sorted(e["top"].items(), key=lambda kv: -kv[1])[: self.top_logprobs]]}
                for e in entries]}
        tokens = [e["token"] for e in entries]
        offsets, pos = [], text_offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e["top"] is None else {e["top_tokens"][t]: lp for t, lp in e["top"].items()}
                                 for e in entries],  # None: an echoed prompt's first token
                "text_offset": offsets}


def tool_finish(reason: str | None) -> str | None:
    """A generation that ended on its own with tool calls ends for them; a cut one says so."""
    return "tool_calls" if reason == "stop" else reason

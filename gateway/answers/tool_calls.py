"""Tool (function) calling on chat completions: the request's ``tools`` and ``tool_choice``, the
constraint that enforces a forced call, and the parsers that find calls in generated text.

- ``tool_choice: "none"``: the chat template still sees the tools; the output is plain content.
- ``"auto"`` (the default with tools): the output is parsed by the model family's format
  (``--tool-call-parser``): ``hermes`` (Hermes, Qwen 2.5/3: ``<tool_call>{"name", "arguments"}
  </tool_call>`` blocks after optional text) or ``llama3_json`` (Llama 3.1+: the whole answer is
  one ``{"name", "parameters"}`` object, optionally after ``<|python_tag|>``).
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` calls
  (at least one; exactly one with ``parallel_tool_calls: false``), each one's parameters matching
  its tool's schema.
- a named function: the output is constrained to that function's parameters object.

Calls come back as ``message.tool_calls`` with ids, ``finish_reason: "tool_calls"``; streamed,
text that may start a call is held back and the calls go out as ``delta.tool_calls`` once the
generation ends (arguments whole, as one delta per call: the SDK reassembles either way).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pagedserve.shared.structured import StructuredOutputs

PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]  # OpenAI tool objects, as given (the template sees them)
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the forced function when choice == "named"
    parallel: bool = True  # parallel_tool_calls: false allows one call per answer

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutputs | None:
        """The grammar a forced call needs (None for none/auto)."""
        functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "named":
            return StructuredOutputs(json=functions[self.name])
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for name, schema in functions.items()]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return StructuredOutputs(json=array if self.parallel else {**array, "maxItems": 1})
        return None


def tool_request(req: Any, error: Callable[[str, str], Exception]) -> ToolRequest | None:
    """The tools of a validated chat request (``bodies.openai.ChatRequest``: each tool's shape already
    checked): names unique, a named ``tool_choice`` among them, ``tool_choice`` only with tools."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise error("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise error("tool names must be unique", "tools")
    given = tuple(tool.model_dump(exclude_none=True) for tool in tools)  # as sent: the template sees them
    parallel = req.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        return ToolRequest(given, choice or "auto", parallel=parallel)
    if choice.function.name not in names:
        raise error(f'tool_choice must be "none", "auto", "required" or a function among the tools; got '
                    f"{choice.function.name[:80]!r}", "tool_choice")
    return ToolRequest(given, "named", choice.function.name, parallel)


def new_call(name: str, arguments: Any) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


def extract(text: str, request: ToolRequest, parser: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished generation; text that is not a well-formed call stays
    content (a model may decline to call in ``auto``)."""
    if request.choice == "named":
        return None, [new_call(request.name, text)]
    if request.choice == "required":
        return None, _required_calls(text)  # the grammar's JSON, never content
    return _hermes(text) if parser == "hermes" else _llama3_json(text)


def _required_calls(text: str) -> list[dict]:
    """The calls of a ``required`` answer (a JSON array of ``{"name", "parameters"}``, as its grammar
    writes it). Cut short by ``max_tokens``, as the OpenAI API does: every whole call, then the one
    being written with its ``arguments`` as far as they came (not valid JSON; ``finish_reason`` says
    "length"); none for a call cut before its ``"parameters"`` began."""
    decoder, calls = json.JSONDecoder(), []
    pos = text.find("[") + 1
    while 0 < pos < len(text):
        while pos < len(text) and text[pos] in " \t\n\r,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            call, pos = decoder.raw_decode(text, pos)
            calls.append(new_call(call["name"], call["parameters"]))
        except (ValueError, TypeError, KeyError):
            cut = _CUT_CALL.match(text, pos)
            if cut:
                calls.append(new_call(json.loads(f'"{cut["name"]}"'), cut["arguments"]))
            break
    return calls


_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*(?P<arguments>.*)\Z', re.S)


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls, rest = [], text[start:]
    while rest.startswith(HERMES_OPEN):
        end = rest.find(HERMES_CLOSE)
        if end < 0:
            break
        try:
            call = json.loads(rest[len(HERMES_OPEN):end])
            calls.append(new_call(call["name"], call.get("arguments", {})))
        except (ValueError, TypeError, KeyError):
            return text, []
        rest = rest[end + len(HERMES_CLOSE):].lstrip()
    if not calls or rest:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    try:
        call = json.loads(body)
        return None, [new_call(call["name"], call.get("parameters", call.get("arguments", {})))]
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []


def may_start_call(text: str, parser: str) -> int:
    """Where in streamed ``text`` a tool call may begin (hold back from there), or -1."""
    marker = HERMES_OPEN if parser == "hermes" else None
    if marker is None:  # llama3_json: a call is the whole answer, so everything is held
        return 0
    found = text.find(marker)
    if found >= 0:
        return found
    for cut in range(1, len(marker)):  # a marker split across deltas
        if text.endswith(marker[:cut]):
            return len(text) - cut
    return -1


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool call arguments as objects."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _maybe_json(c["function"].get("arguments"))}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


class ToolStream:
    """One streamed choice of a request with tools: content goes out as it comes, except text that
    may be (the start of) a tool call, which is held until the generation ends."""

    def __init__(self, request: ToolRequest, parser: str) -> None:
        self.request, self.parser = request, parser
        self.text, self.sent = "", 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send now, the tool calls once finished: [] when there are none)."""
        self.text += text
        if not finished:
            if self.request.choice in ("named", "required"):
                return "", []
            cut = may_start_call(self.text[self.sent:], self.parser)
            return self._send_until(len(self.text) if cut < 0 else self.sent + cut), []
        content, calls = extract(self.text, self.request, self.parser)
        if not calls:  # no content either for a forced call cut before one began
            return ("" if content is None else self._send_until(len(self.text))), []
        start = self.text.find(HERMES_OPEN) if self.parser == "hermes" and self.request.choice == "auto" else self.sent
        return self._send_until(max(start, self.sent)).rstrip(), calls

    def _send_until(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], end
        return out

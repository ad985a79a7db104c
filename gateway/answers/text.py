"""An answer's text as what it holds: thinking (``--reasoning-parser``), the answer proper, and tool
calls (``tool_calls.py``) found in the answer only; whole (``whole_answer``) or as it streams
(``Pieces``), the same split either way. Every route that renders answers reads them here: chat
completions, the Responses API and Anthropic's Messages."""

from __future__ import annotations

from pagedserve.gateway.answers.reasoning import ReasoningStream, split
from pagedserve.gateway.answers.tool_calls import ToolRequest, ToolStream, extract


def parsed_tools(tools: ToolRequest | None) -> ToolRequest | None:
    """The request's tools when its answers are looked through for calls (not with tool_choice "none")."""
    return tools if tools is not None and tools.parses_output else None


def whole_answer(text: str, reasoning_parser: str | None, tools: ToolRequest | None,
                 tool_parser: str) -> tuple[str | None, str | None, list[dict]]:
    """(thinking, answer, tool calls) of a finished choice's text; ``tools``: those whose calls are
    parsed (None: the answer is all text)."""
    thinking, answer = split(text, reasoning_parser) if reasoning_parser else (None, text)
    content, calls = extract(answer or "", tools, tool_parser) if tools is not None else (answer, [])
    return thinking, content, calls


class Pieces:
    """A streamed choice's text as (thinking, answer text, tool calls found) pieces; every call found
    is also kept (``calls``)."""

    def __init__(self, reasoning_parser: str | None, tools: ToolRequest | None, tool_parser: str) -> None:
        self.thoughts = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.tools = ToolStream(tools, tool_parser) if tools is not None else None
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        thought, text = self.thoughts.feed(text, final) if self.thoughts else ("", text)
        found: list[dict] = []
        if self.tools is not None:  # text that may start a call is held back
            text, found = self.tools.feed(text, final)
            self.calls += found
        return thought, text, found

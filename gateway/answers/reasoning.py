"""Reasoning models think before they answer: ``<think>...</think>``, then the answer. With
``--reasoning-parser`` the gateway splits the two, as vLLM's parsers of the same names do: chat
completions carry the thinking as ``message.reasoning_content`` (streamed as
``delta.reasoning_content``) and the answer as ``content``; tool calls are looked for in the answer.

- ``deepseek_r1``: the chat template opens the thinking itself (DeepSeek-R1's prompt ends with
  ``<think>``), so the output is thinking from its first token, after a ``<think>`` of its own if it
  writes one, up to ``</think>``; an output that never closes it is all thinking (cut mid-thought).
- ``qwen3``: thinking only where the output opens with ``<think>`` (Qwen3 with thinking on); an output
  that does not (``chat_template_kwargs: {"enable_thinking": false}`` writes an empty think block into
  the prompt) is all answer.

The split is made as the text streams (``ReasoningStream``), holding back only what may be the start
of a tag split across deltas, so a streamed answer reassembles to the non-streamed one exactly
(``split`` is the same stream fed once).
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> whether the output starts inside the thinking


@dataclass
class ReasoningStream:
    """One choice's text, split into (thinking, answer) as it arrives."""
    parser: str
    thinking: bool | None = None  # None: not yet known (the output's start may still be "<thi")
    held: str = ""  # text that may be the start of a tag

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking, answer) of ``text`` and what was held before it; ``final``: nothing is held."""
        text, self.held = self.held + text, ""
        if self.thinking is None:
            start = text.lstrip()
            if start.startswith(OPEN):
                self.thinking, text = True, start[len(OPEN):]
            elif OPEN.startswith(start) and not final:
                self.held = text
                return "", ""
            else:
                self.thinking = PARSERS[self.parser]
        if not self.thinking:
            return "", text
        end = text.find(CLOSE)
        if end >= 0:
            self.thinking = False
            return text[:end], text[end + len(CLOSE):]
        keep = 0 if final else _tag_start(text, CLOSE)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""


@dataclass
class ReasoningCount:
    """How many of an output's tokens are its thinking (Responses' ``reasoning_tokens``), counted as
    its deltas arrive: a delta's tokens are the thinking's when the output was thinking before it or
    is after it (so the tokens that close the thinking are the thinking's); tokens whose side is not
    known yet (the start of a tag, held back) wait until it is."""
    stream: ReasoningStream
    tokens: int = 0
    undecided: int = 0

    def add(self, text: str, num_tokens: int, final: bool = False) -> None:
        before = self.stream.thinking
        self.stream.feed(text, final)
        self.undecided += num_tokens
        if before or self.stream.thinking:
            self.tokens += self.undecided
        if self.stream.thinking is not None:
            self.undecided = 0


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0 if none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def split(text: str, parser: str) -> tuple[str | None, str | None]:
    """A whole output's (thinking, answer); None for a part that is empty."""
    thinking, answer = ReasoningStream(parser).feed(text, final=True)
    return thinking or None, answer or None

"""Prompts to token ids, the one way every process does it (gateway, worker, offline ``LLM``, CLI).

A chat is rendered with the tokenizer's own chat template (generation prompt appended) and encoded
without adding special tokens again: the template already placed them. Token ids given by a client
are checked against the vocabulary before anything embeds them.
"""

from __future__ import annotations

from typing import Sequence

from pagedserve.shared.errors import InvalidRequestError


def render_chat(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """The conversation as the chat template writes it, ready for the assistant's turn. ``tools``:
    OpenAI tool objects, handed to the template (which decides how a model sees them);
    ``template_kwargs``: the template's own variables (Qwen3's ``enable_thinking``)."""
    return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=True, **(template_kwargs or {}))


def encode_chat(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """``render_chat``'s text as token ids (the template writes its own special tokens)."""
    return tokenizer.encode(render_chat(tokenizer, messages, tools, template_kwargs), add_special_tokens=False)


def is_token_id(value) -> bool:
    """An integer, or a float with an integral value (JSON Schema's "integer" includes ``1.0``)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt") -> list[int]:
    """``ids`` as a list of ints, or InvalidRequestError when one is not an integer in ``[0, vocab_size)``."""
    if not all(is_token_id(t) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"{field} token ids must be integers in [0, {vocab_size})", field)
    return [int(t) for t in ids]

"""Anthropic's Messages API request body (``POST /v1/messages``), declared once as the OpenAI ones
are (``gateway/bodies/openai.py``: strict types, unknown fields accepted and ignored): ``system``,
``messages`` of text, ``tool_use`` and ``tool_result`` blocks (and the ``thinking`` and
``redacted_thinking`` blocks of earlier answers, which clients send back and the template never sees,
as Anthropic strips earlier turns' thinking from the context), ``max_tokens`` (required, as
Anthropic's is), ``stop_sequences``, ``temperature`` (Anthropic's range, [0, 1]), ``top_p``,
``top_k``, ``tools`` with ``input_schema``, ``tool_choice``, ``metadata.user_id``."""

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.gateway.bodies.openai import MAX_STOP, MAX_TOOLS, OPEN, PRIORITY_RANGE, StopString, Text, bounded, integer


class TextBlock(BaseModel):
    model_config = OPEN
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """An assistant's call, sent back in the conversation."""
    model_config = OPEN
    type: Literal["tool_use"]
    id: str
    name: Text
    input: dict


class ToolResultBlock(BaseModel):
    """The answer to a call (``tool_use_id``), in a user turn."""
    model_config = OPEN
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[bool] = None


class ThinkingBlock(BaseModel):
    """An earlier answer's thinking, sent back with it (its ``signature`` is not checked: ours are empty)."""
    model_config = OPEN
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(BaseModel):
    model_config = OPEN
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class Turn(BaseModel):
    model_config = OPEN
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[Block], Field(min_length=1)]]


class AnthropicTool(BaseModel):
    model_config = OPEN
    name: Text
    description: Optional[str] = None
    input_schema: dict  # a JSON schema of the call's input


class AnthropicToolChoice(BaseModel):
    model_config = OPEN
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[Text] = None  # type "tool": the tool to call
    disable_parallel_tool_use: Optional[bool] = None


class Metadata(BaseModel):
    model_config = OPEN
    user_id: Optional[Annotated[str, Field(max_length=256)]] = None  # the prefix-cache salt, as OpenAI's user


class MessagesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    max_tokens: integer(ge=1)
    messages: Annotated[list[Turn], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[Annotated[list[StopString], Field(max_length=MAX_STOP)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]] = None
    top_p: bounded("top_p") = None
    top_k: bounded("top_k") = None
    stream: Optional[bool] = None
    tools: Optional[Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    metadata: Optional[Metadata] = None
    priority: Optional[integer(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] = None  # pagedserve's, lower runs first
    seed: bounded("seed") = None  # pagedserve's: a seeded sample is reproducible

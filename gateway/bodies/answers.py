"""The answers' bodies, declared once as the requests' are (``gateway/bodies/openai.py``): ``/openapi.json``
states them (``gateway/service/openapi.py``), schemathesis checks live answers against them, and so does a test
for every route. The handlers build plain dicts of these shapes."""

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

ANSWER = ConfigDict(extra="allow")  # an answer may carry more than is declared (vLLM's extra fields)
Finish = Optional[Literal["stop", "length", "abort", "error", "tool_calls"]]


class PromptTokensDetails(BaseModel):
    model_config = ANSWER
    cached_tokens: int


class Usage(BaseModel):
    model_config = ANSWER
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionChoice(BaseModel):
    model_config = ANSWER
    index: int
    text: str
    finish_reason: Finish
    logprobs: Optional[dict] = None


class CompletionResponse(BaseModel):
    model_config = ANSWER
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    model_config = ANSWER
    role: Literal["assistant"]
    content: Optional[str]  # None: the answer is tool calls (or only reasoning)
    reasoning_content: Optional[str] = None  # with --reasoning-parser
    tool_calls: Optional[list[dict]] = None


class ChatChoice(BaseModel):
    model_config = ANSWER
    index: int
    message: ChatMessage
    finish_reason: Finish
    logprobs: Optional[dict] = None


class ChatResponse(BaseModel):
    model_config = ANSWER
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    model_config = ANSWER
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    model_config = ANSWER
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    model_config = ANSWER
    count: int
    max_model_len: Optional[int]  # the live workers' context; null while none serves
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    model_config = ANSWER
    prompt: str


class Version(BaseModel):
    model_config = ANSWER
    version: str


class Embedding(BaseModel):
    model_config = ANSWER
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]  # str: base64 of little-endian float32s


class EmbeddingUsage(BaseModel):
    model_config = ANSWER
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    model_config = ANSWER
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class OutputItem(BaseModel):
    model_config = ANSWER
    type: Literal["message", "function_call", "reasoning"]
    id: str


class ResponseUsage(BaseModel):
    model_config = ANSWER
    input_tokens: int
    output_tokens: int
    total_tokens: int


class Response(BaseModel):
    """OpenAI's Responses API answer."""
    model_config = ANSWER
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[OutputItem]
    previous_response_id: Optional[str] = None
    usage: ResponseUsage


class DeletedResponse(BaseModel):
    model_config = ANSWER
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ContentBlock(BaseModel):
    model_config = ANSWER
    type: Literal["text", "thinking", "tool_use"]


class AnthropicUsage(BaseModel):
    model_config = ANSWER
    input_tokens: int  # not read from the cache
    output_tokens: int
    cache_read_input_tokens: Optional[int] = None
    cache_creation_input_tokens: Optional[int] = None


class AnthropicMessage(BaseModel):
    """Anthropic's Messages API answer."""
    model_config = ANSWER
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: Optional[Literal["end_turn", "max_tokens", "tool_use", "stop_sequence"]]
    stop_sequence: Optional[str] = None
    usage: AnthropicUsage


class ErrorDetail(BaseModel):
    model_config = ANSWER
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class Error(BaseModel):
    """OpenAI's error shape."""
    model_config = ANSWER
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    model_config = ANSWER
    type: str
    message: str


class AnthropicError(BaseModel):
    model_config = ANSWER
    type: Literal["error"]
    error: AnthropicErrorDetail


ANSWERS = (CompletionResponse, ChatResponse, ModelList, TokenizeResponse, DetokenizeResponse, Version, EmbeddingList,
           Response, DeletedResponse, AnthropicMessage, Error, AnthropicError)

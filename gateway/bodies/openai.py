"""The OpenAI routes' request bodies, declared once (pydantic): the gateway validates a body with
them (``gateway/bodies/parse.py``: one pass, errors naming the field) and ``/openapi.json`` is generated from
them (``gateway/service/openapi.py``). Numeric ranges come from ``shared.sampling.BOUNDS``, the table
``SamplingParams`` checks. Every field may be null ("not set", as OpenAI's spec has it); fields
nobody here knows are accepted (``extra="allow"``) and reported back, as vLLM does. Strict types:
``"1"`` is not a number, ``true`` is not an integer; an integral float is an integer (JSON
Schema's "integer" includes ``1.0``). Rules across fields that a type cannot state (``min_tokens <=
max_tokens``, one structured-output field at most, unique tool names) are the gateway's 400s."""

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.shared.prompts import is_token_id
from pagedserve.shared.sampling import BOUNDS, MAX_TOKEN_ID

PRIORITY_RANGE = (-1000, 1000)  # lower runs first
MAX_USER_LEN = 256
MAX_STOP, MAX_STOP_LEN = 4, 256
MAX_TOOLS = 128
TOKEN_ID = "x-token-id"  # marks a prompt's token id in the schema: ``openapi_spec`` bounds it by the vocabulary
OPEN = ConfigDict(strict=True, extra="allow")
CLOSED = ConfigDict(strict=True, extra="forbid")


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and is_token_id(value) else value


def integer(**limits: Any) -> Any:
    """An integer within ``limits`` (pydantic's ``ge``, ``le``...); an integral float counts."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


Text = Annotated[str, Field(min_length=1)]
TokenId = integer(ge=0, le=MAX_TOKEN_ID - 1, json_schema_extra={TOKEN_ID: True})
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]


def bounded(name: str) -> Any:
    """The optional field ``name`` within its ``BOUNDS`` range."""
    bound = BOUNDS[name]
    limits: dict[str, Any] = {"gt" if bound.low_open else "ge": bound.low}
    if bound.high is not None:
        limits["le"] = bound.high
    if bound.kind is int:
        return Optional[integer(**limits)]
    return Optional[Annotated[float, Field(allow_inf_nan=False, **limits)]]


class StreamOptions(BaseModel):
    model_config = CLOSED
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # with include_usage: usage so far on every chunk (vLLM)


class FormatKind(BaseModel):
    model_config = OPEN
    type: Literal["text", "json_object"]


class SchemaSpec(BaseModel):
    model_config = OPEN
    name: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")


class FormatSchema(BaseModel):
    model_config = OPEN
    type: Literal["json_schema"]
    json_schema: SchemaSpec


class StructuredChoice(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its keys."""
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"minProperties": 1, "maxProperties": 1})
    json_: Union[dict, str, None] = Field(None, alias="json")
    json_object: Optional[Literal[True]] = None
    regex: Optional[str] = None
    choice: Optional[Annotated[list[Text], Field(min_length=1)]] = None
    grammar: Optional[str] = None


class Sampling(BaseModel):
    """The fields completions and chat share."""
    model_config = OPEN
    model: str
    max_tokens: bounded("max_tokens") = None
    temperature: bounded("temperature") = None
    top_p: bounded("top_p") = None
    top_k: bounded("top_k") = None
    min_p: bounded("min_p") = None
    n: bounded("n") = None
    seed: bounded("seed") = None
    presence_penalty: bounded("presence_penalty") = None
    frequency_penalty: bounded("frequency_penalty") = None
    repetition_penalty: bounded("repetition_penalty") = None
    min_tokens: bounded("min_tokens") = None
    best_of: bounded("best_of") = None  # sample this many, answer with the n most likely
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)], None] = None
    stop_token_ids: Optional[list[integer(ge=0, le=MAX_TOKEN_ID - 1)]] = None
    ignore_eos: Optional[bool] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[Annotated[str, Field(max_length=MAX_USER_LEN)]] = None
    priority: Optional[integer(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] = None
    timeout: Optional[Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)]] = None  # seconds
    # beam search (extension fields)
    use_beam_search: Optional[bool] = None
    beam_width: bounded("beam_width") = None
    length_penalty: bounded("length_penalty") = None
    early_stopping: Union[bool, Literal["never"], None] = None
    # structured outputs (gateway/bodies/structured_fields.py): at most one of these per request
    response_format: Union[FormatKind, FormatSchema, None] = None
    structured_outputs: Optional[StructuredChoice] = None
    guided_json: Union[dict, str, None] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_choice: Optional[Annotated[list[Text], Field(min_length=1)]] = None


# Beam search takes neither best_of nor stop strings; chat's top_logprobs only with logprobs: true.
# (min_tokens <= max_tokens, best_of >= n and n <= beam_width are beyond JSON Schema: 400s name them.)
BEAM_RULE = {"if": {"required": ["use_beam_search"], "properties": {"use_beam_search": {"const": True}}},
             "then": {"properties": {"best_of": {"type": "null"}, "stop": {"anyOf": [
                 {"type": "null"}, {"type": "array", "maxItems": 0}]}}}}
TOP_LOGPROBS_RULE = {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"not": {"type": "null"}}}},
                     "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class CompletionRequest(Sampling):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"allOf": [BEAM_RULE]})
    prompt: Union[Text, Annotated[list[Text], Field(min_length=1)], TokenIds, Annotated[list[TokenIds], Field(min_length=1)]]
    logprobs: bounded("logprobs") = None
    echo: Optional[bool] = None  # the prompt comes back before each choice (with logprobs: the prompt's too)


class TextPart(BaseModel):
    model_config = OPEN
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind is not None and kind != "text":
            raise PydanticCustomError("unsupported_content_type", "only text content parts are supported, got {kind}",
                                      {"kind": repr(str(kind)[:40])})
        return value


Content = Union[str, Annotated[list[TextPart], Field(min_length=1)]]


class Function(BaseModel):
    model_config = OPEN
    name: str
    arguments: str = ""  # JSON text


class ToolCall(BaseModel):
    model_config = OPEN
    id: str = ""
    type: Literal["function"] = "function"
    function: Function


ROLES = ("system", "user", "developer", "assistant", "tool")


class PlainMessage(BaseModel):
    model_config = OPEN
    role: Literal["system", "user", "developer"]
    content: Content


class AssistantMessage(BaseModel):
    model_config = OPEN
    role: Literal["assistant"]
    content: Optional[Content] = None  # only an assistant's message may have none (it made tool calls)
    tool_calls: Optional[list[ToolCall]] = None


class ToolMessage(BaseModel):
    model_config = OPEN
    role: Literal["tool"]
    content: Content
    tool_call_id: str  # the call it answers


Message = Annotated[Union[PlainMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]
Messages = Annotated[list[Message], Field(min_length=1)]


class FunctionDef(BaseModel):
    model_config = OPEN
    name: Text
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema


class Tool(BaseModel):
    model_config = OPEN
    type: Literal["function"]
    function: FunctionDef


class ChosenName(BaseModel):
    model_config = OPEN
    name: str


class ChosenFunction(BaseModel):
    model_config = OPEN
    type: Literal["function"]
    function: ChosenName


TEMPLATE_RESERVED = ("conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
                     "continue_final_message", "return_dict", "return_tensors", "chat_template", "tokenizer_kwargs")


def _template_kwargs(value: Any) -> Any:
    taken = sorted(set(value) & set(TEMPLATE_RESERVED)) if isinstance(value, dict) else []
    if taken:
        raise PydanticCustomError("reserved_template_kwarg", "{keys} are set by the gateway, not by the request",
                                  {"keys": ", ".join(taken)})
    return value


TemplateKwargs = Annotated[dict, BeforeValidator(_template_kwargs),
                           Field(json_schema_extra={"propertyNames": {"not": {"enum": list(TEMPLATE_RESERVED)}}})]


class ChatRequest(Sampling):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"allOf": [BEAM_RULE, TOP_LOGPROBS_RULE]})
    messages: Messages
    max_completion_tokens: bounded("max_tokens") = None
    logprobs: Optional[bool] = None
    top_logprobs: bounded("logprobs") = None
    # tools need a unique name each; a named tool_choice must be one of them (checked by the gateway)
    tools: Optional[Annotated[list[Tool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ChosenFunction, None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None  # the template's own switches: {"enable_thinking": false}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={
        "oneOf": [{"required": ["messages"]}, {"required": ["prompt"]}]})
    model: Optional[str] = None  # the served model when unset
    messages: Optional[Messages] = None
    prompt: Union[Text, TokenIds, None] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None


class DetokenizeRequest(BaseModel):
    model_config = OPEN
    model: Optional[str] = None
    tokens: list[TokenId]


class EmbeddingsRequest(BaseModel):
    model_config = OPEN
    model: str
    input: Union[Text, Annotated[list[Text], Field(min_length=1)], TokenIds, Annotated[list[TokenIds], Field(min_length=1)]]
    encoding_format: Optional[Literal["float", "base64"]] = None  # base64: little-endian float32s
    dimensions: Optional[Literal[None]] = None  # a shortened vector is not offered: only null passes
    pooling: Optional[Literal["last", "mean"]] = None  # pagedserve's: the last token's state (default), or the mean
    user: Optional[Annotated[str, Field(max_length=MAX_USER_LEN)]] = None
    priority: Optional[integer(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] = None


AdapterName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^=]+$")]  # NAME=PATH splits at its '='


class LoadLoraAdapterRequest(BaseModel):
    model_config = OPEN
    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1)]  # a PEFT adapter directory every worker of the model can read


class UnloadLoraAdapterRequest(BaseModel):
    model_config = OPEN  # vLLM's clients also send lora_int_id: taken and not used
    lora_name: AdapterName


BODIES = (CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest, EmbeddingsRequest, LoadLoraAdapterRequest,
          UnloadLoraAdapterRequest)

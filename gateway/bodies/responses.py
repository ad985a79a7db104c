"""OpenAI's Responses API request body (``POST /v1/responses``), declared once as the chat body is
(``gateway/bodies/openai.py``: strict types, unknown fields accepted and ignored): ``input`` as a string or
items (messages, ``function_call``, ``function_call_output``), ``instructions``,
``max_output_tokens``, sampling fields, ``text.format``, function ``tools``, ``tool_choice``,
``store`` and ``previous_response_id``."""

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.gateway.bodies.openai import MAX_TOOLS, MAX_USER_LEN, OPEN, PRIORITY_RANGE, Text, bounded, integer


class InputText(BaseModel):
    model_config = OPEN
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = OPEN
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, Annotated[list[InputText], Field(min_length=1)]]


class FunctionCallItem(BaseModel):
    """A call the model made, sent back in the conversation."""
    model_config = OPEN
    type: Literal["function_call"]
    call_id: str
    name: Text
    arguments: str  # JSON text


class FunctionCallOutput(BaseModel):
    """The answer to a call (``call_id``)."""
    model_config = OPEN
    type: Literal["function_call_output"]
    call_id: str
    output: str


Item = Union[FunctionCallItem, FunctionCallOutput, InputMessage]


class TextFormat(BaseModel):
    model_config = OPEN
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")  # json_schema: the schema the answer follows
    strict: Optional[bool] = None


class TextOptions(BaseModel):
    model_config = OPEN
    format: Optional[TextFormat] = None


class FunctionTool(BaseModel):
    model_config = OPEN
    type: Literal["function"]
    name: Text
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ChosenTool(BaseModel):
    model_config = OPEN
    type: Literal["function"]
    name: Text


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[Item], Field(min_length=1)]]
    instructions: Optional[str] = None
    max_output_tokens: bounded("max_tokens") = None
    temperature: bounded("temperature") = None
    top_p: bounded("top_p") = None
    top_k: bounded("top_k") = None  # pagedserve's
    seed: bounded("seed") = None  # pagedserve's
    stream: Optional[bool] = None
    text: Optional[TextOptions] = None
    tools: Optional[Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ChosenTool, None] = None
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None  # default true: kept for previous_response_id and GET, for a while
    previous_response_id: Optional[str] = None
    metadata: Optional[dict] = None
    user: Optional[Annotated[str, Field(max_length=MAX_USER_LEN)]] = None
    priority: Optional[integer(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] = None  # pagedserve's



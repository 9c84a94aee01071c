"""OpenAI (and vLLM-extension) request and response schemas.

Requests check types only; value ranges are checked where SamplingParams is built. Either is a 400 naming
the parameter, as OpenAI answers. Types are strict where OpenAI's are: an integer field takes no string, bool
or float (`n: "2"`, `n: true`, `n: 1.0`), a bool no string or number, a float an int but no string or bool.
Unknown fields are ignored, as OpenAI does.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

# Request field types: pydantic's lax mode would turn "2", true or 2.0 into an int and "true" or 1 into a bool.
Int = StrictInt
Float = StrictFloat  # an int is still a valid float, as for OpenAI
Bool = StrictBool
TokenIds = list[StrictInt]


def _omit_none(v: Any) -> bool:
    return v is None


class _Request(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class StreamOptions(_Request):
    include_usage: Bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural_tag response format
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` request field: set one of json, regex, choice, grammar, json_object,
    structural_tag."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: Bool = False


class SLOField(_Request):
    """tokenmill's `slo` request field: latency targets for --scheduling-policy slo (a tenant's are the
    tightest its requests get)."""

    ttft_ms: Float | None = None
    tpot_ms: Float | None = None


class _SamplingFields(_Request):
    model: str | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    seed: Int | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    ignore_eos: Bool = False
    priority: Int = 0
    slo: SLOField | None = None  # tokenmill extension
    # vLLM's: mixed into the prefix-cache hashes (with the tenant's cache group), so only requests with the same
    # salt share cached blocks. 1..256 characters.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance is the one backend


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: Bool = False
    logprobs: Int | None = None
    suffix: str | None = None
    best_of: Int | None = None


class ContentPart(_Request):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    # vLLM extensions
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None


# ---- responses --------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Answer(BaseModel):
    """The head of every completions and chat answer and stream chunk, in OpenAI's field order: each subclass
    narrows `object` (a redefined field keeps its place) and adds `choices` and `usage` after `model`."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_omit_none)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: Annotated[str | None, Field(exclude_if=_omit_none)] = None
    tool_calls: Annotated[list[ToolCall] | None, Field(exclude_if=_omit_none)] = None


class DeltaFunctionCall(BaseModel):
    name: Annotated[str | None, Field(exclude_if=_omit_none)] = None
    arguments: Annotated[str | None, Field(exclude_if=_omit_none)] = None


class DeltaToolCall(BaseModel):
    index: int
    id: Annotated[str | None, Field(exclude_if=_omit_none)] = None
    type: Annotated[Literal["function"] | None, Field(exclude_if=_omit_none)] = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Annotated[str | None, Field(exclude_if=_omit_none)] = None
    content: Annotated[str | None, Field(exclude_if=_omit_none)] = None
    reasoning_content: Annotated[str | None, Field(exclude_if=_omit_none)] = None
    tool_calls: Annotated[list[DeltaToolCall] | None, Field(exclude_if=_omit_none)] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Annotated[int | str | None, Field(exclude_if=_omit_none)] = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    # With stream_options.include_usage every chunk carries "usage": null and the last one the totals.
    usage: Usage | None = None


class CompletionChunk(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str

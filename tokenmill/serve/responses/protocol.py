"""The Responses API's request and its Response object, in OpenAI's shapes (openai.types.responses parses them).

The request checks types only, as serve/protocol.py does (strict ints, floats and bools; unknown fields ignored);
input items, tools and tool_choice are read by conversation.py, which names the bad field in its 400.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenmill.serve.protocol import Bool, Float, Int, SLOField, TokenIds, _Request


class TextFormat(_Request):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema",
    "description", "strict"} (flat, unlike chat's response_format)."""

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; the model's length is its own


class ReasoningConfig(_Request):
    """Accepted and echoed: the reasoning parser (--reasoning-parser) decides what is reasoning, and the
    model how much of it there is (a template's own switch goes through chat_template_kwargs)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    store: Bool = True
    stream: Bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted and ignored: what the client asks to have included (e.g. reasoning.encrypted_content; reasoning
    # comes back as text), its caching and tier hints.
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: Int | None = None
    # Refused unless off (create.py says why): features this server does not have.
    truncation: Literal["auto", "disabled"] | None = None
    background: Bool | None = None
    top_logprobs: Int | None = None
    conversation: Any = None
    prompt: Any = None
    # vLLM / tokenmill extensions, as on chat completions (serve/protocol.py)
    seed: Int | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    skip_special_tokens: Bool = True
    priority: Int = 0
    slo: SLOField | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    chat_template_kwargs: dict[str, Any] | None = None


# The extension fields a chat request shares under the same names (create.py copies them across).
CHAT_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stop_token_ids", "ignore_eos",
               "min_tokens", "skip_special_tokens", "priority", "slo", "cache_salt", "chat_template_kwargs")


# ---- the Response object ------------------------------------------------------------------------------------
class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # not counted by this server: always 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    completed_at: int | None = None

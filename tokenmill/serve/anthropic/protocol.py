"""Anthropic Messages API request and response schemas (the fields tokenmill serves; docs/api.md lists them).

Requests check types as serve/protocol.py does (strict ints, bools and floats; unknown fields such as
`cache_control`, `citations` or `service_tier` ignored). Content blocks are told apart by `type`; image and
document blocks parse, so that the conversion can refuse them with a message saying why (a text-only server).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field

from tokenmill.serve.protocol import Bool, Float, Int, SLOField, _Request


# ---- request ------------------------------------------------------------------------------------------------------
class TextBlockParam(_Request):
    type: Literal["text"]
    text: str


class MediaBlockParam(_Request):
    """An image or document: accepted by the schema, refused by the conversion (the server takes text only)."""

    type: Literal["image", "document"]


class ToolUseBlockParam(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlockParam, MediaBlockParam], Field(discriminator="type")]] | None = None
    is_error: Bool = False


class ThinkingBlockParam(_Request):
    """Earlier turns' reasoning, as a client sends it back: dropped from the prompt (chat templates drop it too)."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlockParam = Annotated[
    Union[TextBlockParam, MediaBlockParam, ToolUseBlockParam, ToolResultBlockParam, ThinkingBlockParam],
    Field(discriminator="type")]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(_Request):
    """A client tool. Anthropic's server tools (a `type` such as "web_search_20250305") are refused."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceParam(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Bool | None = None


class ThinkingParam(_Request):
    """Maps to the chat template's `enable_thinking` (Qwen3 and others read it); `budget_tokens` is not enforced."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int | None = None


class OutputFormatParam(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(_Request):
    """Structured output: the answer's text follows `format`'s JSON schema (the grammar the engine enforces).
    `effort` is accepted and ignored."""

    format: OutputFormatParam | None = None


class MetadataParam(_Request):
    user_id: str | None = None


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what is rendered into the prompt."""

    model: str | None = None
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Int
    stop_sequences: list[str] | None = None
    stream: Bool = False
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    metadata: MetadataParam | None = None  # accepted; user_id is not used
    output_config: OutputConfigParam | None = None
    # tokenmill extensions, as on chat completions
    seed: Int | None = None
    ignore_eos: Bool = False
    priority: Int = 0
    slo: SLOField | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


# ---- response -----------------------------------------------------------------------------------------------------
class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its reasoning; a local model's is not signed


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Union[TextBlock, ThinkingBlock, ToolUseBlock]


class Usage(BaseModel):
    """input_tokens are the prompt tokens the prefix cache did not hold (Anthropic's split: the prompt is
    input_tokens + cache_read_input_tokens + cache_creation_input_tokens)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---- stream events ------------------------------------------------------------------------------------------------
class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Union[TextDelta, ThinkingDelta, InputJSONDelta]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: Usage  # cumulative totals, as Anthropic sends them


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = Union[MessageStartEvent, PingEvent, ContentBlockStartEvent, ContentBlockDeltaEvent,
                    ContentBlockStopEvent, MessageDeltaEvent, MessageStopEvent]


def event(e: StreamEvent) -> str:
    """One Server-Sent Event as Anthropic writes them: the type named on its own line, then the JSON."""
    return f"event: {e.type}\ndata: {e.model_dump_json()}\n\n"

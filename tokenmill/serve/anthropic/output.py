"""What a finished (or finishing) choice becomes in Anthropic's terms: content blocks, stop_reason, usage."""
from __future__ import annotations

import json
from typing import Any

from tokenmill.serve.anthropic.protocol import ContentBlock, TextBlock, ThinkingBlock, ToolUseBlock, Usage
from tokenmill.serve.generation import Submission
from tokenmill.serve.protocol import ToolCall


def stop_reason(finish_reason: str | None, engine_stop: int | str | None,
                tools_called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). The engine reports "length" at max_tokens, and for "stop" the stop string
    that matched (a str), a stop token id (an int) or None (end of sequence). A turn that called tools ends with
    "tool_use" (unless cut short), as the client then runs them."""
    if finish_reason == "length":
        return "max_tokens", None
    if tools_called:
        return "tool_use", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def usage(sub: Submission) -> Usage:
    """Anthropic counts the prompt as input_tokens + cache_read_input_tokens: the prefix cache's hits are the reads,
    and nothing is written to a cache on request (cache_creation_input_tokens 0)."""
    u = sub.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return Usage(input_tokens=u.prompt_tokens - cached, output_tokens=u.completion_tokens,
                 cache_read_input_tokens=cached)


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is. A call cut short by max_tokens is not JSON yet:
    its input is {} (the stop_reason says max_tokens)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(reasoning: str | None, content: str | None, calls: list[ToolCall]) -> list[ContentBlock]:
    """A whole choice's blocks, in the order the model wrote them: thinking, text, then the tool calls."""
    blocks: list[ContentBlock] = []
    if reasoning:
        blocks.append(ThinkingBlock(thinking=reasoning))
    if content:
        blocks.append(TextBlock(text=content))
    for c in calls:
        blocks.append(ToolUseBlock(id=c.id, name=c.function.name, input=tool_input(c.function.arguments)))
    return blocks

"""An Anthropic request as the chat request the rest of the server runs: content blocks to the chat messages the
template renders (serve/chat_prompt.py), `tools` / `tool_choice` to OpenAI's function tools (checked and forced by
serve/tools.py), the sampling fields to ChatCompletionRequest's. Whatever the server cannot do is a 400 saying so.

Blocks to messages:
- `system` (a string or text blocks) -> one system message;
- text blocks -> the message's text (blocks joined by newlines);
- an assistant's `tool_use` blocks -> its `tool_calls` (arguments as JSON);
- a user's `tool_result` blocks -> one `tool` message each (`tool_call_id`, the called tool's `name`; text content;
  `is_error` prefixes "Error: "), in their order among the user's text;
- `thinking` / `redacted_thinking` blocks of earlier turns -> dropped, as chat templates drop earlier reasoning;
- a last assistant message -> a prefill: the answer continues it (continue_final_message).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.serve.anthropic.protocol import (CountTokensRequest, MediaBlockParam, MessageParam, MessagesRequest,
                                                TextBlockParam, ThinkingBlockParam, ToolResultBlockParam,
                                                ToolUseBlockParam)
from tokenmill.serve.errors import bad_request
from tokenmill.serve.protocol import ChatCompletionRequest, ChatMessage

_MEDIA = "{where}: {kind} blocks are not supported (this server's models take text only)."


@dataclass
class Conversation:
    """What is rendered into the prompt: the same for /v1/messages and /v1/messages/count_tokens."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool
    prefill: bool  # the last message is the assistant's: continue it rather than open a new turn
    template_kwargs: dict[str, Any] | None


def conversation(req: CountTokensRequest) -> Conversation:
    if not req.messages:
        raise bad_request("messages: at least one message is required.", "messages")
    messages: list[ChatMessage] = []
    system = _system_text(req.system)
    if system is not None:
        messages.append(ChatMessage(role="system", content=system))
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the tool messages that answer it
    for i, m in enumerate(req.messages):
        messages += _assistant(m, i, names) if m.role == "assistant" else _user(m, i, names)
    prefill = req.messages[-1].role == "assistant"
    if prefill and messages[-1].tool_calls:
        raise bad_request(f"messages.{len(req.messages) - 1}: a final assistant message is continued (a prefill), "
                          "so it may hold text only, not tool_use blocks.", "messages")
    choice, parallel = _tool_choice(req)
    kwargs = None
    if req.thinking is not None:  # read by templates that can switch reasoning off (Qwen3 and others)
        kwargs = {"enable_thinking": req.thinking.type != "disabled"}
    return Conversation(messages, _tools(req), choice, parallel, prefill, kwargs)


def chat_request(req: MessagesRequest, conv: Conversation) -> ChatCompletionRequest:
    """The chat request whose sampling, tools and template arguments /v1/messages runs with."""
    return ChatCompletionRequest(
        model=req.model, messages=conv.messages, max_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, stream=req.stream, seed=req.seed,
        ignore_eos=req.ignore_eos, priority=req.priority, slo=req.slo, cache_salt=req.cache_salt,
        tools=conv.tools, tool_choice=conv.tool_choice, parallel_tool_calls=conv.parallel_tool_calls,
        add_generation_prompt=not conv.prefill, continue_final_message=conv.prefill,
        chat_template_kwargs=conv.template_kwargs)


def _system_text(system: str | list[TextBlockParam] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(b.text for b in system) or None


def _assistant(m: MessageParam, i: int, names: dict[str, str]) -> list[ChatMessage]:
    if isinstance(m.content, str):
        return [ChatMessage(role="assistant", content=m.content)]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(b, TextBlockParam):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlockParam):
            names[b.id] = b.name
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif isinstance(b, ToolResultBlockParam):
            raise bad_request(f"{where}: tool_result blocks belong in user messages.", "messages")
        elif isinstance(b, MediaBlockParam):
            raise bad_request(_MEDIA.format(where=where, kind=b.type), "messages")
        # ThinkingBlockParam: an earlier turn's reasoning is not rendered again
    return [ChatMessage(role="assistant", content="\n".join(texts) or None, tool_calls=calls or None)]


def _user(m: MessageParam, i: int, names: dict[str, str]) -> list[ChatMessage]:
    if isinstance(m.content, str):
        return [ChatMessage(role="user", content=m.content)]
    out: list[ChatMessage] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append(ChatMessage(role="user", content="\n".join(texts)))
            texts.clear()

    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(b, TextBlockParam):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlockParam):
            flush()
            out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, name=names.get(b.tool_use_id),
                                   content=_result_text(b, where)))
        elif isinstance(b, ToolUseBlockParam):
            raise bad_request(f"{where}: tool_use blocks belong in assistant messages.", "messages")
        elif isinstance(b, MediaBlockParam):
            raise bad_request(_MEDIA.format(where=where, kind=b.type), "messages")
        elif isinstance(b, ThinkingBlockParam):
            raise bad_request(f"{where}: {b.type} blocks belong in assistant messages.", "messages")
    flush()
    return out or [ChatMessage(role="user", content="")]


def _result_text(b: ToolResultBlockParam, where: str) -> str:
    if b.content is None or isinstance(b.content, str):
        text = b.content or ""
    else:
        for k, part in enumerate(b.content):
            if isinstance(part, MediaBlockParam):
                raise bad_request(_MEDIA.format(where=f"{where}.content.{k}", kind=part.type), "messages")
        text = "\n".join(part.text for part in b.content)
    # The chat message has no error flag: say it in the text, where the model reads it.
    return f"Error: {text}" if b.is_error else text


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type not in (None, "custom"):
            raise bad_request(f"tools.{i}: tool type {t.type!r} is not supported; this server runs client tools "
                              "(a name and an input_schema) only.", "tools")
        if t.input_schema is None:
            raise bad_request(f"tools.{i}.input_schema is required.", "tools")
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(req: CountTokensRequest) -> tuple[str | dict[str, Any] | None, bool]:
    """Anthropic's choice as OpenAI's: auto -> "auto", any -> "required", tool -> the named function, none ->
    "none"; disable_parallel_tool_use -> parallel_tool_calls false. None: the default ("auto" with tools)."""
    tc = req.tool_choice
    if tc is None:
        return None, True
    parallel = not tc.disable_parallel_tool_use
    if tc.type in ("any", "tool") and not req.tools:
        raise bad_request(f'tool_choice of type "{tc.type}" needs tools.', "tool_choice")
    if tc.type == "tool":
        if not tc.name:
            raise bad_request('tool_choice of type "tool" needs a name.', "tool_choice")
        return {"type": "function", "function": {"name": tc.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[tc.type], parallel

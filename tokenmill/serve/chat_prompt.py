"""A chat conversation rendered through the template and tokenized, within the server's limits: for chat
completions, /tokenize, and every chat-shaped surface to come."""
from __future__ import annotations

import json
from typing import Any

from tokenmill.serve.chat import encode_chat, render_chat
from tokenmill.serve.errors import bad_request
from tokenmill.serve.protocol import ChatMessage
from tokenmill.serve.sampling import check_input_chars
from tokenmill.serve.state import ServerState

# Characters the chat template adds around each message (role markers): a list of many empty messages is still
# work to render, so it counts towards the slow lane and --max-input-chars.
MESSAGE_OVERHEAD = 16


def message_chars(messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                  chat_template_kwargs: dict[str, Any] | None = None) -> int:
    """The text a chat request asks us to render and tokenize: message contents, tool calls and tools."""
    total = 0
    for m in messages or ():
        total += MESSAGE_OVERHEAD
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(json.dumps(p.model_dump(exclude_none=True))) for p in m.content)
        if m.tool_calls:
            total += len(json.dumps(m.tool_calls))
    return (total + (len(json.dumps(tools)) if tools else 0)
            + (len(json.dumps(chat_template_kwargs, default=str)) if chat_template_kwargs else 0))


async def chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                      continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                      chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids (400 when the template rejects the messages). Serves chat
    completions and /tokenize (whose request has no tools or template arguments)."""
    tok = state.engine.tokenizer
    size = message_chars(messages, tools, chat_template_kwargs)
    check_input_chars(size, state.limits, "messages")
    try:
        text = await state.run_blocking(
            render_chat, tok, messages, state.settings.chat_template, add_generation_prompt,
            continue_final_message, tools, chat_template_kwargs, size=size)
    except ValueError as e:
        raise bad_request(" ".join(str(e).split()), "messages") from None
    try:
        ids = await state.run_blocking(encode_chat, tok, text, size=len(text))
    except (ValueError, TypeError) as e:  # the tokenizer refuses lone surrogates with a TypeError
        raise bad_request(f"messages could not be tokenized (text that is not valid Unicode?): {e}", "messages") \
            from None
    if not ids:
        raise bad_request("messages rendered to an empty prompt.", "messages")
    return text, ids

"""Chat messages -> prompt token ids through the model's chat template (or --chat-template)."""
from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.serve.protocol import ChatMessage


def load_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the Jinja text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    return value


def content_text(message: ChatMessage, index: int) -> str | None:
    """Text of a message; content-part lists are joined. Only text parts are supported."""
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ValueError(f"messages.{index}.content: content part type {part.type!r} is not supported "
                             "(this model takes text only).")
        texts.append(part.text)
    return "\n".join(texts)


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": content_text(m, i) or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls is not None:
            d["tool_calls"] = [_template_tool_call(c, i) for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _template_tool_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI sends arguments as JSON text; chat templates (Qwen, Llama 3, Mistral) render them with
    `tojson`, so they get the object."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"messages.{index}.tool_calls: each call needs function.name.")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"messages.{index}.tool_calls: function.arguments is not valid JSON: {e}") from None
    return {**call, "function": {**fn, "arguments": args}}


def template_knows_tools(template: str | dict | None) -> bool:
    if isinstance(template, dict):  # named templates, e.g. {"default": ..., "tool_use": ...}
        return any("tools" in t for t in template.values())
    return template is not None and "tools" in template


def with_tools_in_text(conversation: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """For a template that ignores `tools` (e.g. SmolLM2's): describe the tools in the system message,
    write earlier calls into the assistant's text and results as user turns, all in the Hermes format
    (<tool_call>{json}</tool_call>) that the hermes parser reads back."""
    specs = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    note = ("You can call functions. Their signatures, one JSON object per line, are between <tools> and </tools>:\n"
            f"<tools>\n{specs}\n</tools>\nTo call one, answer with a JSON object holding its name and arguments "
            'between tags, like <tool_call>\n{"name": "function_name", "arguments": {...}}\n</tool_call>')
    out = [dict(m) for m in conversation]
    if out and out[0]["role"] in ("system", "developer"):
        out[0]["content"] = f"{out[0]['content']}\n\n{note}" if out[0]["content"] else note
    else:
        out.insert(0, {"role": "system", "content": note})
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
                              for c in calls)
            m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["role"], m["content"] = "user", f"<tool_response>\n{m['content']}\n</tool_response>"
    return out


def render_chat(tokenizer, messages: list[ChatMessage], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """The prompt text; ValueError (-> 400) when the template cannot render these messages."""
    if not messages:
        raise ValueError("messages must contain at least one message.")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):  # tokenizer classes vary
        raise ValueError("messages: this model has no chat template; start the server with --chat-template.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message cannot be used together with add_generation_prompt.")
    conversation = to_template_messages(messages)
    if tools and not template_knows_tools(chat_template or tokenizer.chat_template):
        conversation, tools = with_tools_in_text(conversation, tools), None
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template, tools=tools,
            **(template_kwargs or {}),
        )
    except ValueError:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in templates, bad kwargs
        raise ValueError(f"messages could not be rendered with the chat template: {e}") from e


def encode_chat(tokenizer, text: str) -> list[int]:
    # The template already holds any BOS; do not add special tokens again.
    return tokenizer(text, add_special_tokens=False).input_ids

"""A Responses request read as a chat conversation: input items to chat messages, tools and tool_choice to chat's
shapes, text.format to a response_format; and a response's output back to the assistant turn that
previous_response_id chains onto. Every refusal is a 400 naming the field (`input.2.call_id`)."""
from __future__ import annotations

import json
from typing import Any

from tokenmill.serve.errors import bad_request
from tokenmill.serve.protocol import ChatMessage, JsonSchemaFormat, ResponseFormat
from tokenmill.serve.responses.protocol import FunctionCallItem, OutputItem, OutputMessage, TextConfig

# Message roles the Responses API takes; "developer" is rendered as "system" (chat templates know no developer).
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Content part types read as text: the user's input_text, an assistant's output_text (a previous turn) and its
# refusal text. Images, files and audio are refused: the models served take text only.
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts.", param)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}.{j}"
        if not isinstance(part, dict):
            raise bad_request(f"{p} must be an object.", p)
        kind = part.get("type")
        key = _TEXT_PARTS.get(kind)
        if key is None:
            raise bad_request(f"{p}.type {kind!r} is not supported: this server takes text parts only "
                              "(input_text, output_text, refusal).", f"{p}.type")
        text = part.get(key)
        if not isinstance(text, str):
            raise bad_request(f"{p}.{key} must be a string.", f"{p}.{key}")
        texts.append(text)
    return "\n".join(texts)


def _str_field(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{key} must be a non-empty string.", f"{param}.{key}")
    return value


def known_call_ids(messages: list[ChatMessage]) -> set[str]:
    return {c.get("id") for m in messages for c in m.tool_calls or () if isinstance(c, dict)}


def input_messages(input: str | list[dict[str, Any]], call_ids: set[str]) -> list[ChatMessage]:
    """The request's `input` as chat messages. `call_ids`: the function calls the conversation already holds (a
    function_call_output must answer one of them, or one earlier in this input); this input's calls are added."""
    if isinstance(input, str):
        return [ChatMessage(role="user", content=input)]
    if not input:
        raise bad_request("input must not be an empty list.", "input")
    out: list[ChatMessage] = []
    for i, item in enumerate(input):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{param}.role must be one of user, assistant, system or developer, not "
                                  f"{item.get('role')!r}.", f"{param}.role")
            out.append(ChatMessage(role=role, content=_text_of(item.get("content"), f"{param}.content")))
        elif kind == "function_call":
            call_id, name = _str_field(item, "call_id", param), _str_field(item, "name", param)
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise bad_request(f"{param}.arguments must be a string (the call's JSON arguments).",
                                  f"{param}.arguments")
            try:
                json.loads(arguments) if arguments.strip() else None
            except ValueError as e:
                raise bad_request(f"{param}.arguments is not valid JSON: {e}", f"{param}.arguments") from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1].role == "assistant":  # the turn's text and its calls: one assistant message
                out[-1].tool_calls = (out[-1].tool_calls or []) + [call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            call_ids.add(call_id)
        elif kind == "function_call_output":
            call_id = _str_field(item, "call_id", param)
            if call_id not in call_ids:
                raise bad_request(f"No function call found for the function_call_output with call_id {call_id!r} "
                                  f"({param}): it must answer a function_call earlier in the conversation.",
                                  f"{param}.call_id")
            output = item.get("output")
            out.append(ChatMessage(role="tool", tool_call_id=call_id, content=_text_of(output, f"{param}.output")))
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: chat templates leave it out of the history
        else:
            raise bad_request(f"{param}.type {kind!r} is not supported: input items are messages, function_call, "
                              "function_call_output and reasoning.", f"{param}.type")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "description", "parameters", "strict"}) in chat's
    shape ({"type": "function", "function": {...}}). Other tool types (web_search, file_search, ...) run on
    OpenAI's side and are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if tool.get("type") != "function":
            raise bad_request(f"{param}.type {tool.get('type')!r} is not supported: this server runs function "
                              "tools only.", f"{param}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{param}.name must be a non-empty string.", f"{param}.name")
        fn = {"name": name}
        for key, kind in (("description", str), ("parameters", dict)):
            value = tool.get(key)
            if value is not None:
                if not isinstance(value, kind):
                    raise bad_request(f"{param}.{key} must be {'a string' if kind is str else 'an object'}.",
                                      f"{param}.{key}")
                fn[key] = value
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"{param}.strict must be a boolean.", f"{param}.strict")
        out.append({"type": "function", "function": fn})
    return out


def echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools as the Response object shows them (FunctionTool)."""
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")} for t in tools or ()]


def chat_tool_choice(tool_choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """"auto", "none", "required" as they are; {"type": "function", "name"} as chat's named choice."""
    if tool_choice is None or isinstance(tool_choice, str):
        if tool_choice not in (None, "auto", "none", "required"):
            raise bad_request(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}, '
                              f"not {tool_choice!r}.", "tool_choice")
        return tool_choice
    name = tool_choice.get("name")
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}; '
                          f"type {tool_choice.get('type')!r} is not supported.", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def echo_tool_choice(tool_choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(tool_choice, dict):
        return {"type": "function", "name": tool_choice["function"]["name"]}
    return tool_choice


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise bad_request('text.format of type "json_schema" needs a schema.', "text.format.schema")
    if not fmt.name:
        raise bad_request('text.format of type "json_schema" needs a name.', "text.format.name")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.schema_,
                                                                           strict=fmt.strict))


def echo_text(text: TextConfig | None) -> dict[str, Any]:
    fmt = text.format if text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def output_turn(output: list[OutputItem]) -> ChatMessage:
    """A response's output as the assistant turn a chained request continues from: its text and its complete
    function calls (a call cut short has no arguments to render, and nothing can answer it)."""
    text = "".join(p.text for item in output if isinstance(item, OutputMessage) for p in item.content)
    calls = []
    for item in output:
        if isinstance(item, FunctionCallItem) and item.status == "completed":
            try:
                json.loads(item.arguments)
            except ValueError:
                continue
            calls.append({"id": item.call_id, "type": "function",
                          "function": {"name": item.name, "arguments": item.arguments}})
    return ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)

"""Request-side tool calling: checking `tools`/`tool_choice`, the JSON schema that forces a call, and
reading the output generated under that schema."""
from __future__ import annotations

import json

from tokenmill.serve.tool_parsers import (
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    dumps_arguments,
)
from tokenmill.serve.stream_text import skip_ws

_EMPTY_PARAMS = {"type": "object", "properties": {}}


def _as_dict(obj):
    return obj.model_dump(exclude_none=True) if hasattr(obj, "model_dump") else obj


def _named(tool_choice) -> str | None:
    """The function a named tool_choice asks for; None for the string choices."""
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return None
    tool_choice = _as_dict(tool_choice)
    fn = _as_dict(tool_choice.get("function")) if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise ValueError(f'tool_choice must be "none", "auto", "required" or '
                         f'{{"type": "function", "function": {{"name": ...}}}}, not {tool_choice!r}')
    return fn["name"]


def _functions(tools) -> list[dict]:
    return [_as_dict(_as_dict(t)["function"]) for t in tools or []]


def validate_tools(tools: list[dict] | None, tool_choice) -> None:
    """ValueError, with what is wrong, for a malformed `tools` list or a `tool_choice` it cannot satisfy."""
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list")
    for i, tool in enumerate(tools or []):
        tool = _as_dict(tool)
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'tools[{i}]: type must be "function"')
        fn = _as_dict(tool.get("function"))
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}]: function must be an object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    name = _named(tool_choice)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not tools:
        raise ValueError(f"tool_choice {tool_choice if name is None else name!r} needs tools")
    if name is not None and name not in {fn["name"] for fn in _functions(tools)}:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or dict(_EMPTY_PARAMS)


def tool_choice_schema(tools, tool_choice, parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema the output must follow for a forced call: None for "none"/"auto"; a named
    function's parameters; for "required" an array of {"name", "parameters"} objects."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    name = _named(tool_choice)
    fns = _functions(tools)
    if name is not None:
        for fn in fns:
            if fn["name"] == name:
                return _parameters(fn)
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": _parameters(fn)},
              "required": ["name", "parameters"], "additionalProperties": False} for fn in fns]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class ConstrainedToolStream(ToolParser):
    """Reads output generated under tool_choice_schema. Named: the whole output is the function's
    arguments (sent as they arrive, after a first delta with the id and name); an output that is not
    JSON is passed on as it is. "required": the JSON array, one call per element, arguments = its
    "parameters". The grammar lets nothing but calls into the array, so whatever in it is not a complete
    call is a call cut short (by max_tokens): it is dropped, never passed off as content, and so is the
    rest of the output. A stream may already have sent the cut call's name and the start of its
    arguments (it sends them as they are generated); a whole response has only the complete calls.
    Text after the closed array, or an output that is not an array at all, is content."""

    name = "constrained"
    owns_output = True
    after_call = ("comma", "text", "cut")

    def __init__(self, tool_choice, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self.function = _named(tool_choice)
        if self.function is None and tool_choice != "required":
            raise ValueError(f"tool_choice {tool_choice!r} does not force a call")
        self._state = "named" if self.function else "open"
        self._cut = False  # a cut-short call was dropped: the rest of the output goes with it

    def extract(self, text: str) -> ExtractedToolCalls:
        if self.function:
            try:
                arguments = dumps_arguments(json.loads(text))
            except ValueError:
                arguments = text or "{}"
            return ExtractedToolCalls(True, [ToolCall(self.function, arguments, self.new_id())], None)
        j = skip_ws(text, 0)
        if not text.startswith("[", j):
            return ExtractedToolCalls(False, [], text.strip() or None)
        broken: list[str] = []  # text in the array that is not a call: a call cut short
        calls: list[ToolCall] = []
        pos = self._extract_array(text, 0, j, broken, calls)
        content = None if broken else text[pos:].strip() or None
        return ExtractedToolCalls(bool(calls), calls, content)

    def _drop_call(self) -> None:
        # Inside the array: not a call, so a cut one. Drop it and everything after (state "cut" or, where
        # the caller moves on to "text", the _cut flag).
        self._call, self._held, self._cut = None, "", True

    def _st_cut(self, final: bool) -> bool:
        self._buf = ""
        return False

    def _st_named(self, final: bool) -> bool:
        if not self._announced:
            self._announce(self.function)
        self._arguments(self._buf)
        self._buf = ""
        if final:
            self._close()
            self._state = "text"
        return False

    def _st_open(self, final: bool) -> bool:
        s = self._buf.lstrip()
        if not s and not final:
            return False
        if s.startswith("["):
            self._held = self._buf[:len(self._buf) - len(s) + 1]
            self._buf, self._first, self._state = s[1:], True, "elem"
        else:
            self._state = "text"
        return True

    def _st_text(self, final: bool) -> bool:
        if not self._cut:
            self._content(self._buf)
        self._buf = ""
        return False

"""What a tool parser produces (calls, stream deltas) and the call-object JSON every format shares: decoding a
`{"name": ..., "arguments": ...}` object whole or as a stream."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable
from uuid import uuid4

from tokenmill.serve.stream_text import ObjectScanner, loads_or_none, skip_ws


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments
    id: str = field(default_factory=lambda: "call_" + uuid4().hex[:24])


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, in the first delta of a call only
    name: str | None = None
    arguments: str | None = None


@dataclass
class StreamDelta:
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


DECODER = json.JSONDecoder()


ARG_KEYS = ("arguments", "parameters")


class CallScanner(ObjectScanner):
    """`{"name": ..., "arguments": ...}`: the name once its string is complete, the arguments' text
    piece by piece (the first of ARG_KEYS to appear)."""

    def __init__(self) -> None:
        super().__init__()
        self.name: str | None = None
        self.args: list[str] = []  # pieces not yet taken
        self._name: list[str] | None = []  # None once decoded
        self._args_key: str | None = None
        self._args_over = False

    def on_value(self, key: str, piece: str, end: bool) -> None:
        if key == "name" and self._name is not None:
            self._name.append(piece)
            if end:
                name = loads_or_none("".join(self._name))
                self._name = None
                if isinstance(name, str) and name:
                    self.name = name
                else:
                    self.failed = True
        elif key in ARG_KEYS and not self._args_over and self._args_key in (None, key):
            self._args_key = key
            self.args.append(piece)
            self._args_over = end


def dumps_arguments(value) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: keep it escaped
        text = json.dumps(value, separators=(",", ":"))
    return text


def call_from(obj, new_id: Callable[[], str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in obj if k in ARG_KEYS), None)
    return ToolCall(obj["name"], dumps_arguments(obj[key] if key else {}), new_id())


def decode_call(text: str, pos: int, new_id: Callable[[], str]) -> tuple[ToolCall | None, int]:
    """The call object at pos (after whitespace) and where it ends; None when there is none."""
    pos = skip_ws(text, pos)
    try:
        obj, end = DECODER.raw_decode(text, pos)
    except ValueError:
        return None, pos
    return call_from(obj, new_id), end


def extracted(calls: list[ToolCall], pieces: list[str]) -> ExtractedToolCalls:
    return ExtractedToolCalls(bool(calls), calls, "".join(pieces).strip() or None)

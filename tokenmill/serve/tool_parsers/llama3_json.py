"""Llama 3.x JSON tool calls: the output is call objects joined by ";"."""
from __future__ import annotations

from tokenmill.serve.stream_text import skip_ws
from tokenmill.serve.tool_parsers.base import ToolParser
from tokenmill.serve.tool_parsers.calls import ExtractedToolCalls, ToolCall, decode_call, extracted


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the output (after whitespace and an optional `<|python_tag|>`) is
    `{"name": ..., "parameters": {...}}`, several joined by ";". Output that does not start with "{" is
    all content, and so is whatever follows the calls when it is not another call."""

    name = "llama3_json"
    after_call = ("after", "content", "content")
    TAG = "<|python_tag|>"

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self._state = "start"

    def extract(self, text: str) -> ExtractedToolCalls:
        pos = skip_ws(text, 0)
        if text.startswith(self.TAG, pos):
            pos = skip_ws(text, pos + len(self.TAG))
        calls: list[ToolCall] = []
        rest = 0
        while text.startswith("{", pos):
            call, end = decode_call(text, pos, self.new_id)
            if call is None:
                break
            calls.append(call)
            rest = pos = skip_ws(text, end)
            if not text.startswith(";", pos):
                break
            rest = pos = skip_ws(text, pos + 1)
        return extracted(calls, [text[rest:]])

    def _st_start(self, final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG):].lstrip()
        elif self.TAG.startswith(s) and not final:
            return False
        if not s and not final:
            return False
        if s.startswith("{"):
            self._begin_call(self._buf[:len(self._buf) - len(s)])
            self._buf = s
        else:
            self._state = "content"
        return True

    def _st_content(self, final: bool) -> bool:
        self._content(self._buf)
        self._buf = ""
        return False

    def _st_after(self, final: bool) -> bool:
        s = self._buf.lstrip()
        self._buf = s
        if not s:
            return False
        if s[0] == ";":
            self._buf, self._state = s[1:], "semi"
        else:
            self._state = "content"
        return True

    def _st_semi(self, final: bool) -> bool:
        s = self._buf.lstrip()
        self._buf = s
        if not s:
            return False
        if s[0] == "{":
            self._begin_call("")
        else:
            self._state = "content"
        return True

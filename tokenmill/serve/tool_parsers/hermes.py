"""Hermes-style tool calls (Hermes, Qwen2.5, Qwen3): `<tool_call>` JSON blocks."""
from __future__ import annotations

from tokenmill.serve.tool_parsers.base import ToolParser
from tokenmill.serve.tool_parsers.calls import ExtractedToolCalls, ToolCall, decode_call, extracted


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3). A
    block whose JSON is not a call stays in the content as written; text after a call's JSON inside its
    block is dropped; an unterminated last block counts when its JSON is complete."""

    name = "hermes"
    after_call = ("after", "bad", "skip")
    START, END = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> ExtractedToolCalls:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (i := text.find(self.START, pos)) >= 0:
            pieces.append(text[pos:i])
            j = i + len(self.START)
            call, end = decode_call(text, j, self.new_id)
            k = text.find(self.END, end if call else j)
            pos = len(text) if k < 0 else k + len(self.END)
            if call:
                calls.append(call)
            else:
                pieces.append(text[i:pos])
        pieces.append(text[pos:])
        return extracted(calls, pieces)

    def _st_text(self, final: bool) -> bool:
        if not self._emit_text(self.START, final):
            return False
        self._buf = self._buf[len(self.START):]
        self._begin_call(self.START)
        return True

    def _st_after(self, final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(self.END):
            self._buf, self._state = s[len(self.END):], "text"
            return True
        self._buf = s
        if not s or (self.END.startswith(s) and not final):
            return False
        self._state = "skip"
        return True

    def _to_end(self, final: bool, keep: bool) -> bool:
        if not self._emit_text(self.END, final, keep):
            return False
        if keep:
            self._content(self.END)
        self._buf, self._state = self._buf[len(self.END):], "text"
        return True

    def _st_bad(self, final: bool) -> bool:
        return self._to_end(final, True)

    def _st_skip(self, final: bool) -> bool:
        return self._to_end(final, False)

"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{...}` per call."""
from __future__ import annotations

import random
import re
import string

from tokenmill.serve.stream_text import ValueScanner, skip_ws
from tokenmill.serve.tool_parsers.base import ToolParser
from tokenmill.serve.tool_parsers.calls import DECODER, ExtractedToolCalls, ToolCall, dumps_arguments, extracted


_ALNUM = string.ascii_letters + string.digits
_NAME = re.compile(r"[\w.\-]*")


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects, or (newer
    tokenizers) `[TOOL_CALLS]name[ARGS]{...}`, once per call. Text outside the calls is content; call
    ids are 9 alphanumeric characters, as Mistral's chat template requires."""

    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, tokenizer=None) -> None:
        super().__init__(tokenizer)
        self._value = ValueScanner()

    @staticmethod
    def new_id() -> str:
        return "".join(random.choices(_ALNUM, k=9))

    def extract(self, text: str) -> ExtractedToolCalls:
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (i := text.find(self.MARK, pos)) >= 0:
            pieces.append(text[pos:i])
            j = skip_ws(text, i + len(self.MARK))
            if text.startswith("[", j):
                pos = self._extract_array(text, i, j, pieces, calls)
                continue
            m = _NAME.match(text, j)
            if m.end() > j and text.startswith(self.ARGS, m.end()):
                try:
                    value, end = DECODER.raw_decode(text, skip_ws(text, m.end() + len(self.ARGS)))
                except ValueError:
                    pass
                else:
                    calls.append(ToolCall(m.group(), dumps_arguments(value), self.new_id()))
                    pos = end
                    continue
            pieces.append(text[i:j])
            pos = j
        pieces.append(text[pos:])
        return extracted(calls, pieces)

    def _st_text(self, final: bool) -> bool:
        if not self._emit_text(self.MARK, final):
            return False
        self._held, self._buf, self._state = self.MARK, self._buf[len(self.MARK):], "open"
        return True

    def _st_open(self, final: bool) -> bool:
        s = self._buf.lstrip()
        self._held += self._buf[:len(self._buf) - len(s)]
        self._buf = s
        if not s:
            if final:
                self._drop_call()
            return False
        if s[0] == "[":
            self._held += "["
            self._buf, self._first, self._state = s[1:], True, "elem"
        else:
            self._state = "name"
        return True

    def _st_name(self, final: bool) -> bool:
        j = _NAME.match(self._buf).end()
        rest = self._buf[j:]
        if j and rest.startswith(self.ARGS):
            self._announce(self._buf[:j])
            self._held, self._buf = "", rest[len(self.ARGS):]
            self._value, self._state = ValueScanner(), "args"
            return True
        if not final and self.ARGS.startswith(rest):
            return False
        self._drop_call()
        self._state = "text"
        return True

    def _st_args(self, final: bool) -> bool:
        i, piece = self._value.feed(self._buf)
        self._arguments(piece)
        self._buf = self._buf[i:]
        if self._value.done or self._value.failed or final:
            self._close()
            self._state = "text"
            return not final or bool(self._buf)
        return False

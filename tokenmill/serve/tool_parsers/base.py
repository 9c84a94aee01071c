"""The streaming state machine every tool-call format is built on (tool_parsers/__init__.py says what a parser
returns)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar
from uuid import uuid4

from tokenmill.serve.stream_text import EdgeTrimmer, partial_suffix, skip_ws
from tokenmill.serve.tool_parsers.calls import (CallScanner, ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta,
                                                decode_call)


class ToolParser(ABC):
    """One instance per choice (it keeps streaming state).

    Streaming is a small state machine over a buffer of text not yet placed: `_advance` runs the
    handler `_st_<state>` until one reports that it needs more text. The states shared by the formats
    live here: "call" (one call object) and "elem"/"comma" (a JSON array of call objects)."""

    name: ClassVar[str] = ""
    # states after a call object: complete, not a call (its text is content), broken after its name went out
    after_call: ClassVar[tuple[str, str, str]] = ("comma", "text", "text")
    # The output was generated for this parser (under a grammar): its content is what `extract` says even
    # when it finds no call (a cut-short call is not content). Parsers of free text keep the text instead.
    owns_output: ClassVar[bool] = False
    # The format is markup made of special tokens (harmony's <|channel|>): the request's text then keeps them
    # (skip_special_tokens off), and a reasoning parser passes the call messages on with their markup.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self._state = "text"
        self._buf = ""
        self._held = ""  # text of a call that may still turn out not to be one
        self._first = True  # no element yet in the current array
        self._edges = EdgeTrimmer()
        self._out = StreamDelta()
        self._call: CallScanner | None = None
        self._index = 0  # of the current or next call
        self._announced = False
        self._sent_args = False

    @staticmethod
    def new_id() -> str:
        return "call_" + uuid4().hex[:24]

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output's calls and content."""

    def feed(self, delta_text: str) -> StreamDelta:
        self._buf += delta_text
        self._advance(False)
        return self._take()

    def flush(self) -> StreamDelta:
        self._advance(True)
        return self._take()

    @property
    def tools_called(self) -> bool:
        return self._index > 0 or self._announced

    def _advance(self, final: bool) -> None:
        # The handler by name: each format adds its own states (`_st_<state>` methods) to the shared ones.
        while getattr(self, "_st_" + self._state)(final):
            pass

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _content(self, text: str) -> None:
        text = self._edges.push(text)
        if text:
            self._out.content = (self._out.content or "") + text

    def _announce(self, name: str) -> None:
        self._out.tool_calls.append(ToolCallDelta(self._index, self.new_id(), name))
        self._announced = True

    def _arguments(self, piece: str) -> None:
        if not piece:
            return
        calls = self._out.tool_calls
        if calls and calls[-1].index == self._index:
            calls[-1].arguments = (calls[-1].arguments or "") + piece
        else:
            calls.append(ToolCallDelta(self._index, arguments=piece))
        self._sent_args = True

    def _close(self) -> None:
        if not self._sent_args:
            self._arguments("{}")
        self._index += 1
        self._announced = self._sent_args = False
        self._call, self._held = None, ""

    def _drop_call(self) -> None:
        """The held text was not a call after all: it is content."""
        self._content(self._held)
        self._call, self._held = None, ""

    def _begin_call(self, held: str) -> None:
        self._call, self._held, self._state = CallScanner(), held, "call"

    def _emit_text(self, marker: str, final: bool, keep: bool = True) -> bool:
        """Pass the buffer up to marker (as content when keep), holding back an end that could start
        it. True when the buffer now starts with marker."""
        i = self._buf.find(marker)
        if i < 0:
            i = len(self._buf) - (0 if final else partial_suffix(self._buf, marker))
        if keep:
            self._content(self._buf[:i])
        self._buf = self._buf[i:]
        return self._buf.startswith(marker)

    def _st_call(self, final: bool) -> bool:
        sc = self._call
        n = sc.feed(self._buf)
        if not self._announced:
            self._held += self._buf[:n]
        self._buf = self._buf[n:]
        if not self._announced and sc.name is not None:
            self._announce(sc.name)
        if self._announced:
            for piece in sc.args:
                self._arguments(piece)
            sc.args.clear()
        done, bad, broken = self.after_call
        if sc.failed or sc.done:
            if not self._announced:
                self._drop_call()
                self._state = bad
            else:
                self._close()
                self._state = broken if sc.failed else done
            return True
        if final:
            if self._announced:
                self._close()
                self._state = done
            else:
                self._held += self._buf
                self._buf = ""
                self._drop_call()
                self._state = bad
        return False

    def _array_next(self, final: bool) -> str:
        """Inside an array: moves whitespace to the held text; returns the rest ("" when more text is needed;
        at the end of the output the array was not one of calls)."""
        s = self._buf.lstrip()
        self._held += self._buf[:len(self._buf) - len(s)]
        self._buf = s
        if not s and final:
            self._drop_call()
        return s

    # A JSON array of call objects; "[" is consumed and self._held has the text since the array's
    # start. At the first element that is not a call, the text since the last call becomes content.
    def _st_elem(self, final: bool) -> bool:
        s = self._array_next(final)
        if not s:
            return False
        if self._first and s[0] == "]":
            self._buf, self._held, self._state = s[1:], "", "text"
        elif s[0] == "{":
            self._first = False
            self._begin_call(self._held)
        else:
            self._drop_call()
            self._state = "text"
        return True

    def _st_comma(self, final: bool) -> bool:
        s = self._array_next(final)
        if not s:
            return False
        if s[0] == ",":
            self._held += ","
            self._buf, self._state = s[1:], "elem"
        elif s[0] == "]":
            self._buf, self._held, self._state = s[1:], "", "text"
        else:
            self._drop_call()
            self._state = "text"
        return True

    def _extract_array(self, text: str, i: int, j: int, pieces: list[str], calls: list[ToolCall]) -> int:
        """The array at j (its "[", the calls' text starting at i): adds calls and content, returns where
        the text after it starts."""
        good, pos = i, j + 1
        while True:
            q = skip_ws(text, pos)
            if good == i and text.startswith("]", q):
                return q + 1
            call, end = decode_call(text, q, self.new_id)
            if call is None:
                pieces.append(text[good:q])
                return q
            calls.append(call)
            good = end
            r = skip_ws(text, end)
            if text.startswith(",", r):
                pos = r + 1
            elif text.startswith("]", r):
                return r + 1
            else:
                pieces.append(text[good:r])
                return r

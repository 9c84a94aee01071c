"""Tool calls in generated text, per model family (vLLM's parser names): whole outputs and streams.

Content is the text outside the calls, joined, with its leading and trailing whitespace stripped (None
when nothing is left); a stream drops the same whitespace, so its content fragments join to exactly
`extract(...).content`. A stream commits to a call as soon as its name is complete and then sends the
arguments' JSON text as it arrives; a call that breaks after that point (truncated or malformed JSON)
is closed as it stands, where `extract`, which sees the whole text, leaves it in the content.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
import random
import re
import string
from dataclasses import dataclass, field
from typing import Callable, ClassVar
from uuid import uuid4

from tokenmill.serve.stream_text import EdgeTrimmer, ObjectScanner, ValueScanner, loads_or_none, partial_suffix, skip_ws


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


_DECODER = json.JSONDecoder()


ARG_KEYS = ("arguments", "parameters")


class _CallScanner(ObjectScanner):
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


def _call_from(obj, new_id: Callable[[], str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in obj if k in ARG_KEYS), None)
    return ToolCall(obj["name"], dumps_arguments(obj[key] if key else {}), new_id())


def _decode_call(text: str, pos: int, new_id: Callable[[], str]) -> tuple[ToolCall | None, int]:
    """The call object at pos (after whitespace) and where it ends; None when there is none."""
    pos = skip_ws(text, pos)
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return None, pos
    return _call_from(obj, new_id), end


def _result(calls: list[ToolCall], pieces: list[str]) -> ExtractedToolCalls:
    return ExtractedToolCalls(bool(calls), calls, "".join(pieces).strip() or None)


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

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self._state = "text"
        self._buf = ""
        self._held = ""  # text of a call that may still turn out not to be one
        self._first = True  # no element yet in the current array
        self._edges = EdgeTrimmer()
        self._out = StreamDelta()
        self._call: _CallScanner | None = None
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
        self._call, self._held, self._state = _CallScanner(), held, "call"

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
            call, end = _decode_call(text, q, self.new_id)
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
            call, end = _decode_call(text, j, self.new_id)
            k = text.find(self.END, end if call else j)
            pos = len(text) if k < 0 else k + len(self.END)
            if call:
                calls.append(call)
            else:
                pieces.append(text[i:pos])
        pieces.append(text[pos:])
        return _result(calls, pieces)

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
            call, end = _decode_call(text, pos, self.new_id)
            if call is None:
                break
            calls.append(call)
            rest = pos = skip_ws(text, end)
            if not text.startswith(";", pos):
                break
            rest = pos = skip_ws(text, pos + 1)
        return _result(calls, [text[rest:]])

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
                    value, end = _DECODER.raw_decode(text, skip_ws(text, m.end() + len(self.ARGS)))
                except ValueError:
                    pass
                else:
                    calls.append(ToolCall(m.group(), dumps_arguments(value), self.new_id()))
                    pos = end
                    continue
            pieces.append(text[i:j])
            pos = j
        pieces.append(text[pos:])
        return _result(calls, pieces)

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


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None

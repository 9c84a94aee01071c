"""Text that arrives a fragment at a time: where a JSON value or object ends (strings, escapes, depth),
how much of a text's end could be the start of a marker, and a stream's edges trimmed of whitespace.
Used by the tool-call and reasoning parsers."""
from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_SCALAR = frozenset("-+.0123456789eEtrufalsn")
_SCALAR_START = frozenset("-0123456789tfn")
_OUTSIDE = re.compile(r'[][{}"]')
_INSIDE = re.compile(r'["\\]')

class ValueScanner:
    """Finds where one JSON value ends as its text arrives. It follows strings, escapes and bracket depth
    only: whether the inside is valid JSON is for the consumer of the text to find out."""

    def __init__(self) -> None:
        self.kind = ""  # "c" object or array, "s" string, "n" number or literal
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.done = False
        self.failed = False

    def feed(self, text: str, i: int = 0) -> tuple[int, str]:
        """Scan text from i: (where scanning stopped, the value's text seen). Leading whitespace is
        skipped; a number or literal stops before the character that ends it."""
        n = len(text)
        if not self.kind:
            while i < n and text[i] in _WS:
                i += 1
            if i == n:
                return i, ""
            c = text[i]
            if c in "{[":
                self.kind, self.depth = "c", 1
            elif c == '"':
                self.kind, self.in_str = "s", True
            elif c in _SCALAR_START:
                self.kind = "n"
            else:
                self.failed = True
                return i, ""
            start, i = i, i + 1
        else:
            start = i
        if self.kind == "n":
            while i < n and text[i] in _SCALAR:
                i += 1
            self.done = i < n
            return i, text[start:i]
        while i < n:
            if self.esc:
                self.esc = False
                i += 1
                continue
            m = (_INSIDE if self.in_str else _OUTSIDE).search(text, i)
            if m is None:
                return n, text[start:]
            i, c = m.end(), m.group()
            if c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = not self.in_str
                if self.kind == "s":
                    self.done = True
                    return i, text[start:i]
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i, text[start:i]
        return i, text[start:i]


class ObjectScanner:
    """Scans one JSON object as it arrives and hands each top-level member's value text to on_value."""

    def __init__(self) -> None:
        self.state = "open"  # open, first, key, colon, value, after, next
        self.key = ""
        self._key: list[str] = []
        self._esc = False
        self._value = ValueScanner()
        self.done = False
        self.failed = False

    def on_value(self, key: str, piece: str, end: bool) -> None:
        """The next piece of `key`'s value text; `end` marks the last."""

    def feed(self, text: str) -> int:
        """Consume text up to the closing brace: how much was consumed (all of it unless the object
        closed or turned out not to be one; then the rest starts at the offending character)."""
        i, n = 0, len(text)
        while i < n and not (self.done or self.failed):
            st = self.state
            if st == "value":
                i, piece = self._value.feed(text, i)
                if self._value.failed:
                    self.failed = True
                elif piece or self._value.done:
                    self.on_value(self.key, piece, self._value.done)
                    if self._value.done:
                        self.state = "after"
                continue
            if st == "key":
                j = i
                while j < n:
                    c = text[j]
                    if self._esc:
                        self._esc = False
                    elif c == "\\":
                        self._esc = True
                    elif c == '"':
                        break
                    j += 1
                self._key.append(text[i:j])
                if j == n:
                    return n
                try:
                    self.key = json.loads('"' + "".join(self._key) + '"')
                except ValueError:
                    self.failed = True
                    return j
                self.state, i = "colon", j + 1
                continue
            c = text[i]
            if c in _WS:
                i += 1
                continue
            if st == "open" and c == "{":
                self.state = "first"
            elif st in ("first", "next") and c == '"':
                self.state, self._key = "key", []
            elif st == "colon" and c == ":":
                self.state, self._value = "value", ValueScanner()
            elif st == "after" and c == ",":
                self.state = "next"
            elif st in ("first", "after") and c == "}":
                self.done = True
            else:
                self.failed = True
                break
            i += 1
        return i


def loads_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that could be the start of marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class EdgeTrimmer:
    """Drops a stream's leading and trailing whitespace: a whitespace run goes out only once text
    follows it."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return body

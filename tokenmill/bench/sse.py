"""Server-Sent Events, parsed by hand: only the `data` field matters for OpenAI streams.

An event is the `data:` lines up to a blank line, joined with newlines; lines starting with `:`
are comments (keep-alives) and other fields (`event:`, `id:`, `retry:`) are ignored.
"""
from __future__ import annotations

from typing import Iterable

DONE = "[DONE]"


class SSEDecoder:
    """Feed lines (without their line ending); `feed` returns an event's data when one completes."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if name == "data":
            # The spec strips exactly one space after the colon.
            self._data.append(value[1:] if value.startswith(" ") else value)
        elif not sep and line == "data":
            self._data.append("")
        return None

    def flush(self) -> str | None:
        """The pending event, for a stream that ends without a final blank line."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_sse(lines: Iterable[str]) -> list[str]:
    """All event payloads in `lines`, `[DONE]` included."""
    dec = SSEDecoder()
    out = [d for d in (dec.feed(line) for line in lines) if d is not None]
    last = dec.flush()
    return out + [last] if last is not None else out

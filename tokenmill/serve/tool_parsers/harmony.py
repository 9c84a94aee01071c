"""gpt-oss's harmony tool calls (vLLM's name: openai): a message addressed to a function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may also
stand before the channel: `<|start|>assistant to=functions.NAME<|channel|>commentary ...`)."""
from __future__ import annotations

import re

from tokenmill.serve.stream_text import partial_suffix
from tokenmill.serve.tool_parsers.base import ToolParser
from tokenmill.serve.tool_parsers.calls import ExtractedToolCalls, ToolCall

HEADER_OPENS = ("<|start|>", "<|channel|>")
MESSAGE = "<|message|>"
BODY_ENDS = ("<|call|>", "<|end|>", "<|return|>")
RECIPIENT = re.compile(r"to=([^\s<]+)")


def recipient(header: str) -> str | None:
    """The `to=` of a message header, or None."""
    m = RECIPIENT.search(header)
    return m.group(1) if m else None


def call_name(to: str) -> str:
    return to.removeprefix("functions.")


class HarmonyToolParser(ToolParser):
    """Reads harmony messages in the text it is given. With --reasoning-parser openai_gptoss (the intended set-up)
    that is the content the reasoning parser passes on: the final channel's text, and each message that has a
    recipient with its header kept (`<|channel|>CHANNEL to=RECIPIENT<|message|>BODY<|call|>`). A message with a
    recipient is a call: the name is the recipient less `functions.`, the arguments its body as the model wrote
    it (`{}` when empty); a body cut off (generation stopped at `<|call|>`, an end token the text leaves out) ends
    the call. Any other header stays in the content as it is. The markers are special tokens, so the request's
    text keeps them (needs_special_tokens). extract is the stream's own result, so the two agree however the text
    is cut."""

    name = "openai"
    needs_special_tokens = True

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = type(self)(self.tokenizer)
        calls: list[ToolCall] = []
        content: list[str] = []
        for d in (parser.feed(text), parser.flush()):
            content.append(d.content or "")
            for t in d.tool_calls:
                if t.name is not None:
                    calls.append(ToolCall(t.name, "", t.id))
                calls[t.index].arguments += t.arguments or ""
        return ExtractedToolCalls(bool(calls), calls, "".join(content) or None)

    def _st_text(self, final: bool) -> bool:
        found = [(self._buf.find(m), m) for m in HEADER_OPENS if m in self._buf]
        if found:
            i = min(found)[0]
        else:
            i = len(self._buf) - (0 if final else max(partial_suffix(self._buf, m) for m in HEADER_OPENS))
        self._content(self._buf[:i])
        self._buf = self._buf[i:]
        if not found:
            return False
        self._state = "header"
        return True

    def _st_header(self, final: bool) -> bool:
        i = self._buf.find(MESSAGE)
        if i < 0:
            if final:  # a header cut off: content as it is
                self._content(self._buf)
                self._buf = ""
            return False
        header, self._buf = self._buf[:i], self._buf[i + len(MESSAGE):]
        to = recipient(header)
        if to is None:
            self._content(header + MESSAGE)
            self._state = "text"
        else:
            self._announce(call_name(to))
            self._state = "args"
        return True

    def _st_args(self, final: bool) -> bool:
        buf = self._buf
        ends = [(buf.find(m), m) for m in BODY_ENDS if m in buf]
        if not ends:
            hold = 0 if final else max(partial_suffix(buf, m) for m in BODY_ENDS)
            self._arguments(buf[:len(buf) - hold])
            self._buf = buf[len(buf) - hold:]
            if final:
                self._close()
                self._state = "text"
            return False
        i, marker = min(ends)
        self._arguments(buf[:i])
        self._buf = buf[i + len(marker):]
        self._close()
        self._state = "text"
        return True

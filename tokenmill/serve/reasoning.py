"""Reasoning (`<think>...</think>`) split from the answer, per model family (vLLM's parser names).

Both results leave the tags out, the content loses the newlines that follow `</think>`, and an empty
part is None. A stream separates exactly at the tags, however they are split across fragments: the
reasoning and content fragments join to what `extract` returns (but see Qwen3ReasoningParser)."""
from __future__ import annotations

import re
from typing import ClassVar

from tokenmill.serve.stream_text import partial_suffix

Split = tuple[str | None, str | None]  # (reasoning, content)


class ReasoningParser:
    """One instance per choice (it keeps streaming state). `reasoning_ended`: the prompt already
    closed the reasoning (see ended_in_prompt), so the whole output is content, as it is."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Whether output that does not open with the start tag is reasoning (the template opened it).
    starts_in_prompt: ClassVar[bool] = True
    # Whether the parser reads markup made of special tokens (harmony's <|channel|>): the request's text then
    # keeps them (skip_special_tokens off); the parser leaves them out of both results.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer=None, reasoning_ended: bool = False) -> None:
        self.tokenizer = tokenizer
        self.reasoning_ended = reasoning_ended
        self._state = "content" if reasoning_ended else "start"  # start, reasoning, newlines, content
        self._buf = ""

    def extract(self, text: str) -> Split:
        if self.reasoning_ended or not (self.starts_in_prompt or text.startswith(self.start)):
            return None, text or None
        return self._split(text)

    def _split(self, text: str) -> Split:
        """Reasoning up to the first end tag (less a leading start tag), content after it."""
        if text.startswith(self.start):
            text = text[len(self.start):]
        reasoning, tag, content = text.partition(self.end)
        return reasoning or None, (content.lstrip("\r\n") or None) if tag else None

    def feed(self, delta_text: str) -> Split:
        self._buf += delta_text
        return self._advance(False)

    def flush(self) -> Split:
        return self._advance(True)

    def ended_in_prompt(self, prompt_text: str) -> bool:
        """True when the prompt's last reasoning tag closes it (e.g. Qwen3 with enable_thinking=False
        renders "<think>\\n\\n</think>\\n\\n" into the prompt)."""
        end = prompt_text.rfind(self.end)
        return end >= 0 and end > prompt_text.rfind(self.start)

    def end_token_ids(self) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__}.end_token_ids needs a tokenizer")
        return list(self.tokenizer.encode(self.end, add_special_tokens=False))

    def _advance(self, final: bool) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == "start":
                if not final and len(buf) < len(self.start) and self.start.startswith(buf):
                    break
                opened = buf.startswith(self.start)
                if opened:
                    self._buf = buf[len(self.start):]
                self._state = "reasoning" if opened or self.starts_in_prompt else "content"
            elif self._state == "reasoning":
                i = buf.find(self.end)
                if i < 0:
                    cut = len(buf) - (0 if final else partial_suffix(buf, self.end))
                    reasoning.append(buf[:cut])
                    self._buf = buf[cut:]
                    break
                reasoning.append(buf[:i])
                self._buf, self._state = buf[i + len(self.end):], "newlines"
            elif self._state == "newlines":
                self._buf = buf.lstrip("\r\n")
                if not self._buf:
                    break
                self._state = "content"
            else:
                content.append(buf)
                self._buf = ""
                break
        return "".join(reasoning) or None, "".join(content) or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the chat template opens `<think>` in the prompt, so the output may or may not
    repeat it; everything up to `</think>` is reasoning (all of it when there is no `</think>`)."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens `<think>` itself. Whole outputs follow vLLM: with `</think>`, the text
    before it (less a leading `<think>`) is reasoning; without, everything is content, tags and all.

    A stream cannot wait for `</think>`, so it decides at the start: output that opens with `<think>`
    is reasoning up to `</think>`, any other output is content, passed on as it is. The two differ only
    for an output that opens `<think>` and never closes it (a stream: reasoning; extract: content) and
    for one with `</think>` but no leading `<think>` (a stream: all content; extract: split)."""

    name = "qwen3"
    starts_in_prompt = False

    def extract(self, text: str) -> Split:
        if self.reasoning_ended or self.end not in text:
            return None, text or None
        return self._split(text)


HARMONY_OPENS = ("<|channel|>", "<|start|>")  # what a message's header opens with
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end: another follows, the turn's, a tool call's
# The output's first header may open with its recipient (the prompt ended `<|start|>assistant`).
HARMONY_FIRST = HARMONY_OPENS + (" to=",)
HARMONY_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony format (vLLM's name: openai_gptoss). After the prompt's `<|start|>assistant` the model
    writes messages `<|channel|>CHANNEL[ header...]<|message|>BODY<|end|>`, each later one opened by
    `<|start|>assistant`, the last ended by `<|return|>` (or `<|call|>`): the bodies of the `analysis` channel
    are reasoning, the others' (final, commentary) content; the markup is in neither. Output that does not open
    with harmony markup is content as it is. The markers are special tokens, so the text keeps them
    (needs_special_tokens). A stream splits exactly where extract does, however the text is cut."""

    name = "openai_gptoss"
    start = "<|channel|>"
    end = "<|channel|>final<|message|>"  # where the answer starts: a constraint applies from here
    needs_special_tokens = True

    def __init__(self, tokenizer=None, reasoning_ended: bool = False) -> None:
        super().__init__(tokenizer, reasoning_ended)
        self._state = "content_raw" if reasoning_ended else "start"  # start, header, body, content_raw
        self._channel = ""
        self._call = False  # the current message has a recipient and is passed on whole (keep_tool_calls)
        # A tool parser that reads harmony (tool_parsers/harmony.py) is downstream: messages addressed to a
        # recipient go to the content with their markup, as `<|channel|>CHANNEL to=RECIPIENT<|message|>BODY<end>`.
        self.keep_tool_calls = False

    def extract(self, text: str) -> Split:
        parser = type(self)(self.tokenizer, self.reasoning_ended)
        parser.keep_tool_calls = self.keep_tool_calls
        return _join(parser.feed(text), parser.flush())

    def ended_in_prompt(self, prompt_text: str) -> bool:
        """The prompt's last assistant message already opened the final channel (a continued answer)."""
        return self.end in prompt_text[prompt_text.rfind("<|start|>"):]

    def _advance(self, final: bool) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state == "start":  # harmony markup, or plain text (all content)
                if not final and any(len(buf) < len(m) and m.startswith(buf) for m in HARMONY_FIRST):
                    break
                self._state = "header" if buf.startswith(HARMONY_FIRST) else "content_raw"
            elif self._state == "content_raw":
                content.append(buf)
                self._buf = ""
            elif self._state == "header":  # [<|start|>role]<|channel|>name[ ...]<|message|>
                i = buf.find("<|message|>")
                if i < 0:
                    if final:  # a header cut off: no body follows
                        self._buf = ""
                    break
                header = buf[:i]
                channel = header.partition("<|channel|>")[2]
                self._channel = channel.split("<|", 1)[0].split(" ", 1)[0].strip()
                to = HARMONY_RECIPIENT.search(header)
                self._call = self.keep_tool_calls and to is not None
                if self._call:
                    content.append(f"<|channel|>{self._channel} to={to.group(1)}<|message|>")
                self._buf, self._state = buf[i + len("<|message|>"):], "body"
            else:  # body, up to its end marker
                out = reasoning if self._channel == "analysis" and not self._call else content
                ends = [(buf.find(m), m) for m in HARMONY_ENDS if m in buf]
                if not ends:
                    hold = 0 if final else max(partial_suffix(buf, m) for m in HARMONY_ENDS)
                    out.append(buf[:len(buf) - hold])
                    self._buf = buf[len(buf) - hold:]
                    break
                i, marker = min(ends)
                out.append(buf[:i] + (marker if self._call else ""))
                self._buf, self._state = buf[i + len(marker):], "header"
        return "".join(reasoning) or None, "".join(content) or None


def _join(a: Split, b: Split) -> Split:
    return (a[0] or "") + (b[0] or "") or None, (a[1] or "") + (b[1] or "") or None


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None

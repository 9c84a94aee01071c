"""What one chat request asked of its output (reasoning split, tool calls), and splitting each choice's text
accordingly: whole for a response, fragment by fragment for a stream.

Order: the reasoning parser (if the server has one) takes what is between <think> and </think> (harmony: the
analysis channel; messages to a recipient are passed on with their markup when the tool parser reads harmony);
what remains is content, which a tool parser (tool_choice "auto" with --enable-auto-tool-choice, or the constrained JSON of
"required" / a named function) turns into tool calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.serve.errors import bad_request
from tokenmill.serve.protocol import (ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                      ToolCall)


@dataclass
class ChatPlan:
    tools: list[dict] | None = None
    tool_choice: Any = "none"  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    tool_parser: str | None = None  # --tool-call-parser, for "auto"
    reasoning_parser: str | None = None
    reasoning_ended: bool = False  # the prompt already closed the reasoning section
    tokenizer: Any = None

    @property
    def auto_tools(self) -> bool:
        return self.tool_choice == "auto" and bool(self.tools) and self.tool_parser is not None

    @property
    def constrained_tools(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def tool_schema(self) -> dict | None:
        from tokenmill.serve.tools import tool_choice_schema

        return tool_choice_schema(self.tools, self.tool_choice, self.parallel_tool_calls)

    def reasoning(self):
        """A fresh reasoning parser, or None when the server has none."""
        if self.reasoning_parser is None:
            return None
        from tokenmill.serve.reasoning import get_reasoning_parser

        return get_reasoning_parser(self.reasoning_parser)(self.tokenizer, reasoning_ended=self.reasoning_ended)

    def splitter(self) -> "ChoiceSplitter":
        reasoning, tools = self.reasoning(), None
        if self.constrained_tools:
            from tokenmill.serve.tools import ConstrainedToolStream

            tools = ConstrainedToolStream(self.tool_choice)
        elif self.auto_tools:
            from tokenmill.serve.tool_parsers import get_tool_parser

            tools = get_tool_parser(self.tool_parser)(self.tokenizer)
            if reasoning is not None and tools.needs_special_tokens:  # harmony: calls keep their markup
                reasoning.keep_tool_calls = True
        return ChoiceSplitter(reasoning, tools, self.parallel_tool_calls)

    def needs_special_tokens(self) -> bool:
        """A parser of this request reads markup made of special tokens: its text must keep them."""
        from tokenmill.serve.reasoning import get_reasoning_parser
        from tokenmill.serve.tool_parsers import get_tool_parser

        reasoning = self.reasoning_parser is not None and get_reasoning_parser(self.reasoning_parser).needs_special_tokens
        return reasoning or (self.auto_tools and get_tool_parser(self.tool_parser).needs_special_tokens)

    def finish_reason(self, reason: str | None, tools_called: bool) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call (auto, required); a named function ends with "stop".
        if reason == "stop" and tools_called and not isinstance(self.tool_choice, dict):
            return "tool_calls"
        return reason


def chat_plan(req: ChatCompletionRequest, settings, tokenizer) -> ChatPlan:
    """Check tools and tool_choice against the server's parsers; 400 naming the field when they do not fit."""
    from tokenmill.serve.tools import validate_tools

    tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    try:
        validate_tools(req.tools, tool_choice)
    except ValueError as e:
        param = "tool_choice" if "tool_choice" in str(e) else "tools"
        raise bad_request(" ".join(str(e).split()), param) from None
    if tool_choice == "auto" and req.tools and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                          'on the server; or use tool_choice "required", "none" or a named function.', "tool_choice")
    return ChatPlan(req.tools, tool_choice, req.parallel_tool_calls, settings.tool_call_parser,
                    settings.reasoning_parser, tokenizer=tokenizer)


@dataclass
class ChoiceParts:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ChoiceSplitter:
    """One choice: its text -> reasoning, content and tool calls."""

    def __init__(self, reasoning, tools, parallel_tool_calls: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel_tool_calls
        self._called = False

    @property
    def tools_called(self) -> bool:
        return self._called or (self.tools is not None and self.tools.tools_called)

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract(text)
        calls: list[ToolCall] = []
        if self.tools is not None and content:
            got = self.tools.extract(content)
            if got.tools_called or self.tools.owns_output:
                content = got.content
                found = got.tool_calls if self.parallel else got.tool_calls[:1]
                calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in found]
                self._called = True
        return reasoning, content, calls

    def feed(self, text: str) -> ChoiceParts:
        return self._route(*((None, text) if self.reasoning is None else self.reasoning.feed(text)), final=False)

    def flush(self) -> ChoiceParts:
        if self.reasoning is None:
            return self._route(None, None, final=True)
        return self._route(*self.reasoning.flush(), final=True)

    def _route(self, reasoning: str | None, content: str | None, final: bool) -> ChoiceParts:
        parts = ChoiceParts(reasoning=reasoning or None)
        if self.tools is None:
            parts.content = content or None
            return parts
        got = [self.tools.feed(content)] if content else []
        if final:
            got.append(self.tools.flush())
        texts = []
        for d in got:
            if d.content:
                texts.append(d.content)
            for t in d.tool_calls:
                if not self.parallel and t.index > 0:
                    continue
                parts.tool_calls.append(DeltaToolCall(
                    index=t.index, id=t.id, type="function" if t.id is not None else None,
                    function=DeltaFunctionCall(name=t.name, arguments=t.arguments)))
        parts.content = "".join(texts) or None
        return parts

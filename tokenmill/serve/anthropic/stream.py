"""A streamed message as Anthropic's events: message_start (once the prompt is computed, so its usage holds the
prefix cache's reads), ping, then content blocks one at a time (content_block_start, its deltas —
thinking_delta, text_delta, input_json_delta — and content_block_stop), message_delta (stop_reason and the
final usage) and message_stop. An engine failure after the start ends the stream with Anthropic's error event."""
from __future__ import annotations

from typing import AsyncIterator

from tokenmill.serve.anthropic.output import stop_reason, usage
from tokenmill.serve.anthropic.protocol import (ContentBlock, ContentBlockDeltaEvent, ContentBlockStartEvent,
                                                ContentBlockStopEvent, InputJSONDelta, MessageDelta, MessageDeltaEvent,
                                                MessageResponse, MessageStartEvent, MessageStopEvent, PingEvent,
                                                TextBlock, TextDelta, ThinkingBlock, ThinkingDelta, ToolUseBlock,
                                                event)
from tokenmill.serve.chat_output import ChatPlan, ChoiceParts
from tokenmill.serve.errors import APIError
from tokenmill.serve.generation import Submission


class BlockWriter:
    """Content blocks opened and closed as one choice's parts arrive. Anthropic's blocks do not interleave: a
    part of another kind (thinking, text, a tool call) closes the open block and starts the next index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type
        self.call: int | None = None  # the tool parser's index of the call the open tool_use block holds

    def parts(self, parts: ChoiceParts) -> list[str]:
        out: list[str] = []
        if parts.reasoning:
            out += self._delta(ThinkingBlock(thinking=""), ThinkingDelta(thinking=parts.reasoning))
        if parts.content:
            out += self._delta(TextBlock(text=""), TextDelta(text=parts.content))
        for t in parts.tool_calls:
            if t.id is not None:  # a new call: its id and name come first, the arguments as they are generated
                out += self._start(ToolUseBlock(id=t.id, name=t.function.name or "", input={}))
                self.call = t.index
            elif self.open != "tool_use" or t.index != self.call:
                continue  # the parsers finish one call before the next; nothing else can be placed
            if t.function.arguments:
                out.append(event(ContentBlockDeltaEvent(index=self.index,
                                                        delta=InputJSONDelta(partial_json=t.function.arguments))))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event(ContentBlockStopEvent(index=self.index))]

    def _delta(self, block: ContentBlock, delta) -> list[str]:
        out = [] if self.open == block.type else self._start(block)
        out.append(event(ContentBlockDeltaEvent(index=self.index, delta=delta)))
        return out

    def _start(self, block: ContentBlock) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = block.type
        out.append(event(ContentBlockStartEvent(index=self.index, content_block=block)))
        return out


async def stream_message(sub: Submission, message_id: str, model: str, plan: ChatPlan) -> AsyncIterator[str]:
    split = plan.splitter()
    blocks = BlockWriter()
    started = False
    try:
        while not sub.finished:
            try:
                delta = await sub.next()
            except APIError as e:
                yield e.anthropic_sse()
                return
            if not started:
                started = True
                yield event(MessageStartEvent(message=MessageResponse(id=message_id, model=model, content=[],
                                                                      usage=usage(sub))))
                yield event(PingEvent())
            for s in delta.sequences:  # one prompt, one sequence
                out = blocks.parts(split.feed(s.text)) if s.text else []
                if s.finish_reason is not None:
                    out += blocks.parts(split.flush()) + blocks.close()
                    reason, sequence = stop_reason(s.finish_reason, s.stop_reason, split.tools_called)
                    out.append(event(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                                       usage=usage(sub))))
                    out.append(event(MessageStopEvent()))
                for e in out:
                    yield e
    finally:
        sub.abort()

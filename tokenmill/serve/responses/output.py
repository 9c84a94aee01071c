"""A response's output items, built from the split text of its one choice (serve/chat_output.py's
ChoiceSplitter: reasoning, content, tool calls) as it arrives, with the stream events each step makes.

Items follow the text: reasoning (a `reasoning` item with reasoning_text content), answer text (a `message`
item with one output_text part) and each tool call (a `function_call` item). A new kind of text closes the item
before it; the last item is closed when the output ends, "incomplete" when max_output_tokens cut it.

Every step queues its events (SSE, each with the next `sequence_number`) in the shapes of
openai.types.responses: `response.output_item.added` / `.done`, `response.content_part.added` / `.done`,
`response.output_text.delta` / `.done`, `response.reasoning_text.delta` / `.done` and
`response.function_call_arguments.delta` / `.done`. A whole (not streamed) response builds its items the same
way and drops the events.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from tokenmill.serve.chat_output import ChoiceParts
from tokenmill.serve.protocol import DeltaToolCall, ToolCall
from tokenmill.serve.responses.protocol import (FunctionCallItem, OutputItem, OutputMessage, OutputText,
                                                ReasoningItem, ReasoningText)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class EventLog:
    """Stream events in order, each numbered (`sequence_number`) and written as one SSE event."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.pending: list[str] = []

    def emit(self, type: str, **fields: Any) -> None:
        payload = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        self.pending.append(f"event: {type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n")

    def take(self) -> list[str]:
        out, self.pending = self.pending, []
        return out


class OutputBuilder:
    def __init__(self, events: EventLog | None = None) -> None:
        self.events = events or EventLog()
        self.items: list[OutputItem] = []
        self._open: int | None = None  # the output index of the item still growing
        self._calls: dict[int, int] = {}  # tool call index (the parser's) -> output index

    # ---- feeding ----------------------------------------------------------------------------------------------
    def add(self, parts: ChoiceParts) -> None:
        """One fragment of split text, streamed: reasoning, then content, then tool call deltas."""
        if parts.reasoning:
            self.reasoning(parts.reasoning)
        if parts.content:
            self.text(parts.content)
        for delta in parts.tool_calls:
            self.call_delta(delta)

    def reasoning(self, text: str) -> None:
        item = self._growing(ReasoningItem)
        if item is None:
            item = self._open_item(ReasoningItem(id=new_id("rs"), content=[], status="in_progress"))
            item.content.append(ReasoningText(text=""))
            self._part_event("response.content_part.added", item)
        item.content[0].text += text
        self.events.emit("response.reasoning_text.delta", item_id=item.id, output_index=self._open, content_index=0,
                         delta=text)

    def text(self, text: str) -> None:
        item = self._growing(OutputMessage)
        if item is None:
            item = self._open_item(OutputMessage(id=new_id("msg"), content=[], status="in_progress"))
            item.content.append(OutputText(text=""))
            self._part_event("response.content_part.added", item)
        item.content[0].text += text
        self.events.emit("response.output_text.delta", item_id=item.id, output_index=self._open, content_index=0,
                         delta=text, logprobs=[])

    def call_delta(self, delta: DeltaToolCall) -> None:
        """A streamed call: the first delta has its id and name, the next ones pieces of its arguments."""
        if delta.id is not None or delta.index not in self._calls:
            self._open_item(FunctionCallItem(id=new_id("fc"), call_id=delta.id or new_id("call"),
                                             name=delta.function.name or "", arguments="", status="in_progress"))
            self._calls[delta.index] = self._open
        index = self._calls[delta.index]
        if index != self._open:  # the parsers write one call after the other; never an earlier one again
            return
        piece = delta.function.arguments
        if piece:
            item = self.items[index]
            item.arguments += piece
            self.events.emit("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                             delta=piece)

    def call(self, call: ToolCall) -> None:
        """A whole call (a response that was not streamed)."""
        self._open_item(FunctionCallItem(id=new_id("fc"), call_id=call.id, name=call.function.name,
                                         arguments=call.function.arguments, status="in_progress"))

    def finish(self, incomplete: bool) -> None:
        """The output ended: the last item closes ("incomplete" when it was cut short)."""
        self._close("incomplete" if incomplete else "completed")

    # ---- reading ----------------------------------------------------------------------------------------------
    @property
    def reasoning_text(self) -> str:
        return "".join(p.text for item in self.items if isinstance(item, ReasoningItem) for p in item.content)

    @property
    def answered(self) -> bool:
        """Whether the output holds anything beyond reasoning."""
        return any(not isinstance(item, ReasoningItem) for item in self.items)

    # ---- items ------------------------------------------------------------------------------------------------
    def _growing(self, kind: type) -> Any:
        item = self.items[self._open] if self._open is not None else None
        return item if isinstance(item, kind) else None

    def _open_item(self, item: OutputItem) -> Any:
        self._close("completed")
        self.items.append(item)
        self._open = len(self.items) - 1
        self.events.emit("response.output_item.added", output_index=self._open, item=item.model_dump())
        return item

    def _part_event(self, type: str, item: OutputMessage | ReasoningItem) -> None:
        self.events.emit(type, item_id=item.id, output_index=self._open, content_index=0,
                         part=item.content[0].model_dump())

    def _close(self, status: str) -> None:
        if self._open is None:
            return
        index, item = self._open, self.items[self._open]
        emit = self.events.emit
        if isinstance(item, OutputMessage):
            emit("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                 text=item.content[0].text, logprobs=[])
            self._part_event("response.content_part.done", item)
        elif isinstance(item, ReasoningItem):
            emit("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                 text=item.content[0].text)
            self._part_event("response.content_part.done", item)
        else:
            emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                 arguments=item.arguments)
            if _is_json(item.arguments):  # a call whose arguments are whole is complete, cut output or not
                status = "completed"
        item.status = status
        emit("response.output_item.done", output_index=index, item=item.model_dump())
        self._open = None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True

"""POST /v1/responses: a Responses request read as a chat conversation, run through the chat path
(admission.py, chat_completions.prepare_chat), and answered as a Response object or its typed event stream."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.serve.admission import admit
from tokenmill.serve.chat_completions import prepare_chat
from tokenmill.serve.chat_output import ChatPlan
from tokenmill.serve.chat_prompt import MESSAGE_OVERHEAD
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.generation import SSEResponse, Submission
from tokenmill.serve.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.serve.responses.conversation import (chat_tool_choice, chat_tools, echo_text, echo_tool_choice,
                                                    echo_tools, input_messages, known_call_ids, output_turn,
                                                    response_format)
from tokenmill.serve.responses.output import EventLog, OutputBuilder, new_id
from tokenmill.serve.responses.protocol import (CHAT_FIELDS, IncompleteDetails, InputTokensDetails,
                                                OutputTokensDetails, ResponseError, ResponseObject,
                                                ResponsesRequest, ResponseUsage)
from tokenmill.serve.responses.store import ResponseStore, dump_conversation
from tokenmill.serve.state import LARGE_INPUT, ServerState
from tokenmill.serve.tenants.keys import Tenant

# OpenAI's bounds on `metadata`.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# The chat request's parameter names, as this API names them, for the 400s the chat path raises.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "response_format.json_schema": "text.format.schema"}


def owner_of(tenant: Tenant | None) -> str | None:
    return tenant.name if tenant is not None else None


@contextmanager
def responses_params():
    """A 400 from the chat path names the field of this API (`input`, not `messages`)."""
    try:
        yield
    except APIError as e:
        e.param = _PARAMS.get(e.param, e.param)
        raise


def _refuse_unsupported(req: ResponsesRequest) -> None:
    refusals = [
        (req.background, "background", "background responses are not supported: run the request in the foreground."),
        (req.truncation == "auto", "truncation",
         'truncation "auto" is not supported: an input over the context window is refused (truncation "disabled").'),
        (req.top_logprobs, "top_logprobs", "top_logprobs is not supported on /v1/responses; use /v1/chat/completions."),
        (req.conversation is not None, "conversation",
         "conversation objects are not supported: chain responses with previous_response_id."),
        (req.prompt is not None, "prompt", "prompt templates are not supported: send input and instructions."),
    ]
    for refused, param, message in refusals:
        if refused:
            raise bad_request(message, param)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}.", "max_output_tokens")
    meta = req.metadata or {}
    if len(meta) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, got {len(meta)}.", "metadata")
    for key, value in meta.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata keys may be at most {MAX_METADATA_KEY} characters and values at most "
                              f"{MAX_METADATA_VALUE}.", "metadata")
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
    if forced and req.text is not None and req.text.format is not None and req.text.format.type != "text":
        raise bad_request(f"text.format {req.text.format.type!r} cannot be combined with tool_choice "
                          f"{req.tool_choice!r}: the tool call is the output's format.", "text.format")


async def create_response(state: ServerState, store: ResponseStore, req: ResponsesRequest, raw: Request,
                          arrival_time: float | None = None):
    adm = admit(state, raw, model=req.model, slo=req.slo, priority=req.priority, cache_salt=req.cache_salt,
                arrival_time=arrival_time)
    _refuse_unsupported(req)
    owner = owner_of(adm.tenant)
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id, owner)
        if previous is None:  # unknown, evicted, deleted, not stored, or another tenant's: one answer
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                           "previous_response_id", "previous_response_not_found")
        history = await state.run_blocking(previous.messages, size=len(previous.conversation))
    items = len(req.input) if isinstance(req.input, list) else 1
    if items * MESSAGE_OVERHEAD > LARGE_INPUT:  # many items (a body holds up to ~10^5): read in the slow lane
        new = await state.run_blocking(input_messages, req.input, known_call_ids(history),
                                       size=items * MESSAGE_OVERHEAD)
    else:
        new = input_messages(req.input, known_call_ids(history))
    conversation = history + new
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    tool_choice = chat_tool_choice(req.tool_choice)
    chat = ChatCompletionRequest(messages=system + conversation, tools=chat_tools(req.tools), tool_choice=tool_choice,
                                 max_tokens=req.max_output_tokens, response_format=response_format(req.text),
                                 **{f: getattr(req, f) for f in CHAT_FIELDS})
    with responses_params():
        plan, text, ids, params = await prepare_chat(state, chat, adm)
    sub = await adm.submit([ids], [text], [params])
    answer = Answer(state, store, req, sub, plan, adm.model, owner, conversation)
    if req.stream:
        return SSEResponse(answer.stream())
    await sub.run_to_end(raw)
    body = await answer.whole()
    return Response(body, media_type="application/json")


class Answer:
    """One admitted request's Response object: built whole, or streamed as events; stored when asked."""

    def __init__(self, state: ServerState, store: ResponseStore, req: ResponsesRequest, sub: Submission,
                 plan: ChatPlan, model: str, owner: str | None, conversation: list[ChatMessage]) -> None:
        self.state, self.store, self.req, self.sub, self.plan = state, store, req, sub, plan
        self.owner, self.conversation = owner, conversation
        self.response = ResponseObject(
            id=new_id("resp"), status="in_progress", model=model, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
            parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
            reasoning={"effort": req.reasoning.effort if req.reasoning else None,
                       "summary": req.reasoning.summary if req.reasoning else None},
            store=req.store, temperature=1.0 if req.temperature is None else req.temperature, text=echo_text(req.text),
            tool_choice=echo_tool_choice(plan.tool_choice), tools=echo_tools(req.tools),
            top_p=1.0 if req.top_p is None else req.top_p, user=req.user, metadata=req.metadata or {})

    async def whole(self) -> str:
        choice = self.sub.choices[0]
        reasoning, content, calls = self.plan.splitter().whole(choice.full_text)
        out = OutputBuilder()
        if reasoning:
            out.reasoning(reasoning)
        if content:
            out.text(content)
        for call in calls:
            out.call(call)
        return await self._finish(out, choice.finish_reason)

    async def stream(self) -> AsyncIterator[str]:
        events = EventLog()
        out = OutputBuilder(events)
        splitter = self.plan.splitter()
        sub = self.sub
        try:
            events.emit("response.created", response=self.response.model_dump())
            events.emit("response.in_progress", response=self.response.model_dump())
            for e in events.take():
                yield e
            finish_reason = None
            while not sub.finished:
                try:
                    delta = await sub.next()
                except APIError as e:
                    for event in self._failed(events, out, e):
                        yield event
                    return
                for s in delta.sequences:
                    if s.text:
                        out.add(splitter.feed(s.text))
                    if s.finish_reason is not None:
                        out.add(splitter.flush())
                        finish_reason = s.finish_reason
                for e in events.take():
                    yield e
            await self._finish(out, finish_reason)
            kind = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
            events.emit(kind, response=self.response.model_dump())
            for e in events.take():
                yield e
        finally:
            sub.abort()

    def _failed(self, events: EventLog, out: OutputBuilder, e: APIError) -> list[str]:
        """An engine error mid-stream: an `error` event, then `response.failed` (the response is not stored)."""
        events.emit("error", code=e.code, message=e.message, param=e.param)
        out.finish(incomplete=True)
        r = self.response
        r.status, r.output = "failed", out.items
        r.error = ResponseError(code="rate_limit_exceeded" if e.status == 429 else "server_error", message=e.message)
        events.emit("response.failed", response=r.model_dump())
        return events.take()

    async def _finish(self, out: OutputBuilder, finish_reason: str | None) -> str:
        """Close the output, fill in status and usage, store the response when asked; its JSON."""
        incomplete = finish_reason == "length"
        out.finish(incomplete)
        r = self.response
        r.output = out.items
        r.status = "incomplete" if incomplete else "completed"
        r.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        r.completed_at = int(time.time())
        usage = self.sub.usage()
        r.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=await self._reasoning_tokens(out, usage)),
            total_tokens=usage.total_tokens)
        body = r.model_dump_json()
        if r.store:
            turns = self.conversation + [output_turn(out.items)]
            history = await self.state.run_blocking(dump_conversation, turns,
                                                    size=sum(len(m.content or "") for m in turns))
            self.store.put(r.id, self.owner, body, history)
        return body

    async def _reasoning_tokens(self, out: OutputBuilder, usage) -> int:
        """The output tokens that were reasoning: all of them when nothing followed it, else its text's tokens."""
        text = out.reasoning_text
        if not text:
            return 0
        if not out.answered:
            return usage.completion_tokens
        tok = self.state.engine.tokenizer
        ids = await self.state.run_blocking(lambda: tok(text, add_special_tokens=False).input_ids, size=len(text))
        return min(len(ids), usage.completion_tokens)

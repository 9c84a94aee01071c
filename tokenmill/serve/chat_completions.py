"""POST /v1/chat/completions: messages through the chat template, streamed or not."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.serve.admission import Admission, admit
from tokenmill.serve.chat import render_chat
from tokenmill.serve.chat_output import ChatPlan, ChoiceParts, chat_plan
from tokenmill.serve.chat_prompt import chat_prompt
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.generation import (DONE, SSEResponse, Submission, error_event, random_id, sse,
                                        token_decoder)
from tokenmill.serve.logprobs import chat_logprobs
from tokenmill.serve.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatDelta, ChatResponseMessage, ChatStreamChoice)
from tokenmill.serve.sampling import build_sampling_params, check_lists
from tokenmill.serve.state import LARGE_INPUT, ServerState
from tokenmill.serve.structured import check_constraint, request_constraint


async def generation_prompt(state: ServerState, req: ChatCompletionRequest, text: str) -> str:
    """What the template appended after the conversation to open the assistant's turn (e.g. Qwen3's empty
    think block when thinking is off): only there can the prompt have closed this turn's reasoning. Think
    blocks of earlier assistant turns are history and say nothing about this one (issue 25)."""
    if not req.add_generation_prompt or req.continue_final_message:
        return text
    try:
        history = await state.run_blocking(
            render_chat, state.engine.tokenizer, req.messages, state.settings.chat_template, False, False,
            req.tools, req.chat_template_kwargs, size=len(text))
    except ValueError:
        return text
    return text[len(history):] if text.startswith(history) else text


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request,
                                 arrival_time: float | None = None):
    adm = admit(state, raw, model=req.model, slo=req.slo, priority=req.priority, cache_salt=req.cache_salt,
                arrival_time=arrival_time)
    plan, text, ids, params = await prepare_chat(state, req, adm)
    sub = await adm.submit([ids], [text], [params])
    model = adm.model
    if req.stream:
        return SSEResponse(_stream(state, req, sub, model, plan))
    await sub.run_to_end(raw)
    # Many logprobs (n x max_tokens x top_logprobs) are built in the slow lane, off the event loop.
    size = sum(len(c.token_ids) for c in sub.choices) * ((req.top_logprobs or 0) + 1) if req.logprobs else 0
    return Response(await state.run_blocking(_response_json, state, req, sub, model, plan, size=size)
                    if size > LARGE_INPUT else _response_json(state, req, sub, model, plan),
                    media_type="application/json")


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, adm: Admission,
                       constraint: tuple[StructuredOutputsParams | None, str] | None = None
                       ) -> tuple[ChatPlan, str, list[int], SamplingParams]:
    """What a chat request does between admit() and submit(), for every chat-shaped surface (chat completions,
    the Responses and Messages APIs): its output plan (tools, reasoning) and constraint, the cheap list checks,
    its sequence slots, the prompt rendered and tokenized, the grammar checked and the SamplingParams built.
    `constraint`: the output format and the field it came from, where a surface names it in its own field (the
    Messages API's output_config); else the request's response_format / structured outputs."""
    tok = state.engine.tokenizer
    plan = chat_plan(req, state.settings, tok)
    so, so_param = constraint if constraint is not None else request_constraint(req)
    if plan.constrained_tools:
        if so is not None:
            raise bad_request(f"{so_param} cannot be combined with tool_choice {req.tool_choice!r}: the tool call "
                              "is the output's format.", so_param)
        so, so_param = StructuredOutputsParams(json=plan.tool_schema()), "tools"
    check_lists(req, state.limits)  # cheap refusals before the template renders
    adm.take_sequences(req.n)  # one prompt: n sequences
    text, ids = await chat_prompt(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                                  req.tools, req.chat_template_kwargs)
    reasoning = plan.reasoning()
    if reasoning is not None:
        plan.reasoning_ended = reasoning.ended_in_prompt(await generation_prompt(state, req, text))
        if so is not None and not plan.reasoning_ended:
            # The constraint starts where the reasoning ends.
            so.start_after_token_ids = tuple(reasoning.end_token_ids())
    if so is not None:
        await check_constraint(state, so, so_param)
    params = build_sampling_params(req, [len(ids)], state.limits, so)
    if plan.needs_special_tokens():  # a parser reads markup made of them
        params.skip_special_tokens = False
    return plan, text, ids, params


def _response_json(state: ServerState, req: ChatCompletionRequest, sub: Submission, model: str,
                   plan: ChatPlan) -> str:
    return _response(state, req, sub, model, plan).model_dump_json()


def _response(state: ServerState, req: ChatCompletionRequest, sub: Submission, model: str,
              plan: ChatPlan) -> ChatCompletionResponse:
    decode = token_decoder(state.engine.tokenizer)
    choices = []
    for i, c in enumerate(sub.choices):
        logprobs = chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, decode) if req.logprobs else None
        splitter = plan.splitter()
        reasoning, content, calls = splitter.whole(c.full_text)
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
        choices.append(ChatChoice(index=i, message=message, logprobs=logprobs,
                                  finish_reason=plan.finish_reason(c.finish_reason, bool(calls)),
                                  stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=random_id("chatcmpl"), model=model, choices=choices, usage=sub.usage())


async def _stream(state: ServerState, req: ChatCompletionRequest, sub: Submission, model: str,
                  plan: ChatPlan) -> AsyncIterator[str]:
    decode = token_decoder(state.engine.tokenizer)
    chunk_id, created = random_id("chatcmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    splitters = [plan.splitter() for _ in sub.choices]

    def chunk(choice: ChatStreamChoice) -> str:
        c = ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=[choice])
        return sse(c.model_dump_json(exclude=exclude))

    def parts_chunk(idx: int, parts, logprobs=None) -> str | None:
        if parts.reasoning is None and parts.content is None and not parts.tool_calls and logprobs is None:
            return None
        delta = ChatDelta(content=parts.content, reasoning_content=parts.reasoning, tool_calls=parts.tool_calls or None)
        return chunk(ChatStreamChoice(index=idx, delta=delta, logprobs=logprobs))

    try:
        for i in range(len(sub.choices)):  # OpenAI opens every choice with the role
            yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        while not sub.finished:
            try:
                delta = await sub.next()
            except APIError as e:
                yield error_event(e)
                break
            for s in delta.sequences:
                idx = sub.choice_index(delta, s.index)
                split = splitters[idx]
                if s.text or (req.logprobs and s.token_ids):
                    logprobs = (chat_logprobs(s.token_ids, s.logprobs or [], req.top_logprobs or 0, decode)
                                if req.logprobs else None)
                    out = parts_chunk(idx, split.feed(s.text) if s.text else ChoiceParts(), logprobs)
                    if out is not None:
                        yield out
                if s.finish_reason is not None:
                    out = parts_chunk(idx, split.flush())
                    if out is not None:
                        yield out
                    yield chunk(ChatStreamChoice(index=idx, delta=ChatDelta(),
                                                 finish_reason=plan.finish_reason(s.finish_reason, split.tools_called),
                                                 stop_reason=s.stop_reason))
        else:
            if include_usage:
                c = ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=[], usage=sub.usage())
                yield sse(c.model_dump_json())
        yield DONE
    finally:
        sub.abort()

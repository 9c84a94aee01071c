"""POST /v1/chat/completions: messages through the chat template, streamed or not."""
from __future__ import annotations

import json
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.serve.chat import encode_chat, render_chat
from tokenmill.serve.chat_output import ChatPlan, ChoiceParts, chat_plan
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.generation import (DONE, SSEResponse, Submission, error_event, random_id, sse,
                                        token_decoder)
from tokenmill.serve.logprobs import chat_logprobs
from tokenmill.serve.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatDelta, ChatResponseMessage, ChatStreamChoice)
from tokenmill.serve.sampling import build_sampling_params, check_input_chars, check_lists
from tokenmill.serve.state import LARGE_INPUT, ServerState
from tokenmill.serve.tenants.keys import priority_for, request_slo, slo_for, tenant_of
from tokenmill.serve.tenants.isolation import cache_salt_for
from tokenmill.serve.tenants.limits import admit_sequences, reserve_for, worst_case_tokens
from tokenmill.serve.tenants.usage import mark
from tokenmill.serve.structured import check_constraint, request_constraint


# Characters the chat template adds around each message (role markers): a list of many empty messages is still
# work to render, so it counts towards the slow lane and --max-input-chars.
MESSAGE_OVERHEAD = 16


def message_chars(req) -> int:
    """The text a chat request asks us to render and tokenize: message contents, tool calls and tools."""
    total = 0
    for m in req.messages or ():
        total += MESSAGE_OVERHEAD
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(json.dumps(p.model_dump(exclude_none=True))) for p in m.content)
        if m.tool_calls:
            total += len(json.dumps(m.tool_calls))
    # req: a ChatCompletionRequest, or a TokenizeRequest, which has no tools / chat_template_kwargs
    tools = getattr(req, "tools", None)
    kwargs = getattr(req, "chat_template_kwargs", None)
    return total + (len(json.dumps(tools)) if tools else 0) + (len(json.dumps(kwargs, default=str)) if kwargs else 0)


async def chat_prompt(state: ServerState, req, add_generation_prompt: bool = True,
                      continue_final_message: bool = False) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids (400 when the template rejects the messages)."""
    tok = state.engine.tokenizer
    size = message_chars(req)
    check_input_chars(size, state.limits, "messages")
    try:  # getattr: req is a ChatCompletionRequest, or a TokenizeRequest without tools / chat_template_kwargs
        text = await state.run_blocking(
            render_chat, tok, req.messages, state.settings.chat_template, add_generation_prompt,
            continue_final_message, getattr(req, "tools", None), getattr(req, "chat_template_kwargs", None), size=size)
    except ValueError as e:
        raise bad_request(" ".join(str(e).split()), "messages") from None
    try:
        ids = await state.run_blocking(encode_chat, tok, text, size=len(text))
    except (ValueError, TypeError) as e:  # the tokenizer refuses lone surrogates with a TypeError
        raise bad_request(f"messages could not be tokenized (text that is not valid Unicode?): {e}", "messages") \
            from None
    if not ids:
        raise bad_request("messages rendered to an empty prompt.", "messages")
    return text, ids


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
    tenant = tenant_of(raw.scope)
    model, lora = state.resolve_model(req.model, tenant, raw.scope)
    try:
        slo = slo_for(tenant, request_slo(req.slo, state.settings.min_slo_ttft_ms))
    except ValueError as e:
        raise bad_request(str(e), "slo") from None
    tok = state.engine.tokenizer
    plan = chat_plan(req, state.settings, tok)
    so, so_param = request_constraint(req)
    if plan.constrained_tools:
        if so is not None:
            raise bad_request(f"{so_param} cannot be combined with tool_choice {req.tool_choice!r}: the tool call "
                              "is the output's format.", so_param)
        so, so_param = StructuredOutputsParams(json=plan.tool_schema()), "tools"
    check_lists(req, state.limits)  # cheap refusals before the template renders
    admit_sequences(raw.scope, state.limiter, tenant, req.n)  # limits count sequences: n of them
    text, ids = await chat_prompt(state, req, req.add_generation_prompt, req.continue_final_message)
    reasoning = plan.reasoning()
    if reasoning is not None:
        plan.reasoning_ended = reasoning.ended_in_prompt(await generation_prompt(state, req, text))
        if so is not None and not plan.reasoning_ended:
            # The constraint starts where the reasoning ends.
            so.start_after_token_ids = tuple(reasoning.end_token_ids())
    if so is not None:
        await check_constraint(state, so, so_param)
    params = build_sampling_params(req, [len(ids)], state.limits, so)
    state.check_capacity()
    sub = Submission(state.engine, [ids], [text], [params], priority_for(tenant, req.priority), arrival_time, lora,
                     slo, cache_salt_for(tenant, req.cache_salt))
    reserve_for(raw.scope, state.limiter, tenant, worst_case_tokens([ids], [params], state.engine.max_model_len),
                lambda: sub.usage().total_tokens)
    await sub.start()
    mark(raw.scope, model, sub)  # metered from here (a request refused before it ran carries no tokens)
    if req.stream:
        return SSEResponse(_stream(state, req, sub, model, plan))
    await sub.run_to_end(raw)
    # Many logprobs (n x max_tokens x top_logprobs) are built in the slow lane, off the event loop.
    size = sum(len(c.token_ids) for c in sub.choices) * ((req.top_logprobs or 0) + 1) if req.logprobs else 0
    return Response(await state.run_blocking(_response_json, state, req, sub, model, plan, size=size)
                    if size > LARGE_INPUT else _response_json(state, req, sub, model, plan),
                    media_type="application/json")


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

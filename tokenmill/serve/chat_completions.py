"""POST /v1/chat/completions: messages through the chat template, streamed or not."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.serve.chat import encode_chat, render_chat
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.generation import (DONE, SSEResponse, Submission, error_event, random_id, sse,
                                        token_decoder)
from tokenmill.serve.logprobs import chat_logprobs
from tokenmill.serve.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatDelta, ChatResponseMessage, ChatStreamChoice)
from tokenmill.serve.sampling import build_sampling_params
from tokenmill.serve.state import ServerState


async def chat_prompt(state: ServerState, req, add_generation_prompt: bool = True,
                      continue_final_message: bool = False) -> tuple[str, list[int]]:
    """The rendered conversation and its token ids (400 when the template rejects the messages)."""
    tok = state.engine.tokenizer
    try:
        text = await state.run_blocking(
            render_chat, tok, req.messages, state.settings.chat_template, add_generation_prompt,
            continue_final_message, getattr(req, "tools", None), getattr(req, "chat_template_kwargs", None))
        ids = await state.run_blocking(encode_chat, tok, text)
    except ValueError as e:  # includes UnicodeError from lone surrogates
        raise bad_request(" ".join(str(e).split()), "messages") from None
    if not ids:
        raise bad_request("messages rendered to an empty prompt.", "messages")
    return text, ids


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request,
                                 arrival_time: float | None = None):
    model = state.check_model(req.model)
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(f"response_format type {req.response_format.type!r} is not supported yet.",
                          "response_format")
    text, ids = await chat_prompt(state, req, req.add_generation_prompt, req.continue_final_message)
    params = build_sampling_params(req, len(ids), state.limits)
    state.check_capacity()
    sub = Submission(state.engine, [ids], [text], [params], req.priority, arrival_time)
    sub.start()
    if req.stream:
        return SSEResponse(_stream(state, req, sub, model))
    await sub.run_to_end(raw)
    return Response(_response(state, req, sub, model).model_dump_json(), media_type="application/json")


def _response(state: ServerState, req: ChatCompletionRequest, sub: Submission, model: str) -> ChatCompletionResponse:
    decode = token_decoder(state.engine.tokenizer)
    choices = []
    for i, c in enumerate(sub.choices):
        logprobs = chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, decode) if req.logprobs else None
        choices.append(ChatChoice(index=i, message=ChatResponseMessage(content=c.full_text), logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=random_id("chatcmpl"), model=model, choices=choices, usage=sub.usage())


async def _stream(state: ServerState, req: ChatCompletionRequest, sub: Submission, model: str) -> AsyncIterator[str]:
    decode = token_decoder(state.engine.tokenizer)
    chunk_id, created = random_id("chatcmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}

    def chunk(choice: ChatStreamChoice) -> str:
        c = ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=[choice])
        return sse(c.model_dump_json(exclude=exclude))

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
                if s.text or (req.logprobs and s.token_ids):
                    logprobs = (chat_logprobs(s.token_ids, s.logprobs or [], req.top_logprobs or 0, decode)
                                if req.logprobs else None)
                    yield chunk(ChatStreamChoice(index=idx, delta=ChatDelta(content=s.text), logprobs=logprobs))
                if s.finish_reason is not None:
                    yield chunk(ChatStreamChoice(index=idx, delta=ChatDelta(), finish_reason=s.finish_reason,
                                                 stop_reason=s.stop_reason))
        else:
            if include_usage:
                c = ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=[], usage=sub.usage())
                yield sse(c.model_dump_json())
        yield DONE
    finally:
        sub.abort()

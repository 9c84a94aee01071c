"""POST /v1/completions: prompts as text or token ids, streamed or not."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.generation import (DONE, SSEResponse, Submission, error_event, random_id, sse,
                                        token_decoder)
from tokenmill.serve.logprobs import completion_logprobs
from tokenmill.serve.protocol import CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse
from tokenmill.serve.sampling import (build_sampling_params, check_input_chars, check_prompt_ids,
                                     check_request_budget)
from tokenmill.serve.state import ServerState
from tokenmill.serve.structured import check_constraint, request_constraint


async def _prompts(state: ServerState, prompt) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and text of each prompt; a batch is a list of strings or a list of token-id lists."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", "prompt")
    ids, texts = [], []
    limits = state.limits
    check_input_chars(sum(len(p) for p in prompt if isinstance(p, str)), limits, "prompt")
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty.", "prompt")
            try:
                ids.append(await state.tokenize(p))
            except Exception as e:  # e.g. lone surrogates that are not valid Unicode text
                raise bad_request(f"prompt could not be tokenized: {e}", "prompt") from None
            texts.append(p)
        else:
            check_prompt_ids(p, limits, "prompt")
            ids.append(list(p))
            texts.append(None)
    return ids, texts


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request,
                            arrival_time: float | None = None):
    model = state.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (beam-like best_of sampling is not supported).", "best_of")
    so, so_param = request_constraint(req)
    if so is not None:
        await check_constraint(state, so, so_param)
    prompt_ids, texts = await _prompts(state, req.prompt)
    params = [build_sampling_params(req, len(ids), state.limits, so) for ids in prompt_ids]
    check_request_budget([len(ids) for ids in prompt_ids], params, state.limits)
    if req.echo:  # echo needs the prompt as text, also when it came as token ids
        texts = [t if t is not None else await state.detokenize(ids) for t, ids in zip(texts, prompt_ids)]
    state.check_capacity()
    sub = Submission(state.engine, prompt_ids, texts, params, req.priority, arrival_time)
    sub.start()
    if req.stream:
        return SSEResponse(_stream(state, req, sub, model))
    await sub.run_to_end(raw)
    return Response(_response(state, req, sub, model).model_dump_json(), media_type="application/json")


def _prompt_positions(prompt) -> list:
    lps = prompt.prompt_logprobs or []
    return list(lps) + [None] * (len(prompt.token_ids) - len(lps))


def _response(state: ServerState, req: CompletionRequest, sub: Submission, model: str) -> CompletionResponse:
    decode = token_decoder(state.engine.tokenizer)
    choices = []
    for p, prompt in enumerate(sub.prompts):
        for i in range(sub.n):
            c = sub.choices[p * sub.n + i]
            text = c.full_text
            logprobs = None
            if req.logprobs is not None:
                ids, positions = c.token_ids, c.logprobs
                if req.echo:
                    ids, positions = prompt.token_ids + ids, _prompt_positions(prompt) + positions
                logprobs = completion_logprobs(ids, positions, 0, decode)
            if req.echo:
                text = (prompt.text or "") + text
            choices.append(CompletionChoice(index=p * sub.n + i, text=text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=random_id("cmpl"), model=model, choices=choices, usage=sub.usage())


async def _stream(state: ServerState, req: CompletionRequest, sub: Submission, model: str) -> AsyncIterator[str]:
    decode = token_decoder(state.engine.tokenizer)
    chunk_id, created = random_id("cmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    started = [False] * len(sub.choices)
    offsets = [0] * len(sub.choices)  # characters of token text sent per choice, for text_offset
    try:
        while not sub.finished:
            try:
                delta = await sub.next()
            except APIError as e:
                yield error_event(e)
                break
            for s in delta.sequences:
                idx = sub.choice_index(delta, s.index)
                text, ids, positions = s.text, s.token_ids, list(s.logprobs or [])
                if req.echo and not started[idx]:
                    prompt = sub.prompts[delta.tag]
                    text = (prompt.text or "") + text
                    ids, positions = prompt.token_ids + ids, _prompt_positions(prompt) + positions
                started[idx] = True
                if not text and s.finish_reason is None and (req.logprobs is None or not ids):
                    continue  # text held back (partial character or stop string) and nothing else to say
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(ids, positions, offsets[idx], decode)
                    if logprobs.tokens:
                        offsets[idx] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                choice = CompletionChoice(index=idx, text=text, logprobs=logprobs, finish_reason=s.finish_reason,
                                          stop_reason=s.stop_reason)
                chunk = CompletionChunk(id=chunk_id, created=created, model=model, choices=[choice])
                yield sse(chunk.model_dump_json(exclude=exclude))
        else:
            if include_usage:
                chunk = CompletionChunk(id=chunk_id, created=created, model=model, choices=[], usage=sub.usage())
                yield sse(chunk.model_dump_json())
        yield DONE
    finally:
        sub.abort()

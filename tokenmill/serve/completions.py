"""POST /v1/completions: prompts as text or token ids, streamed or not."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tokenmill.sampling_params import SamplingParams
from tokenmill.serve.admission import admit
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.generation import (DONE, SSEResponse, Submission, error_event, random_id, sse,
                                        token_decoder)
from tokenmill.serve.logprobs import completion_logprobs
from tokenmill.serve.protocol import CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse
from tokenmill.serve.sampling import (build_sampling_params, check_count, check_input_chars, check_lists,
                                     check_prompt_ids)
from tokenmill.serve.state import LARGE_INPUT, ServerState
from tokenmill.serve.structured import check_constraint, request_constraint


@dataclass
class _Prepared:
    """A completions request made ready for the engine: every prompt's ids and text, and the one SamplingParams
    they all share."""

    ids: list[list[int]]
    texts: list[str | None]
    params: SamplingParams


def _prompt_list(prompt) -> list:
    """A batch is a list of strings or a list of token-id lists; one prompt is a string or one id list."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return prompt


def _request_size(prompts: list, req: CompletionRequest) -> int:
    """About how much per-prompt work the request carries (characters or ids): picks the worker lane."""
    text = sum(len(p) if isinstance(p, str) else 4 * len(p) for p in prompts)
    return text + len(prompts) * (len(req.logit_bias or ()) + len(req.stop_token_ids or ()))


def _prepare(state: ServerState, req: CompletionRequest, prompts: list, so) -> _Prepared:
    """Tokenize and check every prompt, then build the request's SamplingParams once. Runs in a worker thread
    (the slow lane for a large batch), so a list of many prompts never holds the event loop."""
    tok = state.engine.tokenizer
    limits = state.limits
    ids, texts = [], []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty.", "prompt")
            try:
                ids.append(tok(p, add_special_tokens=True).input_ids)
            except Exception as e:  # whatever else the tokenizer refuses
                raise bad_request(f"prompt could not be tokenized: {e}", "prompt") from None
            texts.append(p)
        else:
            check_prompt_ids(p, limits, "prompt")
            ids.append(list(p))
            texts.append(None)
    params = build_sampling_params(req, [len(i) for i in ids], limits, so)
    if req.echo:  # echo needs the prompt as text, also when it came as token ids
        texts = [t if t is not None else tok.decode(i) for t, i in zip(texts, ids)]
    return _Prepared(ids, texts, params)


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request,
                            arrival_time: float | None = None):
    adm = admit(state, raw, model=req.model, slo=req.slo, priority=req.priority, cache_salt=req.cache_salt,
                arrival_time=arrival_time)
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (beam-like best_of sampling is not supported).", "best_of")
    prompts = _prompt_list(req.prompt)
    if not prompts:
        raise bad_request("prompt must not be empty.", "prompt")
    limits = state.limits
    # The cheap refusals first, before any prompt is read.
    check_count(len(prompts), limits.max_prompts, "prompt", "--max-prompts", "prompts")
    check_input_chars(sum(len(p) for p in prompts if isinstance(p, str)), limits, "prompt")
    check_lists(req, limits)
    adm.take_sequences(len(prompts) * req.n)  # every prompt x n, refused before any prompt is read
    so, so_param = request_constraint(req)
    if so is not None:
        await check_constraint(state, so, so_param)
    ready = await state.run_blocking(_prepare, state, req, prompts, so, size=_request_size(prompts, req))
    sub = await adm.submit(ready.ids, ready.texts, [ready.params] * len(ready.ids))
    model = adm.model
    if req.stream:
        return SSEResponse(_stream(state, req, sub, model))
    await sub.run_to_end(raw)
    size = _logprob_entries(req, sub)
    if size > LARGE_INPUT:  # many logprobs (echo of a long prompt): built in the slow lane, off the event loop
        return Response(await state.run_blocking(_response_json, state, req, sub, model, size=size),
                        media_type="application/json")
    return Response(_response_json(state, req, sub, model), media_type="application/json")


def _logprob_entries(req: CompletionRequest, sub: Submission) -> int:
    """How many logprob entries the answer holds (0 without logprobs): what building it costs."""
    if req.logprobs is None:
        return 0
    positions = sum(len(c.token_ids) for c in sub.choices)
    if req.echo:
        positions += sub.n * sum(len(p.token_ids) for p in sub.prompts)
    return positions * (req.logprobs + 1)


def _prompt_positions(prompt) -> list:
    lps = prompt.prompt_logprobs or []
    return list(lps) + [None] * (len(prompt.token_ids) - len(lps))


def _response_json(state: ServerState, req: CompletionRequest, sub: Submission, model: str) -> str:
    return _response(state, req, sub, model).model_dump_json()


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
                choice = CompletionChoice(index=idx, text=text, finish_reason=s.finish_reason,
                                          stop_reason=s.stop_reason)
                chunk = CompletionChunk(id=chunk_id, created=created, model=model, choices=[choice])
                size = len(ids) * (req.logprobs + 1) if req.logprobs is not None else 0
                if size > LARGE_INPUT:  # an echoed long prompt's logprobs: built off the event loop
                    payload, offsets[idx] = await state.run_blocking(
                        _chunk_json, chunk, req, ids, positions, offsets[idx], decode, exclude, size=size)
                else:
                    payload, offsets[idx] = _chunk_json(chunk, req, ids, positions, offsets[idx], decode, exclude)
                yield sse(payload)
        else:
            if include_usage:
                chunk = CompletionChunk(id=chunk_id, created=created, model=model, choices=[], usage=sub.usage())
                yield sse(chunk.model_dump_json())
        yield DONE
    finally:
        sub.abort()


def _chunk_json(chunk: CompletionChunk, req: CompletionRequest, ids: list[int], positions: list, offset: int,
                decode, exclude) -> tuple[str, int]:
    """The chunk's JSON with its choice's logprobs filled in, and the choice's text offset after it."""
    if req.logprobs is not None:
        logprobs = completion_logprobs(ids, positions, offset, decode)
        if logprobs.tokens:
            offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        chunk.choices[0].logprobs = logprobs
    return chunk.model_dump_json(exclude=exclude), offset

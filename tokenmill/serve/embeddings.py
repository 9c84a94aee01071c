"""POST /v1/embeddings: OpenAI's embeddings, from the engine that generates.

Each input becomes one engine request whose params carry PoolingParams: it runs through the same scheduler as a
prompt (chunked prefill and all) and ends after its last prompt chunk with the pooled final hidden state (the
server's --pooling: last token or mean), truncated to `dimensions` and L2-normalised by the output processor. It
is admitted like a completion (serve/admission.py: tenant, model, sequence slots, capacity, token reservation,
metering), and its usage counts prompt tokens only.
"""
from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.serve.admission import admit
from tokenmill.serve.errors import bad_request
from tokenmill.serve.generation import Submission
from tokenmill.serve.protocol import Bool, Int, SLOField, TokenIds, _Request
from tokenmill.serve.sampling import check_count, check_input_chars, check_prompt_ids
from tokenmill.serve.state import LARGE_INPUT, ServerState


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None  # Matryoshka truncation: the first `dimensions` values, renormalised
    user: str | None = None
    # extensions (vLLM's, tokenmill's)
    normalize: Bool = True  # False: the pooled hidden state as it is (truncated to dimensions, if given)
    priority: Int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    slo: SLOField | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def _input_list(value) -> list:
    """A batch is a list of strings or a list of token-id lists; one input is a string or one id list."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return value


def _tokenize(state: ServerState, inputs: list) -> tuple[list[list[int]], list[str | None]]:
    """Every input's token ids (and text), each within max_model_len, all within --max-request-tokens. Runs in a
    worker thread (the slow lane for a large batch)."""
    tok = state.engine.tokenizer
    limits = state.limits
    ids, texts, total = [], [], 0
    for i, p in enumerate(inputs):
        if isinstance(p, str):
            if not p:
                raise bad_request(f"input {i} must not be empty.", "input")
            try:
                one = tok(p, add_special_tokens=True).input_ids
            except Exception as e:  # whatever else the tokenizer refuses
                raise bad_request(f"input {i} could not be tokenized: {e}", "input") from None
            texts.append(p)
        else:
            check_prompt_ids(p, limits, "input")
            one = list(p)
            texts.append(None)
        if len(one) > limits.max_model_len:
            raise bad_request(f"input {i} is {len(one)} tokens, but this server embeds at most max_model_len "
                              f"{limits.max_model_len} tokens per input.", "input")
        total += len(one)
        if total > limits.max_request_tokens:
            raise bad_request(f"the inputs hold more than {limits.max_request_tokens} tokens; this server embeds at "
                              "most that many per request (--max-request-tokens).", "input")
        ids.append(one)
    return ids, texts


def _pooling(state: ServerState, req: EmbeddingRequest) -> PoolingParams:
    hidden = state.engine.facts.hidden_size
    if req.dimensions is not None and req.dimensions < 1:
        raise bad_request(f"dimensions must be at least 1, got {req.dimensions}.", "dimensions")
    if req.dimensions is not None and hidden and req.dimensions > hidden:
        raise bad_request(f"dimensions must be at most the model's hidden size {hidden}, got {req.dimensions}.",
                          "dimensions")
    return PoolingParams(normalize=req.normalize, dimensions=req.dimensions)


async def create_embedding(state: ServerState, req: EmbeddingRequest, raw: Request, arrival_time: float | None = None):
    adm = admit(state, raw, model=req.model, slo=req.slo, priority=req.priority, cache_salt=req.cache_salt,
                arrival_time=arrival_time)
    inputs = _input_list(req.input)
    if not inputs:
        raise bad_request("input must not be empty.", "input")
    limits = state.limits
    # The cheap refusals first, before any input is read.
    check_count(len(inputs), limits.max_prompts, "input", "--max-prompts", "inputs")
    check_input_chars(sum(len(p) for p in inputs if isinstance(p, str)), limits, "input")
    if sum(len(p) for p in inputs if not isinstance(p, str)) > limits.max_request_tokens:
        raise bad_request(f"the inputs hold more than {limits.max_request_tokens} token ids; this server embeds at "
                          "most that many per request (--max-request-tokens).", "input")
    params = SamplingParams(max_tokens=1, pooling=_pooling(state, req))
    adm.take_sequences(len(inputs))  # one sequence per input, refused before any input is read
    size = sum(len(p) if isinstance(p, str) else 4 * len(p) for p in inputs)
    ids, texts = await state.run_blocking(_tokenize, state, inputs, size=size)
    sub = await adm.submit(ids, texts, [params] * len(ids))
    await sub.run_to_end(raw)
    floats = sum(len(p.embedding or ()) for p in sub.prompts)
    if floats > LARGE_INPUT:  # a large batch's JSON is built in the slow lane, off the event loop
        body = await state.run_blocking(_response_json, req, sub, adm.model, size=floats)
    else:
        body = _response_json(req, sub, adm.model)
    return Response(body, media_type="application/json")


def _response_json(req: EmbeddingRequest, sub: Submission, model: str) -> str:
    data = []
    for i, p in enumerate(sub.prompts):
        if p.embedding is None:  # (an engine error raised in run_to_end; this is a bug if reached)
            raise RuntimeError(f"input {i} finished without an embedding")
        value = p.embedding
        if req.encoding_format == "base64":  # OpenAI's: the float32 values, little-endian, base64-encoded
            value = base64.b64encode(np.asarray(value, dtype="<f4").tobytes()).decode("ascii")
        data.append(Embedding(index=i, embedding=value))
    usage = sub.usage()
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(
        prompt_tokens=usage.prompt_tokens, total_tokens=usage.prompt_tokens)).model_dump_json()

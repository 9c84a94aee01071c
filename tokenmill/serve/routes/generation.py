"""Generation routes: completions, chat completions, and the tokenizer's /tokenize and /detokenize."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request

from tokenmill.serve.body import parse_body
from tokenmill.serve.chat_completions import create_chat_completion
from tokenmill.serve.chat_prompt import chat_prompt
from tokenmill.serve.completions import create_completion
from tokenmill.serve.errors import bad_request
from tokenmill.serve.openapi import request_body
from tokenmill.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      DetokenizeResponse, TokenizeRequest, TokenizeResponse)
from tokenmill.serve.sampling import check_input_chars, check_prompt_ids
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import tenant_of


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(raw: Request):
        arrival = time.monotonic()  # before the body is parsed and the prompt tokenized: both are latency
        return await create_completion(state, await parse_body(raw, CompletionRequest), raw, arrival)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(raw: Request):
        arrival = time.monotonic()
        return await create_chat_completion(state, await parse_body(raw, ChatCompletionRequest), raw, arrival)

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(raw: Request):
        req = await parse_body(raw, TokenizeRequest)
        state.check_model(req.model, tenant_of(raw.scope))
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages.", "prompt")
        if req.messages is not None:
            _, ids = await chat_prompt(state, req.messages, req.add_generation_prompt)
        else:
            check_input_chars(len(req.prompt), state.limits, "prompt")
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            try:
                ids = await state.tokenize(req.prompt, add_special)
            except Exception as e:
                raise bad_request(f"prompt could not be tokenized: {e}", "prompt") from None
        strs = None
        if req.return_token_strs:
            strs = await state.run_blocking(state.engine.tokenizer.convert_ids_to_tokens, ids, size=len(ids) * 4)
        return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(raw: Request):
        req = await parse_body(raw, DetokenizeRequest)
        state.check_model(req.model, tenant_of(raw.scope))
        if req.tokens:
            limits = state.limits
            if len(req.tokens) > limits.max_request_tokens:
                raise bad_request(f"tokens holds {len(req.tokens)} ids; this server detokenizes at most "
                                  f"{limits.max_request_tokens} (--max-request-tokens).", "tokens")
            check_prompt_ids(req.tokens, limits, "tokens")
        return DetokenizeResponse(prompt=await state.detokenize(req.tokens))

"""The FastAPI app: OpenAI-compatible routes over an AsyncLLMEngine, errors always in OpenAI's shape."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.engine.output import EngineError
from tokenmill.structured_output.checker import checker_status
from tokenmill.serve.chat_completions import chat_prompt, create_chat_completion
from tokenmill.serve.completions import create_completion
from tokenmill.serve.errors import APIError, BodyTimeout, BodyTooLarge, bad_request
from tokenmill.serve.metrics import CONTENT_TYPE
from tokenmill.serve.middleware import GuardMiddleware, too_large
from tokenmill.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      LoadLoRAAdapterRequest, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
                                      DetokenizeResponse, UnloadLoRAAdapterRequest)
from tokenmill.serve.sampling import check_input_chars, check_prompt_ids
from tokenmill.lora.request import LoRARequest
from tokenmill.serve.lora import UNLOADABLE, resolve_in_root
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import reload_keys, reload_on_sighup, tenant_of
from tokenmill.serve.tenants.usage import aread_usage, rows_to_csv

log = logging.getLogger(__name__)
T = TypeVar("T", bound=BaseModel)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


LARGE_BODY = 1 << 16  # bytes: larger bodies are parsed in the slow lane


async def parse_body(raw: Request, model: type[T]) -> T:
    """JSON that does not parse, text that is not valid Unicode and JSON of the wrong shape are 400s, the
    last two naming the field."""
    body = await raw.body()
    if len(body) > LARGE_BODY:  # parsed in the slow lane, so the event loop keeps streaming others' tokens
        return await raw.app.state.tokenmill.run_blocking(_parse, body, model, size=len(body))
    return _parse(body, model)


def _parse(body: bytes, model: type[T]) -> T:
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", None, "invalid_json")
    if _MAY_HOLD_SURROGATES.search(body):
        check_unicode(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


# JSON spells a lone surrogate as an escape (\ud800..\udfff), or as its UTF-8-style bytes, which json.loads decodes
# with "surrogatepass". Bodies with neither (nearly all) skip the walk below.
_MAY_HOLD_SURROGATES = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")


def check_unicode(data: Any) -> None:
    """Every string of parsed JSON (keys too) must be encodable as UTF-8: a lone surrogate would otherwise fail
    later, in the tokenizer or while writing the answer (a 500 on `model`). One walk here covers every route
    and field; iterative, as the nesting may be deep."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path + (key,))
                if isinstance(item, (str, dict, list)):
                    stack.append((path + (key,), item))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (str, dict, list)):
                    stack.append((path + (i,), item))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = ".".join(str(p).encode("utf-8", "backslashreplace").decode() for p in path) or None
        raise bad_request(f"{param or 'The request'} contains text that is not valid Unicode: a lone surrogate "
                          f"U+{ord(text[e.start]):04X} at character {e.start}.", param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}
# What a pydantic type error expected, in OpenAI's words ("Invalid type for 'n': expected an integer, ...").
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object"}


def _field_path(loc) -> str:
    """`messages.0.role` from a pydantic location, without the union-member tags ('str', 'list[int]')."""
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(p for p in parts if p not in _TYPE_TAGS and "[" not in p)


def _json_kind(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a decimal number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _message(loc: str, errs: list[dict]) -> str:
    expected = [_EXPECTED.get(e.get("type")) for e in errs]
    if loc and all(expected):
        wanted = " or ".join(dict.fromkeys(expected))
        return f"Invalid type for '{loc}': expected {wanted}, but got {_json_kind(errs[0].get('input'))} instead"
    msg = str(errs[0].get("msg"))
    return f"{loc}: {msg}" if loc else msg


def validation_error(errors) -> APIError:
    """A 400 (as OpenAI and vLLM answer a wrong type) whose `param` is the first bad field's path."""
    by_loc: dict[str, list[dict]] = {}
    for err in errors:
        by_loc.setdefault(_field_path(err.get("loc", ())), []).append(err)
    parts = [_message(loc, errs) for loc, errs in list(by_loc.items())[:5]]
    param = next(iter(by_loc), None) or None
    return APIError(400, "; ".join(parts) + "." if parts else "Invalid request.", param, "invalid_type")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        if state.keys is not None:
            reload_on_sighup(state.keys)
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)
        state.shutdown()

    register_lora_modules(state)
    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.tokenmill = state
    _add_error_handlers(app)
    _add_routes(app, state)
    settings = state.settings
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_request_body_bytes,
                       protect_metrics=settings.protect_metrics, body_timeout_s=settings.request_body_timeout_s,
                       keys=state.keys, admin_key=settings.admin_key, limiter=state.limiter, usage=state.usage,
                       counters=state.metrics.tenants, internal_key=settings.internal_api_key)
    return app


def register_lora_modules(state: ServerState) -> None:
    """--lora-modules: each adapter read and checked against the model before the server listens (a bad one stops
    the start with the file and the reason)."""
    for name, path in state.settings.lora_modules:
        if state.loras.get(name) is not None:
            continue  # this state was built into an app before
        lora = state.loras.new(name, path)
        try:
            state.engine.check_lora(lora)
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from None
        state.loras.add(lora)
        log.info("LoRA adapter %s: %s", name, path)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge):
        return too_large(app.state.tokenmill.settings.max_request_body_bytes).response()

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, e: BodyTimeout):
        limit = app.state.tokenmill.settings.request_body_timeout_s
        return APIError(408, f"The request body did not arrive within {limit:g} s.", None, "request_timeout",
                        headers={"Connection": "close"}).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}. Please check the URL for typos."
            return APIError(404, message, None, "unknown_url").response()
        if e.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}."
            return APIError(405, message, None, "method_not_allowed").response()
        return APIError(e.status_code, str(e.detail), None, None).response()

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError):  # engine.call: e.g. 503 engine_dead
        return APIError(e.status, e.message, None, e.code,
                        headers={"Retry-After": "1"} if e.status == 503 else None).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"Internal server error: {type(e).__name__}", None, "internal_error").response()


def _add_routes(app: FastAPI, state: ServerState) -> None:
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(raw: Request):
        arrival = time.monotonic()  # before the body is parsed and the prompt tokenized: both are latency
        return await create_completion(state, await parse_body(raw, CompletionRequest), raw, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        arrival = time.monotonic()
        return await create_chat_completion(state, await parse_body(raw, ChatCompletionRequest), raw, arrival)

    def card(name: str, adapter: bool = False) -> ModelCard:
        # root is a served name, never a filesystem path (which says where the server keeps its files); an
        # adapter's parent is the base model, as vLLM lists them.
        return ModelCard(id=name, created=created, root=name if adapter else state.model_name,
                         parent=state.model_name if adapter else None, max_model_len=state.engine.max_model_len)

    @app.get("/v1/models")
    async def models(raw: Request):
        adapters = set(state.loras.names())
        return ModelList(data=[card(n, adapter=n in adapters) for n in state.visible_models(tenant_of(raw.scope))])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, raw: Request):
        name, lora = state.resolve_model(model_id, tenant_of(raw.scope))
        # An alias (the MODEL argument as given) is accepted but never echoed: the card names the served model.
        if lora is not None:
            return card(name, adapter=True)
        return card(model_id if model_id in state.settings.served_model_names else state.model_name)

    if state.settings.allow_runtime_lora_updating:
        _add_lora_routes(app, state)

    @app.get("/v1/usage")
    async def usage(raw: Request, tenant: str | None = None, start: str | None = Query(None, alias="from"),
                    to: str | None = None, group_by: str = "tenant,model", format: str = "json"):
        """Metered usage (--usage-db). The admin sees every tenant; a tenant's key sees its own only."""
        if state.usage is None:
            raise APIError(404, "This server keeps no usage (start it with --usage-db).", None, "not_found")
        # Its own reader thread and connection (never the tokenizer's thread), rate-limited per caller.
        rows = await aread_usage(state.usage, raw.scope, tenant, start, to, group_by)
        if format == "csv":
            return Response(rows_to_csv(rows), media_type="text/csv")
        return {"object": "list", "data": rows}

    @app.post("/admin/reload")
    async def admin_reload():
        """Re-read --api-keys-file (the admin key only: the middleware checks it)."""
        if state.keys is None:
            raise APIError(404, "This server has no --api-keys-file to reload.", None, "not_found")
        try:
            return {"tenants": await state.run_blocking(reload_keys, state.keys)}
        except ValueError as e:
            raise bad_request(f"the keys file was not reloaded, the old keys stay: {e}", None) from None

    @app.get("/health")
    async def health():
        if not state.engine.is_alive:
            return APIError(503, "The engine is not running.", None, "engine_dead").response()
        if state.engine.draining:
            return APIError(503, "The server is shutting down.", None, "shutting_down").response()
        # Still 200 while the grammar checker restarts: only grammar requests are refused (503) meanwhile.
        return {"status": "ok", "grammar_worker": checker_status().state}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/diagnostics")
    async def diagnostics(last_n: int | None = None):
        """Where the time went over the recent steps, against this machine's measured peaks."""
        return await state.engine.call("diagnostics", last_n)

    @app.get("/v1/kv_events")
    async def kv_events(since: int = 0):
        """Prefix-cache blocks stored/removed after event `since`: for a cache-aware router (tokenmill router)."""
        return await state.engine.call("kv_events", since)

    @app.post("/v1/kv_blocks")
    async def kv_blocks(raw: Request):
        """A KV producer's blocks for a decode instance on another node (TCPConnector): the leading blocks of
        the given hash chain that this instance wrote, length-prefixed."""
        from tokenmill.core.kv_connector import read_blocks

        if state.settings.kv_store is None:
            return APIError(404, "this server is not a KV producer (--kv-transfer-config kv_role).", None,
                            "not_found").response()
        try:
            body = json.loads(await raw.body())
            hashes = body["hashes"]
            if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise bad_request("give {\"hashes\": [hex, ...]}.", "hashes") from None
        data = await state.run_blocking(read_blocks, state.settings.kv_store, hashes)
        return Response(data, media_type="application/octet-stream")

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req = await parse_body(raw, TokenizeRequest)
        state.check_model(req.model, tenant_of(raw.scope))
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages.", "prompt")
        if req.messages is not None:
            _, ids = await chat_prompt(state, req, req.add_generation_prompt)
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

    @app.post("/detokenize")
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

    @app.get("/", include_in_schema=False)
    async def root():
        return JSONResponse({"name": "tokenmill", "version": __version__, "models": state.settings.served_model_names})


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's runtime adapter routes (--allow-runtime-lora-updating): the admin key only (serve/roles.py), paths
    inside --lora-root, at most --max-loaded-loras."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        req = await parse_body(raw, LoadLoRAAdapterRequest)
        try:
            lora = state.loras.new(req.lora_name, "-")  # the name first: taken, in use, or no room
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        loop = asyncio.get_running_loop()
        try:
            # The files are read on their own thread, never the tokenizer's; whatever goes wrong is one answer.
            path = resolve_in_root(state.settings.lora_root, req.lora_path)
            lora = LoRARequest(lora.lora_name, lora.lora_int_id, path)
            await loop.run_in_executor(state.lora_executor, state.engine.check_lora, lora)
        except Exception as e:
            log.warning("LoRA adapter %s not loaded from %r: %s", req.lora_name, req.lora_path, e)
            raise bad_request(UNLOADABLE, "lora_path") from None
        try:
            state.loras.add(lora)
        except ValueError as e:  # another load took the name or the last place meanwhile
            raise bad_request(str(e), "lora_name") from None
        log.info("LoRA adapter %s loaded from %s", req.lora_name, lora.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        req = await parse_body(raw, UnloadLoRAAdapterRequest)
        lora = state.loras.remove(req.lora_name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name",
                           "model_not_found")
        state.engine.forget_lora(lora)  # requests already running with it finish with it
        log.info("LoRA adapter %s unloaded", req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

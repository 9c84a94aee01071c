"""Models and adapters: /v1/models, a model's card, the --lora-modules read at start and vLLM's runtime adapter
routes."""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.lora.request import LoRARequest
from tokenmill.serve.body import parse_body
from tokenmill.serve.openapi import request_body
from tokenmill.serve.errors import APIError, bad_request
from tokenmill.serve.lora import UNLOADABLE, resolve_in_root
from tokenmill.serve.protocol import LoadLoRAAdapterRequest, ModelCard, ModelList, UnloadLoRAAdapterRequest
from tokenmill.serve.state import ServerState
from tokenmill.serve.tenants.keys import tenant_of

log = logging.getLogger(__name__)


def add_model_routes(app: FastAPI, state: ServerState) -> None:
    created = int(time.time())

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


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's runtime adapter routes (--allow-runtime-lora-updating): the admin key only (serve/roles.py), paths
    inside --lora-root, at most --max-loaded-loras."""

    @app.post("/v1/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterRequest))
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

    @app.post("/v1/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(raw: Request):
        req = await parse_body(raw, UnloadLoRAAdapterRequest)
        lora = state.loras.remove(req.lora_name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name",
                           "model_not_found")
        state.engine.forget_lora(lora)  # requests already running with it finish with it
        log.info("LoRA adapter %s unloaded", req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

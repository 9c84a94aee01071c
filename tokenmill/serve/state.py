"""What every route handler needs: the async engine, the settings, metrics, and a tokenizer thread."""
from __future__ import annotations

import asyncio
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.serve.errors import APIError
from tokenmill.serve.lora import LoRARegistry
from tokenmill.serve.middleware import on_response_done
from tokenmill.serve.tenants.keys import KeyStore, Tenant
from tokenmill.serve.tenants.limits import TenantLimiter
from tokenmill.serve.tenants.usage import UsageStore, load_pricing
from tokenmill.serve.metrics import ServerMetrics
from tokenmill.serve.sampling import Limits

MiB = 1 << 20


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str = ""  # for the log only: /v1/models never shows it
    # Other names a request's `model` may use, never listed: the MODEL argument as given (a path), which older
    # clients send since it used to be the default served name.
    model_aliases: list[str] = field(default_factory=list)
    kv_store: str | None = None  # a KV producer's block folder, served at POST /v1/kv_blocks
    api_key: str | None = None
    chat_template: str | None = None
    max_waiting_requests: int | None = None  # None: no limit
    max_request_body_bytes: int = 4 * MiB
    drain_timeout_s: float = 30.0
    max_logprobs: int = 20
    # Per-request limits (serve/sampling.py Limits; 0: derived from max_model_len).
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_request_tokens: int = 0
    max_input_chars: int = 0
    max_logit_bias: int = 1024
    max_stop_token_ids: int = 1024
    max_prompts: int = 1024
    protect_metrics: bool = False  # /metrics needs the API key too
    request_header_timeout_s: float = 10.0
    request_body_timeout_s: float = 30.0
    retry_after_s: int = 1
    # Tool calling and reasoning output (vLLM's flags): parser names from serve/tool_parsers.py, reasoning.py.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # LoRA adapters (serve/lora.py): --lora-modules as (name, path), and whether they may change at run time.
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None  # runtime loads resolve lora_path inside it (serve/lora.resolve_in_root)
    max_loaded_loras: int = 64
    # Tenants (serve/tenants/): --api-keys-file, the admin key of /admin routes, the usage database and prices.
    api_keys_file: str | None = None
    admin_key: str | None = None
    internal_api_key: str | None = None  # the router's and PD peers' key (serve/roles.py)
    usage_db: str | None = None
    pricing_file: str | None = None
    # A request's slo.ttft_ms below this is a 400 (--min-slo-ttft-ms): a target no step can meet only costs batch
    # work its step size (core/policies/slo.py).
    min_slo_ttft_ms: float = 50.0
    ui: bool = True  # the web console at / and /ui/ (--no-ui: off; serve/routes/ui.py)


# Inputs longer than this (characters, or token ids to decode) are (de)tokenized in the slow lane.
LARGE_INPUT = 16_384
SLOW_LANE_NICE = 10


def _lower_priority() -> None:
    """Runs in the slow lane's thread: Linux gives each thread its own nice value, so a large tokenization
    yields the CPU to the engine core and to everyone else's small requests."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SLOW_LANE_NICE)
    except (AttributeError, OSError):
        pass


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    settings: ServerSettings
    metrics: ServerMetrics
    # Tokenizing and chat templates run off the event loop in two lanes, one thread each: small inputs (every
    # ordinary request) never queue behind a large one, and large ones run at a lower CPU priority.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenize"))
    slow_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenize-large",
                                                   initializer=_lower_priority))
    # Adapter files are read here, one at a time: a large one never holds up anyone's tokenization.
    lora_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-lora-load",
                                                   initializer=_lower_priority))
    loras: LoRARegistry | None = None
    keys: KeyStore | None = None  # --api-keys-file's tenants, reloadable
    limiter: TenantLimiter = field(default_factory=TenantLimiter)  # the tenants' counts (middleware, handlers)
    usage: UsageStore | None = None  # --usage-db: metering

    def __post_init__(self) -> None:
        s = self.settings
        if self.loras is None:
            self.loras = LoRARegistry(s.served_model_names + s.model_aliases, s.max_loaded_loras)
        if self.keys is None and s.api_keys_file:
            self.keys = KeyStore(s.api_keys_file)  # a bad file stops the start here, with the reason
        if self.usage is None and s.usage_db:
            self.usage = UsageStore(s.usage_db, load_pricing(s.pricing_file) if s.pricing_file else None)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def limits(self) -> Limits:
        s = self.settings
        return Limits(self.engine.max_model_len, self.engine.vocab_size, s.max_logprobs, s.max_n, s.max_stop_strings,
                      s.max_stop_string_length, s.max_request_tokens, s.max_input_chars, s.max_logit_bias,
                      s.max_stop_token_ids, s.max_prompts)

    def check_model(self, requested: str | None, tenant: Tenant | None = None) -> str:
        return self.resolve_model(requested, tenant)[0]

    def resolve_model(self, requested: str | None, tenant: Tenant | None = None,
                      scope: dict | None = None) -> tuple[str, LoRARequest | None]:
        """The name to answer with, and the adapter a request's `model` names (None: the base model). A tenant
        asking for a model outside its `models` (the base model by its first served name, an adapter by its
        name) or another tenant's adapter gets the same 404 as for one that does not exist. With the request's
        `scope`, the adapter counts as in use until the response is done (its name cannot be re-registered)."""
        lora = None
        if requested is None or requested in self.settings.served_model_names or \
                requested in self.settings.model_aliases:
            name = self.model_name
        else:
            lora = self.loras.get(requested)
            if lora is None:
                raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")
            name = requested
        if tenant is not None and not tenant.may_use(name):
            raise APIError(404, f"The model `{requested or name}` does not exist or you do not have access to it.",
                           "model", "model_not_found")
        if lora is not None and scope is not None:
            on_response_done(scope, self.loras.acquire(lora))
        return name, lora

    def visible_models(self, tenant: Tenant | None) -> list[str]:
        base = self.settings.served_model_names if tenant is None or tenant.may_use(self.model_name) else []
        return base + [n for n in self.loras.names() if tenant is None or tenant.may_use(n)]

    def check_capacity(self) -> None:
        """503 while draining, or when the waiting queue is at --max-waiting-requests."""
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if self.engine.draining:
            raise APIError(503, "The server is shutting down and accepts no new requests.", None, "shutting_down",
                           headers=retry)
        if not self.engine.is_alive:
            raise APIError(503, "The engine is not running.", None, "engine_dead")
        limit = self.settings.max_waiting_requests
        if limit is not None and self.engine.num_waiting >= limit:
            raise APIError(503, f"The server is overloaded: {self.engine.num_waiting} requests are already waiting "
                                f"(limit {limit}). Please retry later.", None, "overloaded", headers=retry)

    async def run_blocking(self, fn: Callable[..., Any], *args, size: int = 0, **kwargs) -> Any:
        """fn(*args, **kwargs) in a worker thread; `size` (characters or ids of input) picks the lane."""
        loop = asyncio.get_running_loop()
        pool = self.slow_executor if size > LARGE_INPUT else self.executor
        return await loop.run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.engine.tokenizer
        return await self.run_blocking(lambda: tok(text, add_special_tokens=add_special_tokens).input_ids,
                                       size=len(text))

    async def detokenize(self, ids: list[int]) -> str:
        return await self.run_blocking(self.engine.tokenizer.decode, ids, size=len(ids) * 4)

    def shutdown(self) -> None:
        if self.usage is not None:
            self.usage.close()  # the last records written
        self.executor.shutdown(wait=False)
        self.slow_executor.shutdown(wait=False)
        self.lora_executor.shutdown(wait=False)

"""Run the app under uvicorn, with a graceful drain on SIGTERM / Ctrl-C.

Drain: stop listening, answer new requests on open connections with 503, let in-flight requests finish
for up to --drain-timeout seconds, then abort the rest (their streams get an error event) and exit 0.
A second signal exits at once. The same holds when the signal reaches the whole process group (Ctrl-C in a
terminal, `systemctl stop`, `docker stop`): the engine core process ignores SIGTERM and SIGINT, and stops
when the drained server tells it to (core_proc.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.engine.async_engine import EngineError
from tokenmill.serve.state import ServerState

log = logging.getLogger("tokenmill.serve")


@dataclass
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    access_log: bool = True


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Unlike uvicorn's handler, do not re-raise the signal after shutdown: a drained server exits 0.
        if self._drain_requested or self._loop is None or not self.started:
            self.force_exit = self._drain_requested  # a second signal: stop now
            self.should_exit = True
            return
        self._drain_requested = True
        log.info("received %s: draining (up to %g s)", signal.Signals(sig).name, self.state.settings.drain_timeout_s)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        engine = self.state.engine
        engine.begin_drain()
        for server in getattr(self, "servers", []):  # uvicorn.Server sets it in startup(): absent before
            server.close()  # no new connections; open ones get 503 for new requests
        if not await engine.wait_idle(self.state.settings.drain_timeout_s):
            log.warning("drain timeout: aborting %d request(s)", engine.num_in_flight)
            engine.abort_all(EngineError("the server is shutting down; the request was aborted.", 503,
                                         "shutting_down"))
            await engine.wait_idle(5.0)
        self.should_exit = True


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a deadline for each request's line and headers: a connection that
    trickles them in (slowloris) is closed after header_timeout_s, however often bytes arrive. uvicorn's
    keep-alive timer restarts on every byte, and nothing times a new connection's first request. The deadline
    runs from a new connection's start, and on a kept-alive one from the next request's first byte: an idle
    kept-alive connection is uvicorn's (--timeout-keep-alive), so a short header timeout never closes a pooled
    connection just as its client reuses it."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._header_cycle = self.cycle
        self._header_armed = True
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def data_received(self, data: bytes) -> None:
        if not self._header_armed and self.cycle is self._header_cycle:  # the first byte of the next request
            self._arm_header_timer()
        super().data_received(data)

    def _header_timeout(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self.cycle is self._header_cycle and idle and not self.transport.is_closing():  # no new request began
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._header_cycle:  # a request's headers are in: its body has its own timeout
            self._header_timer.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request at once
        if not self.transport.is_closing() and self.cycle.response_complete:
            self._header_timer.cancel()
            self._header_cycle, self._header_armed = self.cycle, False  # armed by the next request's first byte

    def connection_lost(self, exc) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)


def run_server(state: ServerState, listen: ListenConfig, app) -> None:
    protocol = type("ServerProtocol", (HeaderTimeoutProtocol,),
                    {"header_timeout_s": state.settings.request_header_timeout_s})
    config = uvicorn.Config(
        app,
        http=protocol,
        host=listen.host,
        port=listen.port,
        log_level=listen.log_level,
        access_log=listen.access_log,
        # Only a backstop: the drain has already finished or aborted every request by then.
        timeout_graceful_shutdown=10,
        timeout_keep_alive=5,
    )
    DrainingServer(config, state).run()


def kv_transfer_summary(cfg, base_url: str) -> str:
    """The start-up line of a disaggregated prefill/decode instance: its KV connector, its role and where
    its blocks go or come from."""
    from tokenmill.core.kv_connector import store_path

    path = store_path(cfg)
    parts = []
    if cfg.kv_role in ("kv_producer", "kv_both"):
        parts.append(f"writes the blocks it computes to {path}, served at {base_url}/v1/kv_blocks")
    if cfg.kv_role in ("kv_consumer", "kv_both"):
        producers = (cfg.kv_connector_extra_config or {}).get("producers") or []
        producers = [producers] if isinstance(producers, str) else list(producers)
        if cfg.kv_connector == "TCPConnector":
            parts.append(f"pulls missing blocks from {', '.join(producers) or 'no producer'} into {path}")
        else:
            parts.append(f"loads blocks from {path}")
    return f"KV connector: {cfg.kv_connector}, role: {cfg.kv_role}; " + "; ".join(parts)


DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def served_names(args) -> list[str]:
    """--served-model-name, else the model's name without its path (as vLLM names a hub model by its id, not by
    the cache folder): a folder's name, a .gguf file's name without the suffix."""
    if args.served_model_name:
        return list(args.served_model_name)
    given = args.model or args.model_pos
    if not given:
        return [DEFAULT_SERVED_NAME]
    name = os.path.basename(os.path.normpath(given))
    return [name.removesuffix(".gguf") or given]


def model_aliases(args, names: list[str]) -> list[str]:
    """The MODEL argument as given, still accepted as a request's `model` when it is not a served name."""
    given = args.model or args.model_pos
    return [given] if given and not args.served_model_name and given not in names else []


def serve_main(args, engine_kwargs: dict) -> int:
    """`tokenmill serve`: load the model, then serve until SIGTERM / Ctrl-C."""
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.serve.app import build_app
    from tokenmill.serve.chat import load_chat_template
    from tokenmill.serve.metrics import ServerMetrics
    from tokenmill.serve.lora import parse_lora_modules
    from tokenmill.serve.state import ServerSettings

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be non-negative, got {args.max_waiting_requests}.")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be non-negative, got {args.drain_timeout}.")
    if not args.min_slo_ttft_ms >= 0:
        raise ValueError(f"--min-slo-ttft-ms must be non-negative, got {args.min_slo_ttft_ms}.")
    # getattr: the serve parser's flags, by the names listed in each loop
    for flag in ("max_n", "max_stop_strings", "max_stop_string_length", "max_prompts"):
        if (value := getattr(args, flag)) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}.")
    for flag in ("max_logprobs", "max_logit_bias", "max_stop_token_ids"):  # 0: the field is refused
        if (value := getattr(args, flag)) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be non-negative, got {value}.")
    for flag in ("max_request_tokens", "max_input_chars"):
        if (value := getattr(args, flag)) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be non-negative (0: derived), got {value}.")
    for flag in ("request_header_timeout", "request_body_timeout"):
        if not (value := getattr(args, flag)) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}.")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
    if args.tool_call_parser:
        from tokenmill.serve.tool_parsers import get_tool_parser

        get_tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        from tokenmill.serve.reasoning import get_reasoning_parser

        get_reasoning_parser(args.reasoning_parser)
    names = served_names(args)
    settings = ServerSettings(
        served_model_names=names,
        model_path=engine_kwargs["model"],
        model_aliases=model_aliases(args, names),
        api_key=args.api_key or None,
        chat_template=load_chat_template(args.chat_template),
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        drain_timeout_s=args.drain_timeout,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_length=args.max_stop_string_length,
        max_request_tokens=args.max_request_tokens,
        max_input_chars=args.max_input_chars,
        max_logit_bias=args.max_logit_bias,
        max_stop_token_ids=args.max_stop_token_ids,
        max_prompts=args.max_prompts,
        protect_metrics=args.protect_metrics,
        request_header_timeout_s=args.request_header_timeout,
        request_body_timeout_s=args.request_body_timeout,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        lora_modules=parse_lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        api_keys_file=args.api_keys_file,
        admin_key=args.admin_key or None,
        internal_api_key=args.internal_api_key or None,
        lora_root=args.lora_root,
        max_loaded_loras=args.max_loaded_loras,
        usage_db=args.usage_db,
        pricing_file=args.pricing,
        min_slo_ttft_ms=args.min_slo_ttft_ms,
        ui=not args.no_ui,
    )
    if args.pricing:
        from tokenmill.serve.tenants.usage import load_pricing

        load_pricing(args.pricing)  # a bad file: the reason before the model loads
    if args.api_keys_file:
        from tokenmill.serve.tenants.keys import load_keys

        load_keys(args.api_keys_file)  # a bad file: the reason before the model loads
    from tokenmill.platform import tune_malloc

    tune_malloc()  # this process is ours: with --no-engine-core-process the steps run here
    # getattr: the logging module's level constant named by --uvicorn-log-level
    logging.basicConfig(level=getattr(logging, args.uvicorn_log_level.upper(), logging.INFO),
                        format="%(levelname)s %(name)s: %(message)s")
    from tokenmill.engine_args import EngineArgs

    config = EngineArgs.from_kwargs(**engine_kwargs).create_engine_config()
    if config.kv_transfer is not None and config.kv_transfer.kv_role in ("kv_producer", "kv_both"):
        from tokenmill.core.kv_connector import store_path

        settings.kv_store = store_path(config.kv_transfer)
    metrics = ServerMetrics(settings.served_model_names[0])
    own_process = args.engine_core_process
    dp = args.data_parallel_size
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {dp}.")
    if dp > 1:
        from tokenmill.engine.data_parallel import DataParallelEngine

        engine = DataParallelEngine.from_config(config, dp, observer=metrics)
        own_process = True
    else:
        engine = AsyncLLMEngine.from_config(config, own_process=own_process, observer=metrics)
    state = ServerState(engine, settings, metrics)
    f = engine.facts
    log.info("model %s loaded in %.1f s (engine core %s%s); max_model_len %d, %d KV blocks of %d tokens",
             settings.model_path, f.load_time_s, "in its own process" if own_process else "in a thread",
             f" x {dp} data-parallel replicas" if dp > 1 else "", f.max_model_len, f.num_blocks, f.block_size)
    listen = ListenConfig(args.host, args.port, args.uvicorn_log_level, not args.disable_uvicorn_access_log)
    if config.kv_transfer is not None:
        log.info("%s", kv_transfer_summary(config.kv_transfer, f"http://{listen.host}:{listen.port}"))
    run_server(state, listen, build_app(state))
    return 0

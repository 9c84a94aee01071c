"""`tokenmill serve`: the OpenAI-compatible HTTP server's flags (tokenmill/serve/ runs it)."""
from __future__ import annotations

import argparse
import os

from tokenmill.cli.args import add_engine_args, engine_kwargs
from tokenmill.engine_args import parse_bytes


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.",
                              description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /tokenize, /detokenize, /health, /version, /metrics.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: %(default)s).")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    g.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' on every route but /health, /version and /metrics "
                        "(default: $TOKENMILL_API_KEY, else none).")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="Model name(s) clients use; the first one is reported back (default: the MODEL's folder or "
                        "file name without its path and .gguf, or SmolLM2-135M-Instruct for the embedded model).")
    g.add_argument("--api-keys-file", metavar="FILE",
                   help="Tenants and their API keys (YAML or JSON: keys, allowed models, limits, priority, SLOs; "
                        "docs/tenants.md); reloaded on SIGHUP or POST /admin/reload. --api-key keeps working as "
                        "an unlimited tenant.")
    g.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"),
                   help="The key of the /admin routes and of runtime adapter loading; it may call every route "
                        "(default: $TOKENMILL_ADMIN_KEY, else none: /admin is closed).")
    g.add_argument("--internal-api-key", default=os.environ.get("TOKENMILL_INTERNAL_API_KEY"),
                   help="The key of internal callers (tokenmill router, disaggregated-prefill peers): /v1/kv_events, "
                        "/v1/kv_blocks, /v1/diagnostics, /metrics, and generation without a tenant; tenant keys get "
                        "403 there (default: $TOKENMILL_INTERNAL_API_KEY; the admin key works too). docs/tenants.md.")
    g.add_argument("--usage-db", metavar="FILE",
                   help="Meter usage per tenant, model and day into this SQLite file (created if missing); read it "
                        "at GET /v1/usage (docs/tenants.md).")
    g.add_argument("--pricing", metavar="FILE",
                   help="Prices for the usage's cost: YAML or JSON, USD per million input / cached_input / output "
                        "tokens, a default and per model.")
    g.add_argument("--min-slo-ttft-ms", type=float, default=50.0, metavar="MS",
                   help="The tightest slo.ttft_ms a request may ask for; below it the request gets 400 (a target no "
                        "step can meet only shortens everyone's batch steps) (default: %(default)s; 0: any).")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters to serve (needs --enable-lora): NAME=PATH (a PEFT folder or a GGUF LoRA file) or "
                        "vLLM's JSON form '{\"name\": NAME, \"path\": PATH}'; a request's model field picks one.")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                   help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter: the admin key only (with "
                        "no keys at all, behind --api-key) (default: off, or $VLLM_ALLOW_RUNTIME_LORA_UPDATING).")
    g.add_argument("--lora-root", metavar="DIR",
                   help="Runtime adapter loads read only inside DIR: lora_path is taken relative to it, and a path "
                        "outside it (or a symlink out of it) is refused like a missing file (default: none, paths "
                        "as given; the admin key only).")
    g.add_argument("--max-loaded-loras", type=int, default=64, metavar="N",
                   help="Most adapters registered at once (--lora-modules and runtime loads) (default: %(default)s).")
    g.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="Jinja chat template (a file or the text) to use instead of the model's.")
    g.add_argument("--max-waiting-requests", type=int, metavar="N",
                   help="Answer 503 with Retry-After once N sequences are waiting (default: no limit).")
    g.add_argument("--max-request-body-bytes", type=parse_bytes, default=4 << 20, metavar="SIZE",
                   help="Largest request body accepted, e.g. 4M; larger ones get 413 (default: 4M).")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="On SIGTERM or Ctrl-C, how long in-flight requests may run before they are aborted "
                        "(default: %(default)s).")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="Most logprobs / top_logprobs a request may ask for (default: %(default)s).")
    g.add_argument("--max-n", type=int, default=16, help="Most sequences (n) one request may ask for (default: %(default)s).")
    g.add_argument("--max-stop-strings", type=int, default=16,
                   help="Most stop strings one request may give (default: %(default)s; OpenAI allows 4).")
    g.add_argument("--max-stop-string-length", type=int, default=256, metavar="CHARS",
                   help="Longest stop string accepted, in characters (default: %(default)s).")
    g.add_argument("--max-request-tokens", type=int, default=0, metavar="N",
                   help="Per-request token budget: prompt tokens + n x max_tokens, over all prompts of a request "
                        "(default: 8 x max_model_len).")
    g.add_argument("--max-input-chars", type=int, default=0, metavar="N",
                   help="Most characters of text one request may ask to tokenize (prompt, messages, /tokenize); longer "
                        "text is refused before it is read (default: 32 x max_model_len).")
    g.add_argument("--max-logit-bias", type=int, default=1024, metavar="N",
                   help="Most logit_bias entries one request may give; the sampler reads them at every step of "
                        "every sequence (default: %(default)s; OpenAI allows 300).")
    g.add_argument("--max-stop-token-ids", type=int, default=1024, metavar="N",
                   help="Most stop_token_ids one request may give (default: %(default)s).")
    g.add_argument("--max-prompts", type=int, default=1024, metavar="N",
                   help="Most prompts in one /v1/completions request (default: %(default)s).")
    g.add_argument("--protect-metrics", action="store_true",
                   help="Require the API key on /metrics too (default: open, like /health, as in vLLM).")
    g.add_argument("--request-header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="Close connections whose request line and headers do not arrive within this time "
                        "(default: %(default)s).")
    g.add_argument("--request-body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="Answer 408 and close when a request body does not arrive within this time "
                        "(default: %(default)s).")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser.')
    g.add_argument("--tool-call-parser", metavar="NAME",
                   help="How tool calls look in this model's output: hermes (Hermes, Qwen), llama3_json, mistral, "
                        "openai (gpt-oss harmony).")
    g.add_argument("--reasoning-parser", metavar="NAME",
                   help="Split <think>...</think> into reasoning_content: deepseek_r1 or qwen3; "
                        "openai_gptoss: gpt-oss's harmony analysis channel.")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of the server (default: %(default)s).")
    g.add_argument("--no-ui", action="store_true",
                   help="Do not serve the web console at / and /ui/ (docs/console.md); / then answers JSON only.")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every HTTP request.")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="Run N engine cores (each its own process and KV cache) behind this endpoint; each request "
                        "goes to the one with the fewest requests in flight (default: %(default)s).")
    g.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                   help="Run the engine core (scheduler + model) in its own process, so HTTP parsing and "
                        "(de)tokenization never hold the step loop's GIL; --no-engine-core-process runs it in a "
                        "thread of the server process (default: on).")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.platform import exit_without_teardown
    from tokenmill.serve.server import serve_main

    rc = serve_main(args, engine_kwargs(args))
    exit_without_teardown(rc)  # the server stopped cleanly: skip the interpreter's slow teardown
    return rc

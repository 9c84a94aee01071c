"""`tokenmill router`: one OpenAI-compatible endpoint in front of several servers (tokenmill/router/ runs it)."""
from __future__ import annotations

import argparse
import os


def add_router_parser(subparsers) -> None:
    from tokenmill.router.policies import POLICIES

    p = subparsers.add_parser("router", help="Route OpenAI-compatible requests over several servers.",
                              description="One OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics) in front of several servers, tokenmill "
                                          "or others; prefix-aware routing follows the backends' /v1/kv_events.")
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="Base URL of a backend server, e.g. http://127.0.0.1:8001; repeatable.")
    p.add_argument("--policy", choices=list(POLICIES), default="prefix-aware",
                   help="How to choose a backend per request (default: %(default)s).")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: %(default)s).")
    p.add_argument("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="Tokenizer of the served model, to name the blocks of text prompts for prefix-aware "
                        "routing (default: none; only token-id prompts are matched).")
    p.add_argument("--block-size", type=int, metavar="N",
                   help="Tokens per KV block on the backends (default: as their /v1/kv_events report, else 16).")
    p.add_argument("--pd", action="store_true",
                   help="Disaggregated prefill/decode: each request runs first on a --prefill instance (a "
                        "kv_producer) for one token, then on a --backend (a kv_consumer) that loads its KV.")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="With --pd: a prefill instance; repeatable (taken in turn).")
    g = p.add_argument_group("tenants (docs/tenants.md): enforced here, over every backend")
    g.add_argument("--api-keys-file", metavar="FILE",
                   help="Tenants and their keys (YAML/JSON, as `serve`): the router authenticates, limits and "
                        "meters them, and passes their priority class and SLO to the backends.")
    g.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"),
                   help="Key for /admin/reload and every tenant's /v1/usage (default: $TOKENMILL_ADMIN_KEY).")
    g.add_argument("--usage-db", metavar="FILE", help="Meter usage per tenant into this SQLite file.")
    g.add_argument("--pricing", metavar="FILE", help="Prices per million tokens for the metered cost.")
    g.add_argument("--backend-api-key", default=os.environ.get("TOKENMILL_BACKEND_API_KEY"),
                   help="The key the router sends to the backends in place of the tenant's, and on its "
                        "/v1/kv_events polls: start the backends with it as --internal-api-key "
                        "(default: $TOKENMILL_BACKEND_API_KEY; none).")
    g.add_argument("--internal-api-key", default=os.environ.get("TOKENMILL_INTERNAL_API_KEY"),
                   help="With --api-keys-file: the key of the router's /metrics for scrapers (it names the "
                        "tenants; tenant keys get 403) (default: $TOKENMILL_INTERNAL_API_KEY; the admin key works too).")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help="Seconds between health checks of each backend (default: %(default)s).")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of the router (default: %(default)s).")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.router.app import RouterConfig, create_app

    if args.pd != bool(args.prefill):
        raise ValueError("--pd needs at least one --prefill URL, and --prefill needs --pd.")
    if args.pricing and not args.usage_db:
        raise ValueError("--pricing needs --usage-db.")
    cfg = RouterConfig(backends=args.backend, policy=args.policy, tokenizer=args.tokenizer,
                       block_size=args.block_size, health_interval_s=args.health_interval, prefill=args.prefill,
                       api_keys_file=args.api_keys_file, admin_key=args.admin_key, usage_db=args.usage_db,
                       pricing=args.pricing, backend_api_key=args.backend_api_key,
                       internal_api_key=args.internal_api_key)
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0

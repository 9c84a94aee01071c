"""The `tokenmill` command line: `generate`, `chat`, `serve` and `quantize` on a local model (vLLM's flag names),
and `router` in front of several servers.

Each subcommand is an `add_<name>_parser(subparsers)` that registers its flags and a `cmd_<name>(args)`
that runs it. Shared flags come from `add_engine_args` / `engine_kwargs` (generated from EngineArgs;
-> LLM(...) kwargs) and `add_sampling_args` / `sampling_params` (-> SamplingParams).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from tokenmill import __version__
from tokenmill.engine_args import EngineArgs, parse_bytes
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine

USER_ERRORS = (ValueError, OSError, NotImplementedError)
DEFAULT_MAX_TOKENS = 256


# ---- shared flags ----------------------------------------------------------------------------
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for LLM(...) from the engine flags; resolves the model path."""
    from tokenmill.model.default import resolve_model

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = resolve_model(engine_args.model)
    return asdict(engine_args)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="Most tokens to generate per reply (default: %(default)s).")
    g.add_argument("--min-tokens", type=int, default=d.min_tokens,
                   help="Fewest tokens to generate before EOS or stop tokens may end a reply (default: %(default)s).")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help="Sampling temperature; 0 is greedy (default: %(default)s).")
    g.add_argument("--top-p", type=float, default=d.top_p,
                   help="Nucleus sampling: keep the smallest set of tokens with this total probability (default: %(default)s).")
    g.add_argument("--top-k", type=int, default=d.top_k,
                   help="Keep only the k most likely tokens; 0 or -1 disables (default: %(default)s).")
    g.add_argument("--min-p", type=float, default=d.min_p,
                   help="Drop tokens less likely than this fraction of the most likely one (default: %(default)s).")
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="Penalty > 1 for tokens already in the prompt or output (default: %(default)s).")
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="Penalty in [-2, 2] for tokens already in the output (default: %(default)s).")
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="Penalty in [-2, 2] per occurrence of a token in the output (default: %(default)s).")
    g.add_argument("--sampling-seed", type=int,
                   help="Per-request sampling seed: the reply then does not depend on other requests or on "
                        "--seed (default: none, draw from the engine's generator).")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="Stop when this text is generated (not included in the output); repeatable.")
    g.add_argument("--ignore-eos", action="store_true", help="Keep generating past the end-of-sequence token.")
    g.add_argument("-n", type=int, default=1, help="Number of completions per prompt (default: %(default)s).")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="Do not print the stats line to stderr.")


def load_engine(args: argparse.Namespace) -> LLMEngine:
    from tokenmill.llm import LLM

    return LLM(**engine_kwargs(args)).engine


# ---- streaming -------------------------------------------------------------------------------
@dataclass
class StreamResult:
    texts: list[str]
    num_tokens: int
    seconds: float
    aborted: bool = False

    def stats_line(self) -> str:
        rate = self.num_tokens / self.seconds if self.seconds > 0 else 0.0
        return f"[{self.num_tokens} tokens in {self.seconds:.2f} s, {rate:.1f} tok/s]"


_request_ids = itertools.count()


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams,
           write: Callable[[str], None] | None = None) -> StreamResult:
    """Run one request to completion, passing its first sequence's text to `write` as it is produced.

    Ctrl-C aborts the request and returns what was generated so far, with aborted=True.
    """
    rid = f"cli-{next(_request_ids)}"
    start = time.perf_counter()
    state = engine.add_request(rid, prompt, params)
    out = engine.output_processor
    aborted = False
    try:
        while not state.finished:
            engine.step()
            if write is not None:
                for seq in out.make_delta(state, 0, []).sequences:
                    if seq.index == 0 and seq.text:
                        write(seq.text)
    except KeyboardInterrupt:
        engine.abort_request(rid)
        aborted = True
    seconds = time.perf_counter() - start
    final = out.make_output(state)
    num_tokens = sum(len(o.token_ids) for o in final.outputs)
    return StreamResult([o.text for o in final.outputs], num_tokens, seconds, aborted)


def chat_prompt(engine: LLMEngine, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the chat template, ready for the assistant's turn."""
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---- generate --------------------------------------------------------------------------------
def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="Generate a completion for one prompt, streamed to stdout.",
                              description="Generate a completion for one prompt and stream it to stdout.")
    p.add_argument("--prompt", required=True, help="The prompt text.")
    p.add_argument("--chat", action="store_true",
                   help="Send the prompt as one user message through the model's chat template.")
    add_output_args(p)
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    engine = load_engine(args)
    prompt = chat_prompt(engine, [{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    if params.n == 1:
        result = stream(engine, prompt, params, write_stdout)
        write_stdout("\n")
    else:
        result = stream(engine, prompt, params)
        for i, text in enumerate(result.texts):
            write_stdout(f"=== completion {i} ===\n{text}\n")
    if not args.quiet:
        print(result.stats_line(), file=sys.stderr)
    return 130 if result.aborted else 0


# ---- chat ------------------------------------------------------------------------------------
CHAT_HELP = "Commands: /reset clears the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."


def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="Chat with a model in the terminal.",
                              description="Multi-turn chat that reads your messages from stdin. " + CHAT_HELP)
    p.add_argument("--system", help="System prompt that starts the conversation.")
    p.add_argument("--once", metavar="TEXT", help="Ask one question, print the answer and exit.")
    add_output_args(p)
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)


def read_line(prompt: str) -> str | None:
    """One line of input, or None at end of input."""
    try:
        return input(prompt)
    except EOFError:
        return None


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    if params.n != 1:
        raise ValueError(f"n must be 1 for chat, got {params.n}.")
    engine = load_engine(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)

    def reply(text: str) -> int:
        """Answer `text` in the conversation and return an exit code; a failed or stopped turn is dropped."""
        history.append({"role": "user", "content": text})
        try:
            result = stream(engine, chat_prompt(engine, history), params, write_stdout)
        except ValueError as e:  # e.g. the conversation no longer fits in max_model_len
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            return 2
        write_stdout("\n")
        if result.aborted:
            history.pop()
            print("[stopped]", file=sys.stderr)
            return 130
        history.append({"role": "assistant", "content": result.texts[0]})
        if not args.quiet:
            print(result.stats_line(), file=sys.stderr)
        return 0

    if args.once is not None:
        return reply(args.once)

    interactive = sys.stdin.isatty()
    if interactive:
        print(CHAT_HELP, file=sys.stderr)
    while True:
        try:
            line = read_line("> " if interactive else "")
        except KeyboardInterrupt:
            write_stdout("\n")
            continue
        if line is None or line.strip() in ("/exit", "/quit"):
            if line is None and interactive:
                write_stdout("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            history[:] = system
            print("[conversation cleared]", file=sys.stderr)
            continue
        reply(line)


# ---- serve -----------------------------------------------------------------------------------
def add_serve_parser(subparsers) -> None:
    import os

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
                   help="How tool calls look in this model's output: hermes (Hermes, Qwen), llama3_json, mistral.")
    g.add_argument("--reasoning-parser", metavar="NAME",
                   help="Split <think>...</think> into reasoning_content: deepseek_r1 or qwen3.")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="Log level of the server (default: %(default)s).")
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
    from tokenmill.serve.server import serve_main

    return serve_main(args, engine_kwargs(args))


# ---- router ----------------------------------------------------------------------------------
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


# ---- entry point -----------------------------------------------------------------------------
def add_bench_parser(subparsers) -> None:
    from tokenmill.bench.offline import add_offline_parsers
    from tokenmill.bench.serve_bench import add_bench_parsers

    bench_sub = add_bench_parsers(subparsers)  # bench serve, bench compare
    add_offline_parsers(bench_sub, add_engine_args, engine_kwargs)  # bench throughput, bench latency


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: LLM inference on PyTorch.")
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_generate_parser(subparsers)
    add_chat_parser(subparsers)
    add_serve_parser(subparsers)
    add_router_parser(subparsers)
    add_bench_parser(subparsers)
    from tokenmill.quantize import add_quantize_parser
    from tokenmill.spec_decode.dflash_train import add_train_dflash_parser
    from tokenmill.spec_decode.eagle_train import add_train_eagle_parser
    from tokenmill.spec_decode.medusa_train import add_train_medusa_parser

    add_quantize_parser(subparsers)
    add_train_medusa_parser(subparsers)
    add_train_dflash_parser(subparsers)
    add_train_eagle_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        message = " ".join(str(e).splitlines()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

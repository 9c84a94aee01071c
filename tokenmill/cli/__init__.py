"""The `tokenmill` command line: `generate`, `chat`, `serve` and `quantize` on a local model (vLLM's flag names),
`router` in front of several servers, `bench`, and the draft-head trainers.

Each subcommand is an `add_<name>_parser(subparsers)` that registers its flags and a `cmd_<name>(args)` that runs
it, in its own module (cli/generate.py, chat.py, serve.py, router.py; bench/, quantize.py and spec_decode/*_train.py
for the rest). Shared flags come from cli/args.py: `add_engine_args` / `engine_kwargs` (generated from EngineArgs;
-> LLM(...) kwargs) and `add_sampling_args` / `sampling_params` (-> SamplingParams); cli/stream.py runs one request
in the terminal. The console script is `tokenmill.cli:main`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tokenmill import __version__
from tokenmill.cli.args import (DEFAULT_MAX_TOKENS, add_engine_args, add_output_args, add_sampling_args,
                                engine_kwargs, load_engine, sampling_params)
from tokenmill.cli.chat import CHAT_HELP, add_chat_parser, cmd_chat, read_line
from tokenmill.cli.generate import add_generate_parser, cmd_generate
from tokenmill.cli.router import add_router_parser, cmd_router
from tokenmill.cli.serve import add_serve_parser, cmd_serve
from tokenmill.cli.stream import StreamResult, chat_prompt, stream, write_stdout
from tokenmill.engine_args import parse_bytes

__all__ = ["CHAT_HELP", "DEFAULT_MAX_TOKENS", "USER_ERRORS", "StreamResult", "add_chat_parser", "add_engine_args",
           "add_generate_parser", "add_output_args", "add_router_parser", "add_sampling_args", "add_serve_parser",
           "build_parser", "chat_prompt", "cmd_chat", "cmd_generate", "cmd_router", "cmd_serve", "engine_kwargs",
           "load_engine", "main", "parse_bytes", "read_line", "sampling_params", "stream", "write_stdout"]

USER_ERRORS = (ValueError, OSError, NotImplementedError)  # reported as "error: ..." with exit code 2


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

"""`tokenmill generate`: one prompt's completion, streamed to stdout."""
from __future__ import annotations

import argparse
import sys

from tokenmill.cli.args import add_engine_args, add_output_args, add_sampling_args, load_engine, sampling_params
from tokenmill.cli.stream import chat_prompt, stream, write_stdout


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

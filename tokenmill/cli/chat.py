"""`tokenmill chat`: a multi-turn conversation in the terminal (or one question with --once)."""
from __future__ import annotations

import argparse
import sys

from tokenmill.cli.args import add_engine_args, add_output_args, add_sampling_args, load_engine, sampling_params
from tokenmill.cli.stream import chat_prompt, stream, write_stdout

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

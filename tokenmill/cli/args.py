"""The flags several subcommands share: the engine's (generated from EngineArgs; -> LLM(...) kwargs), sampling
(-> SamplingParams) and output; and the engine they load."""
from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import TYPE_CHECKING

from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine import LLMEngine

DEFAULT_MAX_TOKENS = 256


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments for LLM(...) from the engine flags; resolves the model path (a Hub id: fetched into the
    Hugging Face cache) and the tokenizer's."""
    from tokenmill.model.default import resolve_paths

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model, engine_args.tokenizer = resolve_paths(engine_args.model, engine_args.tokenizer,
                                                             engine_args.revision, engine_args.download_dir)
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

"""`tokenmill bench serve` (load-test an OpenAI-compatible server) and `tokenmill bench compare`.

Wire into the main CLI with `add_bench_parsers(subparsers)`; each subcommand sets `func`, called
as `args.func(args) -> int`. Standalone: `python -m tokenmill.bench.serve_bench serve --base-url ...`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import replace
from typing import Any, Sequence

from tokenmill.bench.client import ClientConfig, LoadConfig, api_root, first_model, run_benchmark
from tokenmill.bench.datasets import DATASETS, DEFAULT_NUM_PROMPTS, DatasetSpec, build_dataset, load_tokenizer
from tokenmill.bench.metrics import parse_goodput, summarize
from tokenmill.bench.prometheus import server_stats
from tokenmill.bench.report import build_result, compare, format_summary, write_result

SYNTHETIC = ("random", "shared-prefix", "long-context", "long-decode")
DATASET_FLAGS = {
    "random": ("random_input_len", "random_output_len", "random_range_ratio"),
    "shared-prefix": ("shared_prefix_num_prefixes", "shared_prefix_prefix_len", "shared_prefix_suffix_len",
                      "shared_prefix_output_len"),
    "long-context": ("long_context_input_len", "long_context_output_len"),
    "long-decode": ("long_decode_input_len", "long_decode_output_len"),
    "file": ("dataset_path", "file_output_len"),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_serve_parser(sub) -> argparse.ArgumentParser:
    spec = DatasetSpec()
    p = sub.add_parser("serve", help="Load-test an OpenAI-compatible server.",
                       description="Load-test an OpenAI-compatible server (tokenmill, vLLM, ...) with streaming "
                                   "requests; report latency, throughput, goodput and cost.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server root, with or without /v1 (default: %(default)s).")
    g.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="Sent as 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY or $OPENAI_API_KEY).")
    g.add_argument("--model", help="Model name to request (default: the first one the server lists at /v1/models).")
    g.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="/v1/completions or /v1/chat/completions (default: %(default)s).")
    g.add_argument("--tokenizer", help="Tokenizer folder or .gguf file: exact prompt lengths, and output counts "
                                       "when the server sends no usage (default: none; lengths in words).")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="Send ignore_eos so every request produces its full output length (default: on for the "
                        "generated datasets, off for file). Servers that reject unknown fields need --no-ignore-eos.")
    g.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature sent (default: %(default)s).")
    g.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="More request fields, e.g. '{\"top_k\": 20}'.")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, metavar="S",
                   help="Per-request deadline in seconds (default: %(default)s).")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=DATASETS, help="Prompt source (default: %(default)s).")
    g.add_argument("--dataset-path", help="JSONL of {\"prompt\"} / {\"messages\"} (optional \"max_tokens\"), "
                                          "or a ShareGPT export; for --dataset file.")
    g.add_argument("--num-prompts", type=_positive_int,
                   help="Requests to measure (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_NUM_PROMPTS.items())
                        + "; file: every entry).")
    g.add_argument("--seed", type=int, default=0, help="Seed of prompts and arrival times (default: %(default)s).")
    for flag, default, what in (
        ("--random-input-len", spec.random_input_len, "random: prompt tokens"),
        ("--random-output-len", spec.random_output_len, "random: output tokens"),
        ("--shared-prefix-num-prefixes", spec.shared_prefix_num_prefixes, "shared-prefix: distinct system prompts"),
        ("--shared-prefix-prefix-len", spec.shared_prefix_prefix_len, "shared-prefix: tokens of each system prompt"),
        ("--shared-prefix-suffix-len", spec.shared_prefix_suffix_len, "shared-prefix: tokens of each question"),
        ("--shared-prefix-output-len", spec.shared_prefix_output_len, "shared-prefix: output tokens"),
        ("--long-context-input-len", spec.long_context_input_len, "long-context: prompt tokens"),
        ("--long-context-output-len", spec.long_context_output_len, "long-context: output tokens"),
        ("--long-decode-input-len", spec.long_decode_input_len, "long-decode: prompt tokens"),
        ("--long-decode-output-len", spec.long_decode_output_len, "long-decode: output tokens"),
    ):
        g.add_argument(flag, type=_positive_int, default=default, help=f"{what} (default: %(default)s).")
    g.add_argument("--random-range-ratio", type=float, default=spec.random_range_ratio,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)] (default: %(default)s).")
    g.add_argument("--file-output-len", type=_positive_int,
                   help="file: max_tokens for every entry (default: the entry's max_tokens, else its ShareGPT "
                        "reply length, else 256).")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Requests per second, arrivals Poisson (gamma with --burstiness); inf sends all at once "
                        "(default: %(default)s).")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of the gaps: 1 Poisson, < 1 burstier, > 1 more regular (default: %(default)s).")
    g.add_argument("--max-concurrency", type=_positive_int, help="Most requests in flight (default: no limit).")
    g.add_argument("--num-warmups", type=int, default=1,
                   help="Requests sent before measuring, excluded from results (default: %(default)s).")
    g.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    g.add_argument("--tenants", metavar="FILE",
                   help="YAML/JSON list of tenants loading the server together, each with its API key, prompts, "
                        "rate and SLOs (format: docs/bench.md); the report adds each tenant's goodput and SLO "
                        "attainment.")

    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds).")
    g.add_argument("--cost-per-hour", type=float, metavar="USD", help="Machine cost for cost per request / 1M tokens.")
    g.add_argument("--metrics-url", help="Prometheus endpoint scraped before and after (default: BASE/metrics).")
    g.add_argument("--result-json", metavar="PATH", help="Write the full result (schema: docs/bench.md).")
    g.add_argument("--report-html", metavar="PATH", help="Write a self-contained HTML report with plots.")
    p.set_defaults(func=run_bench_serve)
    return p


def add_compare_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="Compare result JSON files side by side.",
                       description="The metrics of several `bench serve --result-json` files side by side, "
                                   "with each file's ratio to the first.")
    p.add_argument("results", nargs="+", metavar="RESULT.json")
    p.set_defaults(func=run_bench_compare)
    return p


def add_bench_parsers(subparsers) -> Any:
    """Register `bench serve` and `bench compare`; returns the `bench` subparsers so that more
    bench subcommands (throughput, latency) can be added to it."""
    bench = subparsers.add_parser("bench", help="Benchmark a server, or compare benchmark results.",
                                  description="Benchmarks: `serve` load-tests a server, `compare` compares results.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    add_serve_parser(sub)
    add_compare_parser(sub)
    return sub


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    flags = vars(args)  # the dataset flags, by name
    fields = {f: flags[f] for names in DATASET_FLAGS.values() for f in names}
    return DatasetSpec(name=args.dataset, num_prompts=args.num_prompts, seed=args.seed, **fields)


def run_config(args: argparse.Namespace, model: str, num_prompts: int, ignore_eos: bool,
               slos: dict[str, float]) -> dict[str, Any]:
    return {
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
        "dataset_params": {f: vars(args)[f] for f in DATASET_FLAGS[args.dataset]},  # the dataset's flags, by name
        "num_prompts": num_prompts, "num_warmups": args.num_warmups,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "ignore_eos": ignore_eos,
        "temperature": args.temperature, "seed": args.seed, "tokenizer": args.tokenizer,
        "goodput_slos_ms": slos or None, "cost_per_hour": args.cost_per_hour, "extra_body": args.extra_body,
    }


async def _bench(args: argparse.Namespace, transport=None) -> dict[str, Any]:
    slos = parse_goodput(args.goodput)
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must not be negative")
    tokenizer = load_tokenizer(args.tokenizer)
    spec = dataset_spec(args)
    tenants = None
    if args.tenants:
        from tokenmill.bench.tenants import load_tenants

        tenants = load_tenants(args.tenants, args, spec, slos, not args.disable_tqdm)
    requests = build_dataset(spec, tokenizer) if not tenants else []  # tenants draw their own
    # Warm-ups use another seed, so they do not put the measured prompts in the prefix cache.
    warmups = build_dataset(replace(spec, seed=spec.seed + 1, num_prompts=args.num_warmups), tokenizer) \
        if args.num_warmups else []
    model = args.model or await first_model(args.base_url, args.api_key or (tenants[0].api_key if tenants else None),
                                            transport)
    if not model:
        raise ValueError(f"could not list models at {api_root(args.base_url)}/v1/models; pass --model")
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset in SYNTHETIC
    cfg = ClientConfig(base_url=args.base_url, model=model, endpoint=args.endpoint, api_key=args.api_key,
                       ignore_eos=ignore_eos, temperature=args.temperature, extra_body=args.extra_body,
                       request_timeout=args.request_timeout)
    load = LoadConfig(request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, seed=args.seed, progress=not args.disable_tqdm)
    metrics_url = args.metrics_url or api_root(args.base_url) + "/metrics"
    if tenants:
        return await _bench_tenants(args, cfg, tenants, slos, warmups, tokenizer, transport, metrics_url, model,
                                    ignore_eos)
    run = await run_benchmark(cfg, requests, load, warmups, tokenizer, transport, metrics_url)
    if run.warmup_errors:
        print(f"warning: {len(run.warmup_errors)} of {len(warmups)} warm-up requests failed, first: "
              f"{run.warmup_errors[0].key}: {run.warmup_errors[0].message}", file=sys.stderr)
    summary = summarize(run.records, slos, args.cost_per_hour)
    return build_result(run_config(args, model, len(requests), ignore_eos, slos), summary,
                        server_stats(metrics_url, run.metrics_before, run.metrics_after), run.records,
                        run.started_at)


async def _bench_tenants(args, cfg: ClientConfig, tenants, slos: dict[str, float], warmups, tokenizer,
                         transport, metrics_url: str, model: str, ignore_eos: bool) -> dict[str, Any]:
    from tokenmill.bench.client import fetch_text, make_client, warm_up
    from tokenmill.bench.metrics import duration
    from tokenmill.bench.tenants import overall_goodput, run_tenants, tenant_results

    first = replace(cfg, api_key=tenants[0].api_key)
    async with make_client(None, transport) as client:
        await warm_up(client, first, warmups, LoadConfig(progress=False), tokenizer)
    before = await fetch_text(metrics_url, first.api_key, transport=transport)
    runs, started_at = await run_tenants(cfg, tenants, tokenizer, transport)
    after = await fetch_text(metrics_url, first.api_key, transport=transport)
    per_tenant, records = tenant_results(runs, args.cost_per_hour)
    summary = summarize(records, None, args.cost_per_hour)
    summary.goodput = overall_goodput(runs, duration(records))
    config = run_config(args, model, len(records), ignore_eos, slos)
    config["tenants_file"] = args.tenants
    result = build_result(config, summary, server_stats(metrics_url, before, after), records, started_at)
    result["tenants"] = per_tenant
    return result


def run_bench_serve(args: argparse.Namespace, transport=None) -> int:
    """Run the benchmark, print the summary, write the files asked for; 1 when no request succeeded."""
    result = asyncio.run(_bench(args, transport))
    print(format_summary(result))
    if result.get("tenants"):
        from tokenmill.bench.tenants import format_tenants

        print(format_tenants(result))
    if args.result_json:
        write_result(result, args.result_json)
        print(f"result: {args.result_json}", file=sys.stderr)
    if args.report_html:
        from tokenmill.bench.html_report import write_html

        write_html(result, args.report_html)
        print(f"report: {args.report_html}", file=sys.stderr)
    return 0 if result["summary"]["completed"] > 0 else 1


def run_bench_compare(args: argparse.Namespace) -> int:
    print(compare(args.results))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill")
    add_bench_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).splitlines()) or type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

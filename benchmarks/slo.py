"""Goodput under SLOs: an interactive tenant and a batch tenant share one server, under each scheduling policy.

The interactive tenant sends short prompts at a steady rate and has targets (TTFT and TPOT, in its keys-file
entry, so the server's `slo` policy knows them); the batch tenant sends long prompts all at once and has none.
The batch work alone saturates the server for the whole run. For each policy (fcfs, priority, slo) the same
load runs against a fresh server (the embedded model), through `tokenmill bench serve --tenants`; printed:
interactive SLO attainment and goodput, batch throughput, and the ratios to fcfs.

Goals (issue 28): interactive goodput with `slo` >= 1.5x fcfs, batch throughput >= 0.9x fcfs.

    python benchmarks/slo.py                          # load and targets sized for a 2-core CPU (docs/tenants.md)
    python benchmarks/slo.py --ttft-ms 1000 --tpot-ms 100   # the issue's targets, for a faster machine
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import _servers  # noqa: E402
from measure import OtherLoad, env_str  # noqa: E402
from server_harness import LiveServer, start_server  # noqa: E402

POLICIES = ("fcfs", "priority", "slo")


def start(policy: str, keys: Path, log: Path, args) -> LiveServer:
    """A fresh server on the embedded model, with torch's default threads (the harness's tests use one)."""
    return start_server(None, log, "--api-keys-file", str(keys), "--scheduling-policy", policy, "--max-model-len",
                        str(args.max_model_len), *args.server_args.split(), timeout=300, one_thread=False,
                        port=_servers.next_port())


def write_files(tmp: Path, args) -> tuple[Path, Path]:
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "interactive", "keys": ["sk-interactive"], "priority": 0,
         "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms}},
        {"name": "batch", "keys": ["sk-batch"], "priority": 1},
    ]}))
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [
        {"name": "interactive", "api_key": "sk-interactive", "request_rate": args.interactive_rate,
         "num_prompts": args.interactive_requests, "goodput": {"ttft": args.ttft_ms, "tpot": args.tpot_ms},
         "dataset_params": {"random_input_len": args.interactive_input, "random_output_len": args.interactive_output,
                            "random_range_ratio": 0.3}},
        {"name": "batch", "api_key": "sk-batch", "request_rate": "inf", "num_prompts": args.batch_requests,
         "dataset_params": {"random_input_len": args.batch_input, "random_output_len": args.batch_output,
                            "random_range_ratio": 0.1}},
    ]}))
    return keys, tenants


def run_policy(policy: str, tmp: Path, keys: Path, tenants: Path, args) -> dict:
    from tokenmill.bench.serve_bench import main as bench

    server = start(policy, keys, tmp / f"server-{policy}.log", args)
    try:
        out = tmp / f"{policy}.json"
        other = OtherLoad()
        rc = bench(["serve", "--base-url", server.url(""), "--tenants", str(tenants), "--num-warmups", "2",
                    "--seed", str(args.seed), "--result-json", str(out), "--disable-tqdm"])
        if rc != 0:
            raise RuntimeError(f"bench failed under {policy}:\n{server.log()[-3000:]}")
        result = json.loads(out.read_text())
        result["other_cores"] = other.cores()
        return result
    finally:
        server.stop()


def figures(result: dict) -> dict:
    t = {x["name"]: x for x in result["tenants"]}
    i, b = t["interactive"]["summary"], t["batch"]["summary"]
    return {"attainment": t["interactive"]["slo_attainment"], "goodput": i["goodput"]["request_rate"],
            "ttft_p50": i["ttft_ms"]["median"], "ttft_p99": i["ttft_ms"]["p99"], "tpot_p50": i["tpot_ms"]["median"],
            "tpot_p99": i["tpot_ms"]["p99"], "batch_tok_s": b["total_token_throughput"],
            "batch_s": b["duration_s"], "failed": i["failed"] + b["failed"], "other": result["other_cores"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--ttft-ms", type=float, default=1500, help="interactive TTFT target (default: for a 2-core CPU)")
    p.add_argument("--tpot-ms", type=float, default=300, help="interactive TPOT target (default: for a 2-core CPU)")
    p.add_argument("--interactive-rate", type=float, default=1.0, help="requests/s")
    p.add_argument("--interactive-requests", type=int, default=30)
    p.add_argument("--interactive-input", type=int, default=96)
    p.add_argument("--interactive-output", type=int, default=48)
    p.add_argument("--batch-requests", type=int, default=24)
    p.add_argument("--batch-input", type=int, default=1200)
    p.add_argument("--batch-output", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="more `tokenmill serve` flags, one string")
    p.add_argument("--json", help="write the figures here")
    _servers.add_port_argument(p)
    args = p.parse_args()
    _servers.install(args.port)

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        keys, tenants = write_files(tmp, args)
        rows = {}
        for policy in args.policies:
            before = env_str()
            rows[policy] = figures(run_policy(policy, tmp, keys, tenants, args))
            rows[policy]["env"] = before
            print(f"{policy}: {rows[policy]}", flush=True)

    print(f"\ninteractive: {args.interactive_requests} x ~{args.interactive_input} tokens -> {args.interactive_output}"
          f" at {args.interactive_rate}/s, SLO TTFT <= {args.ttft_ms:.0f} ms and TPOT <= {args.tpot_ms:.0f} ms; "
          f"batch: {args.batch_requests} x ~{args.batch_input} -> {args.batch_output}, all at once, no SLO")
    head = (f"{'policy':<9}{'SLO met':>8}{'goodput/s':>10}{'TTFT p50':>9}{'p99':>7}{'TPOT p50':>9}{'p99':>6}"
            f"{'batch tok/s':>12}{'batch s':>8}{'failed':>7}  vs fcfs: goodput, batch")
    print(head)
    base = rows.get("fcfs")
    for policy, r in rows.items():
        ratio = ""
        if base is not None and base["goodput"] and base["batch_tok_s"]:
            g = (r["goodput"] or 0) / base["goodput"]
            ratio = f"  {g:.2f}x, {r['batch_tok_s'] / base['batch_tok_s']:.2f}x"
        elif base is not None:
            ratio = f"  fcfs goodput 0 (this: {r['goodput'] or 0:.3f}/s), {r['batch_tok_s'] / base['batch_tok_s']:.2f}x"
        print(f"{policy:<9}{100 * (r['attainment'] or 0):>7.0f}%{r['goodput'] or 0:>10.3f}{r['ttft_p50'] or 0:>9.0f}"
              f"{r['ttft_p99'] or 0:>7.0f}{r['tpot_p50'] or 0:>9.0f}{r['tpot_p99'] or 0:>6.0f}"
              f"{r['batch_tok_s']:>12.0f}{r['batch_s']:>8.1f}{r['failed']:>7}{ratio}   {r['env']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

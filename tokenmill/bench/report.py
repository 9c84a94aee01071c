"""The result JSON (schema in result_schema.json, described in docs/bench.md), the text summary
printed after a run, and `compare` of several result files."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from tokenmill import __version__
from tokenmill.bench.client import RequestRecord
from tokenmill.bench.metrics import Summary
from tokenmill.bench.prometheus import ServerStats

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("result_schema.json")


def record_json(r: RequestRecord) -> dict[str, Any]:
    return {
        "index": r.index, "start_s": r.start, "end_s": r.end, "e2el_s": r.e2el, "ttft_s": r.ttft,
        "itl_s": list(r.itl), "prompt_len": r.prompt_len, "output_len": r.output_len,
        "input_tokens": r.input_tokens, "output_tokens": r.output_tokens, "token_source": r.token_source,
        "chunks": r.chunks, "cached_tokens": r.cached_tokens, "success": r.success,
        "error": None if r.error is None else {"type": r.error.type, "status": r.error.status,
                                               "message": r.error.message},
    }


def build_result(config: dict[str, Any], summary: Summary, server: ServerStats | None,
                 records: Sequence[RequestRecord], started_at: str) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "tokenmill bench serve",
        "tokenmill_version": __version__,
        "started_at": started_at,
        "config": config,
        "summary": asdict(summary),
        "server": asdict(server) if server is not None else None,
        "requests": [record_json(r) for r in records],
    }


def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def write_result(result: dict[str, Any], path: str) -> None:
    # allow_nan=False: the file must be strict JSON that any reader accepts.
    Path(path).write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def load_result(path: str) -> dict[str, Any]:
    result = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(result, dict) or "summary" not in result:
        raise ValueError(f"{path}: not a tokenmill bench result (no 'summary')")
    return result


# ---- formatting ---------------------------------------------------------------------------------
def get_path(result: dict[str, Any], path: str) -> Any:
    node: Any = result
    for key in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def fmt_value(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:,.{digits}f}"
    return str(value)


# (label, path in the result, digits); a None path is a section heading.
ROWS: list[tuple[str, str | None, int]] = [
    ("Requests", None, 0),
    ("Completed", "summary.completed", 0),
    ("Failed", "summary.failed", 0),
    ("Duration (s)", "summary.duration_s", 2),
    ("Peak concurrency", "summary.peak_concurrency", 0),
    ("Mean concurrency", "summary.mean_concurrency", 2),
    ("Throughput", None, 0),
    ("Requests/s", "summary.request_throughput", 3),
    ("Input tokens/s", "summary.input_throughput", 1),
    ("Output tokens/s", "summary.output_throughput", 1),
    ("Total tokens/s", "summary.total_token_throughput", 1),
    ("Goodput (req/s)", "summary.goodput.request_rate", 3),
    ("Input tokens", "summary.total_input_tokens", 0),
    ("Output tokens", "summary.total_output_tokens", 0),
]
for _metric, _short, _title in (("ttft_ms", "TTFT", "Time to first token"),
                                ("tpot_ms", "TPOT", "Time per output token"),
                                ("itl_ms", "ITL", "Inter-token latency"), ("e2el_ms", "E2EL", "End-to-end latency")):
    ROWS.append((_title, None, 0))
    ROWS += [(f"{_short} {k} (ms)", f"summary.{_metric}.{k}", 2)
             for k in ("mean", "median", "p90", "p95", "p99", "max")]
ROWS += [
    ("Server", None, 0),
    ("Prefix cache hit rate", "server.prefix_cache_hit_rate", 3),
    ("Preemptions", "server.preemptions", 0),
    ("Spec. decoding acceptance rate", "server.spec_acceptance_rate", 3),
    ("Spec. decoding mean acceptance length", "server.spec_mean_acceptance_length", 2),
    ("Cost (USD)", None, 0),
    ("Cost of the run", "summary.cost.total_usd", 4),
    ("Cost per request", "summary.cost.per_request_usd", 6),
    ("Cost per 1M input tokens", "summary.cost.per_1m_input_tokens_usd", 4),
    ("Cost per 1M output tokens", "summary.cost.per_1m_output_tokens_usd", 4),
]


def format_summary(result: dict[str, Any]) -> str:
    """The human-readable table printed after `bench serve`."""
    cfg = result.get("config") or {}
    width = 44
    lines = [f" tokenmill bench serve: {cfg.get('model')} @ {cfg.get('base_url')} ".center(width + 14, "=")]
    lines.append(f"{'Dataset':<{width}}{cfg.get('dataset')}  ({cfg.get('endpoint')})")
    lines.append(f"{'Request rate / max concurrency':<{width}}{fmt_value(cfg.get('request_rate'))} / "
                 f"{fmt_value(cfg.get('max_concurrency'))}")
    for label, path, digits in ROWS:
        if path is None:
            lines.append(f"{'-' * 4} {label} ".ljust(width + 14, "-"))
        else:
            lines.append(f"{label:<{width}}{fmt_value(get_path(result, path), digits):>14}")
    errors = get_path(result, "summary.errors.by_type") or {}
    if errors:
        lines.append(f"{'-' * 4} Errors ".ljust(width + 14, "-"))
        lines += [f"{key:<{width}}{count:>14}" for key, count in errors.items()]
    lines.append("=" * (width + 14))
    return "\n".join(lines)


COMPARE_ROWS: list[tuple[str, str, int]] = [
    (label, path, digits) for label, path, digits in ROWS if path is not None and not path.endswith(".max")
]


def compare(paths: Sequence[str], loader: Callable[[str], dict[str, Any]] = load_result) -> str:
    """The same metrics of several result files side by side; each later file also gets a ratio
    column, its value divided by the first file's."""
    if not paths:
        raise ValueError("compare needs at least one result file")
    results = [loader(p) for p in paths]
    labels = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    header = ["metric"] + [labels[0]]
    for lab in labels[1:]:
        header += [lab, f"{lab}/{labels[0]}"]
    rows = [header]
    for label, path, digits in COMPARE_ROWS:
        base = get_path(results[0], path)
        row = [label, fmt_value(base, digits)]
        for res in results[1:]:
            v = get_path(res, path)
            ok = isinstance(v, (int, float)) and isinstance(base, (int, float)) and base != 0
            row += [fmt_value(v, digits), f"{v / base:.2f}x" if ok else "-"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)

"""One self-contained HTML page from a result: the summary table and five plots as inline SVG
(matplotlib, Agg backend), so the page opens in a browser without network access."""
from __future__ import annotations

import html
import io
import math
from pathlib import Path
from typing import Any, Callable

from tokenmill.bench.client import RequestError, RequestRecord
from tokenmill.bench.metrics import concurrency_steps, duration, throughput_timeline
from tokenmill.bench.report import ROWS, fmt_value, get_path

PLOTS = ("TTFT distribution", "ITL distribution", "Latency over time", "Throughput over time",
         "TTFT vs prompt length")


def records_from_result(result: dict[str, Any]) -> list[RequestRecord]:
    out = []
    for r in result.get("requests") or []:
        err = r.get("error")
        out.append(RequestRecord(
            index=r["index"], start=r["start_s"], end=r["end_s"], prompt_len=r["prompt_len"],
            output_len=r["output_len"], ttft=r["ttft_s"], itl=list(r["itl_s"]), input_tokens=r["input_tokens"],
            output_tokens=r["output_tokens"], token_source=r["token_source"], chunks=r["chunks"],
            cached_tokens=r["cached_tokens"],
            error=RequestError(err["type"], err["message"], err["status"]) if err else None))
    return out


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--report-html needs matplotlib: pip install 'tokenmill[bench]'") from None
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: smaller, selectable
    import matplotlib.pyplot as plt

    return plt


def _svg(draw: Callable[[Any], None]) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
    try:
        draw(ax)
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    finally:
        plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG needs neither


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _hist(values: list[float], xlabel: str) -> Callable[[Any], None]:
    def draw(ax) -> None:
        if not values:
            return _no_data(ax)
        ax.hist(values, bins=min(60, max(5, int(math.sqrt(len(values))) * 2)), color="#4477aa")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("count")
    return draw


def _latency_over_time(ok: list[RequestRecord]) -> Callable[[Any], None]:
    def draw(ax) -> None:
        if not ok:
            return _no_data(ax)
        ax.scatter([r.start for r in ok], [r.e2el * 1000 for r in ok], s=8, label="E2E latency", color="#4477aa")
        with_ttft = [r for r in ok if r.ttft is not None]
        ax.scatter([r.start for r in with_ttft], [r.ttft * 1000 for r in with_ttft], s=8, label="TTFT",
                   color="#ee6677")
        ax.set_xlabel("request sent at (s)")
        ax.set_ylabel("ms")
        ax.legend(loc="best")
    return draw


def _throughput_over_time(records: list[RequestRecord]) -> Callable[[Any], None]:
    def draw(ax) -> None:
        span = duration(records)
        if not records or span <= 0:
            return _no_data(ax)
        bin_s = max(span / 40, min(1.0, span / 5))  # bins much shorter than an ITL only show spikes
        starts, tokens, _ = throughput_timeline(records, bin_s)
        ax.step(starts, tokens, where="post", color="#4477aa", label="output tokens/s")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("output tokens/s")
        steps = concurrency_steps((r.start, r.end) for r in records)
        twin = ax.twinx()
        twin.step([t for t, _ in steps], [n for _, n in steps], where="post", color="#ee6677",
                  label="requests in flight")
        twin.set_ylabel("requests in flight")
        lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right")
    return draw


def _ttft_vs_prompt(ok: list[RequestRecord]) -> Callable[[Any], None]:
    def draw(ax) -> None:
        pts = [(r.input_tokens, r.ttft * 1000) for r in ok if r.ttft is not None]
        if not pts:
            return _no_data(ax)
        ax.scatter([p for p, _ in pts], [t for _, t in pts], s=8, color="#228833")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms)")
    return draw


def plots(result: dict[str, Any]) -> dict[str, str]:
    """Plot title -> inline SVG."""
    records = records_from_result(result)
    ok = [r for r in records if r.success]
    draws = [
        _hist([r.ttft * 1000 for r in ok if r.ttft is not None], "TTFT (ms)"),
        _hist([g * 1000 for r in ok for g in r.itl], "inter-token latency (ms)"),
        _latency_over_time(ok),
        _throughput_over_time(records),
        _ttft_vs_prompt(ok),
    ]
    return {title: _svg(draw) for title, draw in zip(PLOTS, draws)}


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{padding:2px 12px;border-bottom:1px solid #ddd}
td.num{text-align:right;font-variant-numeric:tabular-nums}th.section{text-align:left;background:#f3f3f3}
figure{margin:1.5em 0}figcaption{font-weight:600;margin-bottom:.3em}svg{max-width:100%;height:auto}
"""


def _summary_table(result: dict[str, Any]) -> str:
    rows = []
    for label, path, digits in ROWS:
        if path is None:
            rows.append(f'<tr><th class="section" colspan="2">{html.escape(label)}</th></tr>')
        else:
            rows.append(f"<tr><td>{html.escape(label)}</td>"
                        f'<td class="num">{html.escape(fmt_value(get_path(result, path), digits))}</td></tr>')
    return "<table>" + "".join(rows) + "</table>"


def _config_table(result: dict[str, Any]) -> str:
    cfg = result.get("config") or {}
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in cfg.items())
    return f"<table>{rows}</table>"


def _error_line(e: dict[str, Any]) -> str:
    status = "" if e.get("status") is None else f" (HTTP {e['status']})"
    return f"request {e['index']}: {e['type']}{status}: {e['message'][:300]}"


def _errors(result: dict[str, Any]) -> str:
    errors = get_path(result, "summary.errors") or {}
    if not errors.get("total"):
        return "<p>No errors.</p>"
    counts = "".join(f'<tr><td>{html.escape(k)}</td><td class="num">{v}</td></tr>'
                     for k, v in errors.get("by_type", {}).items())
    examples = "".join(f"<li>{html.escape(_error_line(e))}</li>" for e in errors.get("examples", []))
    return f"<table>{counts}</table><ul>{examples}</ul>"


def render_html(result: dict[str, Any]) -> str:
    cfg = result.get("config") or {}
    title = f"tokenmill bench: {cfg.get('model')} / {cfg.get('dataset')} / {result.get('started_at')}"
    figures = "".join(f"<figure><figcaption>{html.escape(name)}</figcaption>{svg}</figure>"
                      for name, svg in plots(result).items())
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<h2>Summary</h2>{_summary_table(result)}<h2>Errors</h2>{_errors(result)}"
            f"<h2>Plots</h2>{figures}<h2>Configuration</h2>{_config_table(result)}</body></html>\n")


def write_html(result: dict[str, Any], path: str) -> None:
    Path(path).write_text(render_html(result), encoding="utf-8")

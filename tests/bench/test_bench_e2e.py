"""`tokenmill bench` end to end on a tiny random model: `bench serve` against a live `tokenmill serve`
for every dataset (result JSON against its schema, the HTML report's plots), the bench's medians
against the server's own Prometheus histograms, `GET /v1/diagnostics` after traffic, and the
offline `bench throughput` / `bench latency`."""
from __future__ import annotations

import json
import math
import re
import time
import xml.etree.ElementTree as ET

import httpx
import jsonschema
import pytest

from server_harness import start_server
from tiny import make_tiny_model
from tokenmill.bench.html_report import PLOTS
from tokenmill.bench.prometheus import buckets, parse_prometheus_text
from tokenmill.bench.report import load_schema
from tokenmill.cli import main

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
VERDICTS = ("compute-bound", "bandwidth-bound", "overhead-bound")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench_e2e") / "llama", "llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_CACHE", str(cache))  # the server's calibration for /v1/diagnostics goes here
        # 16-token steps: prefills take many steps, so latencies reach histogram buckets wider than
        # the client's own overhead (see test_medians_agree_with_server_histograms).
        srv = start_server(model_dir, model_dir.parent / "server.log", "--served-model-name", MODEL,
                           "--kv-cache-memory-bytes", "4M", "--max-model-len", "512",
                           "--max-num-batched-tokens", "16")
    srv.calibration_dir = cache
    yield srv
    assert srv.stop() == 0, srv.log()


def bench_serve(server, model_dir, out_dir, name: str, *flags: str, html: bool = True) -> tuple[dict, str | None]:
    """Run `tokenmill bench serve` in-process; the validated result and the HTML page."""
    out_json, out_html = out_dir / f"{name}.json", out_dir / f"{name}.html"
    argv = ["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(model_dir), "--disable-tqdm",
            "--result-json", str(out_json), *flags]
    assert main(argv + (["--report-html", str(out_html)] if html else [])) == 0
    result = json.loads(out_json.read_text())
    jsonschema.validate(result, load_schema())
    return result, out_html.read_text() if html else None


# ---- the HTML report's figures --------------------------------------------------------------------
SVG_NS = "{http://www.w3.org/2000/svg}"
FIGURE = re.compile(r"<figure><figcaption>(.*?)</figcaption>\s*(<svg\b.*?</svg>)\s*</figure>", re.S)


def _numbers(path_d: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", path_d)]


def _group(root: ET.Element, gid: str) -> ET.Element | None:
    return next((g for g in root.iter(SVG_NS + "g") if g.get("id") == gid), None)


def _texts(el: ET.Element) -> list[str]:
    return [t.text.strip() for t in el.iter(SVG_NS + "text") if t.text and t.text.strip()]


def figure_content(svg: str) -> dict:
    """What a matplotlib SVG draws: the texts of its x and y axes (tick labels and axis label), all
    texts, histogram bars of non-zero height, scatter points, and the y values of each data line."""
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    axes = {}
    for n, name in ((1, "x"), (2, "y")):
        axes[name] = [t for g in root.iter(SVG_NS + "g") if g.get("id") == f"matplotlib.axis_{n}" for t in _texts(g)]
    legend = {id(e) for g in root.iter(SVG_NS + "g") if (g.get("id") or "").startswith("legend") for e in g.iter()}
    bars = 0
    points = 0
    lines = []
    for g in root.iter(SVG_NS + "g"):
        gid = g.get("id") or ""
        if id(g) in legend:  # the legend's sample markers and lines are not data
            continue
        if gid.startswith("patch_"):
            for p in g.iter(SVG_NS + "path"):
                ys = _numbers(p.get("d", ""))[1::2]
                if "#4477aa" in (p.get("style") or "") and ys and max(ys) > min(ys):
                    bars += 1
        elif gid.startswith("PathCollection"):
            points += sum(1 for _ in g.iter(SVG_NS + "use"))
        elif gid.startswith("line2d"):
            for p in g.iter(SVG_NS + "path"):
                if p.get("clip-path"):  # data lines are clipped to the axes; tick marks are not
                    lines.append(_numbers(p.get("d", ""))[1::2])
    return {"axes": axes, "texts": _texts(root), "bars": bars, "points": points, "lines": lines}


def check_report(page: str, result: dict) -> None:
    """Five inline SVG figures with their titles, labelled axes with ticks, and the data drawn."""
    assert not re.search(r'(src|href)\s*=\s*"https?:', page) and "<img" not in page  # self-contained, no PNG
    figures = dict(FIGURE.findall(page))
    assert list(figures) == list(PLOTS) and page.count("<svg") == len(PLOTS)
    ok = [r for r in result["requests"] if r["success"]]
    with_ttft = [r for r in ok if r["ttft_s"] is not None]
    assert with_ttft, "no request produced text: nothing to plot"
    labels = {  # title: (x label, y labels)
        "TTFT distribution": ("TTFT (ms)", ["count"]),
        "ITL distribution": ("inter-token latency (ms)", ["count"]),
        "Latency over time": ("request sent at (s)", ["ms"]),
        "Throughput over time": ("time (s)", ["output tokens/s", "requests in flight"]),
        "TTFT vs prompt length": ("prompt tokens", ["TTFT (ms)"]),
    }
    for title, svg in figures.items():
        c = figure_content(svg)
        xlabel, ylabels = labels[title]
        assert xlabel in c["axes"]["x"], (title, c["axes"])
        assert all(y in c["texts"] for y in ylabels) and ylabels[0] in c["axes"]["y"], (title, c["axes"])
        for axis, texts in c["axes"].items():  # at least two numeric tick labels on each axis
            assert sum(bool(re.fullmatch(r"[−-]?[\d.,]+(e[−-]?\d+)?", t)) for t in texts) >= 2, (title, axis, texts)
        assert "no data" not in c["texts"], title
        if title.endswith("distribution"):
            assert c["bars"] >= 1, title
        elif title == "Latency over time":
            assert c["points"] == len(ok) + len(with_ttft) and {"E2E latency", "TTFT"} <= set(c["texts"])
        elif title == "TTFT vs prompt length":
            assert c["points"] == len(with_ttft)
        else:  # output tokens/s and requests in flight as step lines that actually vary
            assert len(c["lines"]) >= 2 and all(len(set(ys)) > 1 for ys in c["lines"]), c["lines"]


# ---- every dataset --------------------------------------------------------------------------------
FILE_ENTRIES = [
    {"prompt": "The quick brown fox", "max_tokens": 6},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to ten."}]},
    {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "It is four."}]},
    {"prompt": "SELECT * FROM users WHERE id = 42;", "max_tokens": 5},
]
DATASETS = {  # dataset: (flags, requests)
    "random": (["--random-input-len", "48", "--random-output-len", "8", "--random-range-ratio", "0.5",
                "--num-prompts", "7", "--max-concurrency", "4"], 7),
    "shared-prefix": (["--shared-prefix-num-prefixes", "2", "--shared-prefix-prefix-len", "96",
                       "--shared-prefix-suffix-len", "8", "--shared-prefix-output-len", "6",
                       "--num-prompts", "8", "--max-concurrency", "2"], 8),
    "long-context": (["--long-context-input-len", "400", "--long-context-output-len", "4", "--num-prompts", "3"], 3),
    "long-decode": (["--long-decode-input-len", "8", "--long-decode-output-len", "48", "--num-prompts", "4"], 4),
    "file": (["--endpoint", "chat", "--num-prompts", "6", "--request-rate", "50"], 6),
}


@pytest.mark.parametrize("dataset", list(DATASETS))
def test_bench_serve_every_dataset(server, model_dir, tmp_path, dataset, capsys):
    flags, n = DATASETS[dataset]
    if dataset == "file":
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in FILE_ENTRIES))
        flags = flags + ["--dataset-path", str(path)]
    result, page = bench_serve(server, model_dir, tmp_path, dataset, "--dataset", dataset, *flags)
    assert "TTFT median (ms)" in capsys.readouterr().out

    cfg, s, srv, reqs = result["config"], result["summary"], result["server"], result["requests"]
    assert cfg["dataset"] == dataset and cfg["model"] == MODEL and cfg["num_prompts"] == n
    assert (s["num_requests"], s["completed"], s["failed"]) == (n, n, 0), s["errors"]
    assert s["token_sources"] == {"usage": n}
    if dataset == "file":
        # No ignore_eos for real prompts: the model may stop early. Chat prompts carry the template.
        assert [r["output_len"] for r in reqs] == [6, 256, 8, 5, 6, 256]  # max_tokens, default, ShareGPT reply
        assert all(1 <= r["output_tokens"] <= r["output_len"] for r in reqs)
        assert all(r["input_tokens"] > r["prompt_len"] for r in reqs)
    else:
        # --tokenizer makes prompt lengths exact, and ignore_eos output lengths.
        assert all(r["input_tokens"] == r["prompt_len"] and r["output_tokens"] == r["output_len"] for r in reqs)
    # The server's counters over the run agree with the client's token counts (warm-up excluded).
    assert srv["scraped"] and srv["metric_prefix"] == "tokenmill" and srv["preemptions"] == 0
    assert srv["prompt_tokens"] == s["total_input_tokens"]
    assert srv["generation_tokens"] == s["total_output_tokens"]
    if dataset == "shared-prefix":
        assert srv["prefix_cache_hit_rate"] > 0.3 and s["cached_prompt_tokens"] > 0
    if dataset == "long-decode":
        # One gap per content chunk after the first. A byte-level BPE model with random weights emits
        # partial UTF-8 characters, which the server holds back until complete: fewer chunks than tokens.
        assert s["itl_ms"]["count"] == sum(r["chunks"] - 1 for r in reqs) == sum(len(r["itl_s"]) for r in reqs)
        assert all(r["chunks"] <= r["output_tokens"] for r in reqs)
        assert s["fewer_chunks_than_tokens"] == sum(r["chunks"] < r["output_tokens"] for r in reqs)
    check_report(page, result)


# ---- the bench's medians against the server's histograms ----------------------------------------------
def _bucket_index(les: list[float], value: float) -> int:
    """Index of the Prometheus bucket (le is an inclusive upper bound) that holds `value`."""
    return next(i for i, le in enumerate(les) if value <= le)


def test_medians_agree_with_server_histograms(server, model_dir, tmp_path):
    # No warm-up, so the scrapes around the run hold exactly the measured requests; a seed of its own,
    # so no prompt is in the prefix cache from an earlier test. An odd count
    # makes the bench's median (numpy) and the histogram's (rank n/2) the same order statistic.
    n = 7
    before = parse_prometheus_text(httpx.get(server.url("/metrics")).text)
    result, _ = bench_serve(server, model_dir, tmp_path, "medians", "--dataset", "random", "--random-input-len", "400",
                            "--random-output-len", "16", "--num-prompts", str(n), "--num-warmups", "0", "--seed", "11",
                            html=False)
    after = parse_prometheus_text(httpx.get(server.url("/metrics")).text)
    assert result["summary"]["completed"] == n
    for metric, ours, theirs in (("time_to_first_token_seconds", "ttft_ms", "ttft_median_s"),
                                 ("e2e_request_latency_seconds", "e2el_ms", "e2el_median_s")):
        b0, b1 = buckets(before, f"tokenmill:{metric}"), buckets(after, f"tokenmill:{metric}")
        les = sorted(b1)
        cumulative = [b1[le] - b0.get(le, 0.0) for le in les]
        assert cumulative[-1] == n and math.isinf(les[-1])
        server_bucket = next(i for i, c in enumerate(cumulative) if c >= n / 2)
        # The bench's own reading of the same histograms (Prometheus' interpolation) lands in that bucket.
        assert _bucket_index(les, result["server"][theirs]) == server_bucket
        bench_bucket = _bucket_index(les, result["summary"][ours]["median"] / 1000)
        # The client's interval holds the server's: it starts before the request is sent and ends
        # after the token reached the client, while the server's starts once the request is parsed
        # and tokenized and ends when the engine produced the token. So every client time is the
        # server's plus network, HTTP, tokenization and event-loop time — a few ms, never negative —
        # which can push the median over a bucket edge: the same bucket or the next one up.
        assert bench_bucket - server_bucket in (0, 1), (metric, result["summary"][ours]["median"],
                                                         les[server_bucket], cumulative)


# ---- where the time goes ------------------------------------------------------------------------------
def test_diagnostics_after_traffic(server):
    def complete(prompt: str) -> None:
        r = httpx.post(server.url("/v1/completions"), timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text

    complete("The quick brown fox")
    time.sleep(0.5)
    complete("Paged attention")  # one prefill step, then seven decode steps
    prompt_tokens = httpx.post(server.url("/tokenize"), json={"prompt": "Paged attention"}).json()["count"]
    d = httpx.get(server.url("/v1/diagnostics"), timeout=60).json()
    assert {"steps", "tokens", "time_s", "time_share", "tokens_per_step", "achieved", "roofline", "peaks",
            "verdict", "reason"} <= set(d)
    assert d["verdict"] in VERDICTS and d["reason"]
    assert d["steps"] >= 16 and d["tokens"] >= 16 and d["tokens_per_step"] == pytest.approx(d["tokens"] / d["steps"])
    t = d["time_s"]
    phases = ("schedule", "offload", "prepare", "forward", "sample", "detokenize")
    assert t["busy"] == pytest.approx(sum(t[k] for k in phases))
    assert t["total"] == pytest.approx(t["busy"] + t["idle"])
    assert all(t[k] >= 0 for k in phases + ("idle",)) and t["forward"] > 0
    assert set(d["time_share"]) == set(phases) | {"idle"} and sum(d["time_share"].values()) == pytest.approx(1.0)
    assert t["idle"] >= 0.5  # the pause between the two requests
    assert d["achieved"]["flops_per_s"] > 0 and d["achieved"]["bytes_per_s"] > 0
    assert d["peaks"]["flops"] > 0 and d["peaks"]["bandwidth"] > 0
    assert (server.calibration_dir / "calibration.json").is_file()  # calibrated once, cached where told
    # The last request's steps alone: its own busy time, not the idle time before it.
    last = httpx.get(server.url("/v1/diagnostics"), params={"last_n": 8}, timeout=60).json()
    assert last["steps"] == 8 and last["tokens"] == prompt_tokens + 7 and last["verdict"] in VERDICTS
    assert last["time_s"]["idle"] < 0.25


# ---- offline: bench throughput and bench latency ----------------------------------------------------
@pytest.mark.parametrize("command", [
    ["throughput", "--num-prompts", "4", "--input-len", "24", "--output-len", "6", "-q"],
    ["latency", "--input-len", "24", "--output-len", "6", "--num-iters", "2"],
])
def test_offline_bench_reports_verdict(model_dir, tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out.json"
    rc = main(["bench", command[0], str(model_dir), "--max-model-len", "128", "--num-gpu-blocks-override", "64",
               *command[1:], "--output-json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "where the time went" in printed
    verdict = re.search(r"verdict: (\S+)", printed).group(1)
    assert verdict in VERDICTS and json.loads(out.read_text())["diagnostics"]["verdict"] == verdict
    assert (tmp_path / "cache" / "calibration.json").is_file()
    assert ("output tokens/s" if command[0] == "throughput" else "TTFT median") in printed

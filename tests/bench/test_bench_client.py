"""tokenmill bench client: SSE parsing, arrivals, payloads, errors, and end-to-end runs against a
fake streaming server with known delays (tests/fake_openai_server.py)."""
import asyncio
import json
import math
import re
import socket

import jsonschema
import numpy as np
import pytest

from fake_openai_server import FakeConfig, FakeServer
from tokenmill.bench.client import (ClientConfig, LoadConfig, api_root, arrival_offsets, build_payload,
                                    error_from_body, run_benchmark)
from tokenmill.bench.datasets import BenchRequest, encode
from tokenmill.bench.html_report import PLOTS
from tokenmill.bench.metrics import summarize
from tokenmill.bench.report import load_schema
from tokenmill.bench.serve_bench import main
from tokenmill.bench.sse import SSEDecoder, parse_sse


# ---- SSE ----------------------------------------------------------------------------------------
def test_parse_sse():
    lines = ['data: {"a": 1}', "", ": keep-alive", "", "event: message", "id: 7", 'data: {"b":', "data: 2}", "",
             "data:[DONE]", ""]
    assert parse_sse(lines) == ['{"a": 1}', '{"b":\n2}', "[DONE]"]
    assert parse_sse(["data: x\r", "\r", "data:  two spaces"]) == ["x", " two spaces"]  # no final blank line
    assert parse_sse(["data", ""]) == [""]
    assert parse_sse([": only a comment", ""]) == []


def test_sse_decoder_is_incremental():
    dec = SSEDecoder()
    assert dec.feed("data: 1") is None
    assert dec.feed("") == "1"
    assert dec.feed("") is None  # blank lines without data dispatch nothing
    assert dec.flush() is None


# ---- arrivals, payloads, errors ----------------------------------------------------------------
def test_arrival_offsets():
    assert list(arrival_offsets(3, math.inf)) == [0, 0, 0]
    a = arrival_offsets(20000, request_rate=10.0, seed=3)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.mean(np.diff(a)) == pytest.approx(0.1, rel=0.03)
    assert np.array_equal(a, arrival_offsets(20000, 10.0, seed=3))
    assert not np.array_equal(a, arrival_offsets(20000, 10.0, seed=4))
    for shape in (0.5, 1.0, 4.0):  # gamma gaps: mean 1/rate, coefficient of variation 1/sqrt(shape)
        gaps = np.diff(arrival_offsets(20000, 10.0, burstiness=shape, seed=0))
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(shape), rel=0.05)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_build_payload():
    req = BenchRequest(prompt="hi there", output_len=7)
    cfg = ClientConfig(base_url="http://h:1/v1", model="m")
    body = build_payload(cfg, req)
    assert body == {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "prompt": "hi there",
                    "max_tokens": 7, "ignore_eos": True, "temperature": 0.0}
    assert cfg.url == "http://h:1/v1/completions"
    chat = ClientConfig(base_url="http://h:1/", model="m", endpoint="chat", ignore_eos=False, temperature=None,
                        extra_body={"top_k": 5, "temperature": 0.7})
    body = build_payload(chat, req)
    assert body["messages"] == [{"role": "user", "content": "hi there"}] and "ignore_eos" not in body
    assert body["top_k"] == 5 and body["temperature"] == 0.7 and chat.url == "http://h:1/v1/chat/completions"
    msgs = BenchRequest(messages=[{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
    assert build_payload(cfg, msgs)["prompt"] == "a\nb" and "max_tokens" not in build_payload(cfg, msgs)
    assert api_root("http://h:1/v1/") == api_root("http://h:1") == "http://h:1"


def test_error_from_body_shapes():
    e = error_from_body(400, b'{"error": {"message": "too long", "type": "BadRequestError", "code": 400}}')
    assert (e.type, e.message, e.status, e.key) == ("BadRequestError", "too long", 400, "HTTP 400 BadRequestError")
    e = error_from_body(400, b'{"object": "error", "message": "bad", "type": "invalid_request_error"}')
    assert (e.type, e.message) == ("invalid_request_error", "bad")
    e = error_from_body(422, b'{"detail": [{"loc": ["body"]}]}')
    assert e.type == "HTTP422" and "loc" in e.message
    e = error_from_body(502, b"<html>Bad Gateway</html>")
    assert e.key == "HTTP 502 HTTP502" and "Bad Gateway" in e.message
    e = error_from_body(None, b'{"error": {"type": "EngineDeadError", "message": "x"}}')
    assert e.key == "EngineDeadError"


# ---- end to end against the fake server ---------------------------------------------------------
@pytest.fixture(scope="module")
def fake_server():
    with FakeServer(FakeConfig()) as server:
        yield server


@pytest.fixture
def server(fake_server):
    fake_server.cfg.__dict__.update(FakeConfig().__dict__)  # each test starts from the defaults
    return fake_server


GOOD = [f"prompt {i} " + "word " * (3 + i) for i in range(8)]


def test_bench_serve_end_to_end(server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    prompts = GOOD + ["FAIL400 x", "FAIL500 y", "FAILSTREAM z"]
    data.write_text("".join(json.dumps({"prompt": p, "max_tokens": 5}) + "\n" for p in prompts))
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    rc = main(["serve", "--base-url", server.url, "--dataset", "file", "--dataset-path", str(data),
               "--max-concurrency", "4", "--num-warmups", "1", "--goodput", "ttft:1000", "e2el:5000",
               "--cost-per-hour", "36", "--result-json", str(out_json), "--report-html", str(out_html),
               "--disable-tqdm"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT median (ms)" in printed and "HTTP 500 InternalServerError" in printed

    result = json.loads(out_json.read_text())
    jsonschema.validate(result, load_schema())
    s = result["summary"]
    assert result["config"]["model"] == "fake-model" and result["config"]["ignore_eos"] is False
    assert (s["num_requests"], s["completed"], s["failed"]) == (11, 8, 3)
    assert s["errors"]["by_type"] == {"HTTP 400 BadRequestError": 1, "HTTP 500 InternalServerError": 1,
                                      "EngineDeadError": 1}
    # Server: first chunk after 100 ms, then 4 more 30 ms apart.
    assert 95 <= s["ttft_ms"]["median"] <= 200
    assert 25 <= s["itl_ms"]["median"] <= 60 and s["itl_ms"]["count"] == 8 * 4
    assert 25 <= s["tpot_ms"]["mean"] <= 60
    assert 215 <= s["e2el_ms"]["median"] <= 400
    assert s["peak_concurrency"] == 4
    assert s["total_output_tokens"] == 40 and s["token_sources"] == {"usage": 8}
    assert s["output_throughput"] == pytest.approx(40 / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(8 / s["duration_s"])
    assert 0.4 <= s["duration_s"] <= 3.0  # two waves of four ~0.22 s requests
    assert s["goodput"]["good_requests"] == 8
    assert s["cost"]["per_1m_output_tokens_usd"] == pytest.approx(36 * s["duration_s"] / 3600 / 40 * 1e6)
    words = [len(p.split()) for p in GOOD]
    assert s["cached_prompt_tokens"] == sum(w // 2 for w in words)
    # Warm-up is excluded from the server deltas too: it ran before the first scrape.
    q = sum(words) + 2  # + the FAILSTREAM prompt, which the server admitted
    assert result["server"]["prefix_cache_queries"] == q
    assert result["server"]["prefix_cache_hit_rate"] == pytest.approx((sum(w // 2 for w in words) + 1) / q)
    assert result["server"]["preemptions"] == 0
    assert len(result["requests"]) == 11 and sum(r["success"] for r in result["requests"]) == 8

    sent = server.cfg.requests_seen
    assert len(sent) == 12  # one warm-up + 11
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["max_tokens"] == 5 for b in sent)
    assert all("ignore_eos" not in b for b in sent)

    page = out_html.read_text()
    assert page.count("<svg") == len(PLOTS) == 5
    assert all(title in page for title in PLOTS)
    assert not re.search(r'(src|href)\s*=\s*"https?:', page) and "<link" not in page  # nothing to fetch


def test_tenants_load_together_with_their_own_keys_rates_and_slos(server, tmp_path, capsys):
    """--tenants: each tenant's requests carry its key and body, its SLOs judge its requests only, and the
    result holds a summary per tenant (schema-valid) and the run's goodput against each one's own SLOs."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        "tenants:\n"
        "  - {name: chat, api_key: sk-chat, num_prompts: 6, request_rate: 50, goodput: {ttft: 10000},\n"
        "     dataset_params: {random_input_len: 8, random_output_len: 3}, extra_body: {priority: 0}}\n"
        "  - {name: batch, api_key: sk-batch, num_prompts: 3, goodput: {ttft: 1},\n"
        "     dataset_params: {random_input_len: 20, random_output_len: 5}}\n")
    out_json = tmp_path / "t.json"
    rc = main(["serve", "--base-url", server.url, "--model", "fake-model", "--tenants", str(tenants),
               "--num-warmups", "0", "--result-json", str(out_json), "--disable-tqdm"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "SLO met" in printed and "chat" in printed and "batch" in printed
    result = json.loads(out_json.read_text())
    jsonschema.validate(result, load_schema())
    chat, batch = result["tenants"]
    assert (chat["name"], chat["num_requests"], chat["first_request"]) == ("chat", 6, 0)
    assert (batch["name"], batch["num_requests"], batch["first_request"]) == ("batch", 3, 6)
    assert chat["slo_attainment"] == 1.0 and batch["slo_attainment"] == 0.0  # 100 ms TTFT: never within 1 ms
    assert chat["summary"]["total_output_tokens"] == 6 * 3 and batch["summary"]["total_output_tokens"] == 3 * 5
    assert result["summary"]["num_requests"] == 9 and result["summary"]["goodput"]["good_requests"] == 6
    assert [r["index"] for r in result["requests"]] == list(range(9))
    keys = server.cfg.keys_seen
    bodies = server.cfg.requests_seen
    assert sorted(keys) == ["Bearer sk-batch"] * 3 + ["Bearer sk-chat"] * 6
    assert all((b.get("priority") == 0) == (k == "Bearer sk-chat") for b, k in zip(bodies, keys))
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - {name: x, api_key: k, rate: 3}\n")
    assert main(["serve", "--base-url", server.url, "--model", "fake-model", "--tenants", str(bad),
                 "--disable-tqdm"]) == 2
    assert "unknown keys ['rate']" in capsys.readouterr().err


def test_chat_with_tokenizer_counts_when_no_usage(server, tmp_path, tiny_tokenizer):
    tok_dir = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(str(tok_dir))
    server.cfg.send_usage, server.cfg.api_key = False, "sekrit"
    out_json = tmp_path / "chat.json"
    rc = main(["serve", "--base-url", server.url + "/v1", "--endpoint", "chat", "--api-key", "sekrit",
               "--model", "fake-model", "--tokenizer", str(tok_dir), "--num-prompts", "6", "--random-input-len", "40",
               "--random-output-len", "4", "--result-json", str(out_json), "--disable-tqdm"])
    assert rc == 0
    result = json.loads(out_json.read_text())
    jsonschema.validate(result, load_schema())
    s = result["summary"]
    assert s["completed"] == 6 and s["token_sources"] == {"tokenizer": 6}
    per_request = len(encode(tiny_tokenizer, " tok" * 4))
    assert s["total_output_tokens"] == 6 * per_request
    assert s["total_input_tokens"] == 6 * 40  # exact prompt lengths from the tokenizer
    assert s["ttft_ms"]["min"] >= 95  # the empty role delta that opens the stream is not a token
    assert all(r["chunks"] == 4 for r in result["requests"])
    sent = server.cfg.requests_seen[1:]
    assert all(b["ignore_eos"] is True and b["messages"][0]["role"] == "user" for b in sent)


def test_bad_api_key_fails_the_warmup(server, capsys):
    server.cfg.api_key = "sekrit"
    rc = main(["serve", "--base-url", server.url, "--model", "m", "--api-key", "wrong", "--num-prompts", "2",
               "--random-input-len", "5", "--disable-tqdm"])
    assert rc == 2
    assert "HTTP 401 AuthenticationError" in capsys.readouterr().err


def _run(server_url, requests, **load):
    cfg = ClientConfig(base_url=server_url, model="fake-model", ignore_eos=False)
    return asyncio.run(run_benchmark(cfg, requests, LoadConfig(progress=False, **load)))


def test_multi_token_chunks_and_chunk_estimate(server):
    server.cfg.tokens_per_chunk = 3
    reqs = [BenchRequest(prompt=f"p {i}", prompt_len=2, output_len=6) for i in range(3)]
    recs = _run(server.url, reqs).records
    assert all(r.success and r.chunks == 2 and r.output_tokens == 6 and len(r.itl) == 1 for r in recs)
    assert summarize(recs).fewer_chunks_than_tokens == 3
    server.cfg.send_usage = False
    recs = _run(server.url, reqs).records
    assert all(r.token_source == "estimate" and r.output_tokens == 2 and r.input_tokens == 2 for r in recs)


def test_request_rate_shapes_send_times(server):
    server.cfg.ttft_s, server.cfg.itl_s = 0.0, 0.0
    reqs = [BenchRequest(prompt=f"p {i}", prompt_len=2, output_len=2) for i in range(8)]
    recs = _run(server.url, reqs, request_rate=20.0, seed=5).records
    expected = arrival_offsets(8, 20.0, seed=5)
    starts = np.array([r.start for r in recs])
    assert np.all(np.abs(starts - expected) < 0.05)


def test_timeouts_and_unreachable_servers_are_errors(server, tmp_path):
    server.cfg.ttft_s = 0.5
    reqs = [BenchRequest(prompt="slow", prompt_len=1, output_len=2)] * 2
    cfg = ClientConfig(base_url=server.url, model="m", request_timeout=0.1)
    recs = asyncio.run(run_benchmark(cfg, reqs, LoadConfig(progress=False))).records
    assert [r.error.key for r in recs] == ["Timeout", "Timeout"]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_json = tmp_path / "down.json"
    rc = main(["serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "3",
               "--random-input-len", "5", "--num-warmups", "0", "--result-json", str(out_json), "--disable-tqdm"])
    assert rc == 1
    result = json.loads(out_json.read_text())
    jsonschema.validate(result, load_schema())
    assert result["summary"]["errors"]["by_type"] == {"ConnectError": 3}
    assert result["server"]["scraped"] is False and result["summary"]["ttft_ms"]["median"] is None
    assert main(["serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--disable-tqdm"]) == 2


def test_compare_command(server, tmp_path, capsys):
    paths = []
    for conc in (1, 4):
        path = tmp_path / f"c{conc}.json"
        assert main(["serve", "--base-url", server.url, "--num-prompts", "4", "--random-input-len", "5",
                     "--random-output-len", "3", "--max-concurrency", str(conc), "--num-warmups", "0",
                     "--result-json", str(path), "--disable-tqdm"]) == 0
        paths.append(str(path))
    capsys.readouterr()
    assert main(["compare", *paths]) == 0
    table = capsys.readouterr().out
    assert "c4/c1" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith("Peak concurrency"))
    assert row.split()[-3:] == ["1", "4", "4.00x"]

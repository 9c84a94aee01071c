"""`tokenmill serve --enable-lora`: adapters named by the request's `model`, listed by /v1/models with their parent,
loaded and unloaded at run time behind the API key, six adapters through two slots at once, each answer equal to
transformers + PEFT, and per-adapter metrics."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lora_tiny import make_adapter, peft_greedy
from server_harness import start_server
from tiny import make_tiny_model

KEY = "sk-lora"
PROMPT = [5, 17, 33, 41, 8, 99, 120, 7, 64]
TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_model(root / "base", "llama")
    paths = {name: make_adapter(base, root / name, r=4 + 2 * i, alpha=8, seed=i) for i, name in enumerate("abcdef")}
    import transformers as tf

    from tokenmill import SamplingParams
    from tokenmill.engine.detokenizer import IncrementalDetokenizer

    tok = tf.AutoTokenizer.from_pretrained(base)

    def text(tokens: list[int]) -> str:  # PEFT's tokens as the server turns them into text (a cut-off UTF-8
        detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams())  # sequence at the end is not sent)
        for t in tokens:  # one step at a time, as the engine feeds it
            detok.update([t])
        return detok.output_text

    want = {name: text(peft_greedy(base, p, [PROMPT], TOKENS)[0][0]) for name, p in paths.items()}
    want["base"] = text(peft_greedy(base, None, [PROMPT], TOKENS)[0][0])
    srv = start_server(base, root / "server.log", "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                       "--max-cpu-loras", "3", "--max-lora-rank", "16", "--lora-modules", f"a={paths['a']}",
                       f'{{"name": "b", "path": "{paths["b"]}"}}', "--allow-runtime-lora-updating",
                       "--kv-cache-memory-bytes", "16M", "--max-model-len", "256", api_key=KEY)
    yield srv, paths, want, root
    assert srv.stop() == 0, srv.log()
    # A failed step is rerun request by request: correct answers could hide a broken batched path.
    assert "running them one at a time" not in srv.log(), srv.log()


def complete(srv, model: str) -> httpx.Response:
    return httpx.post(srv.url("/v1/completions"), headers=srv.headers, timeout=60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                            "ignore_eos": True})


def test_models_lists_adapters_with_their_parent(setup):
    srv, _, _, _ = setup
    data = httpx.get(srv.url("/v1/models"), headers=srv.headers, timeout=10).json()["data"]
    cards = {c["id"]: c for c in data}
    assert cards["base"]["parent"] is None
    assert cards["a"]["parent"] == "base" and cards["b"]["parent"] == "base"
    assert "/" not in cards["a"]["root"]  # never a filesystem path
    assert httpx.get(srv.url("/v1/models/a"), headers=srv.headers, timeout=10).json()["parent"] == "base"


def test_startup_adapters_answer_as_peft(setup):
    srv, _, want, _ = setup
    for model in ("a", "b", "base"):
        r = complete(srv, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == want[model], model
    r = complete(srv, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    chat = httpx.post(srv.url("/v1/chat/completions"), headers=srv.headers, timeout=60,
                      json={"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "a"


def test_adapter_metric_labels_are_bounded():
    from tokenmill.engine.output import FinishedRequest
    from tokenmill.serve.metrics import MAX_ADAPTER_LABELS, ServerMetrics

    m = ServerMetrics("base")
    for i in range(MAX_ADAPTER_LABELS + 8):
        m.on_request_finished(FinishedRequest(3, 2, "length", 0.0, 0.1, 0.2, 0.3, adapter=f"ad{i}"))
    text = m.render().decode()
    labels = {line.split('adapter="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("tokenmill:lora_requests_total{")}
    assert len(labels) == MAX_ADAPTER_LABELS + 1 and "other" in labels
    assert 'tokenmill:lora_requests_total{adapter="other",model_name="base"} 8.0' in text


def test_runtime_load_six_adapters_two_slots_concurrently_then_unload(setup):
    srv, paths, want, root = setup
    load = lambda body, headers=srv.headers: httpx.post(srv.url("/v1/load_lora_adapter"), json=body,  # noqa: E731
                                                        headers=headers, timeout=60)
    assert load({"lora_name": "c", "lora_path": str(paths["c"])}, headers={}).status_code == 401
    for name in "cdef":
        r = load({"lora_name": name, "lora_path": str(paths[name])})
        assert r.status_code == 200, r.text
    r = load({"lora_name": "c", "lora_path": str(paths["c"])})
    assert r.status_code == 400 and "already" in r.json()["error"]["message"]
    r = load({"lora_name": "broken", "lora_path": str(root / "missing")})
    # One answer whatever went wrong: it names no path (serve/lora.UNLOADABLE).
    assert r.status_code == 400 and r.json()["error"]["message"] == "lora_path does not name an adapter this server can load."
    assert str(root) not in r.text
    r = load({"lora_name": "base", "lora_path": str(paths["c"])})
    assert r.status_code == 400
    models = ["a", "b", "c", "d", "e", "f", "base"] * 2
    with ThreadPoolExecutor(len(models)) as pool:
        answers = list(pool.map(lambda m: complete(srv, m), models))
    for model, r in zip(models, answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[model], model
    unload = lambda name: httpx.post(srv.url("/v1/unload_lora_adapter"), json={"lora_name": name},  # noqa: E731
                                     headers=srv.headers, timeout=10)
    assert unload("c").status_code == 200
    assert complete(srv, "c").status_code == 404
    assert unload("c").status_code == 404
    names = {c["id"] for c in httpx.get(srv.url("/v1/models"), headers=srv.headers, timeout=10).json()["data"]}
    assert names == {"base", "a", "b", "d", "e", "f"}
    metrics = srv.metrics()
    assert metrics['tokenmill:lora_requests_total{adapter="d"}'] == 2
    assert metrics['tokenmill:lora_generation_tokens_total{adapter="a"}'] >= 2 * TOKENS


def test_bad_startup_adapter_stops_the_server_with_the_reason(tmp_path):
    base = make_tiny_model(tmp_path / "base", "llama")
    bad = make_adapter(base, tmp_path / "big", r=32, alpha=8)
    with pytest.raises(RuntimeError, match="above --max-lora-rank 16"):
        start_server(base, tmp_path / "server.log", "--enable-lora", "--max-lora-rank", "16",
                     "--lora-modules", f"big={bad}", "--kv-cache-memory-bytes", "8M", "--max-model-len", "128")

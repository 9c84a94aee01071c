"""Embeddings from the engine that generates: `LLM.embed` and POST /v1/embeddings on a tiny random Llama, checked
against transformers' final hidden states (after the final norm) pooled the same way; chunked prefill, the prefix
cache (neither poisoned nor poisoning), requests mixed with generation, aborts and KV blocks; the live server with
the official `openai` client (float and base64), its limits and errors."""
from __future__ import annotations

import base64
import importlib.util
import json

import httpx
import numpy as np
import openai
import pytest
import torch

from server_harness import start_server
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.output import EngineError
from tokenmill.sampling_params import PoolingParams

pytestmark = pytest.mark.timeout(300)

MAX_LEN = 128
BUDGET = 16  # tokens per step: a longer input is split over several steps (chunked prefill)
HIDDEN = 64  # tests/tiny.py's hidden_size
RAW = PoolingParams(normalize=False)


def ids_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


INPUTS = [ids_of(5, 1), ids_of(1, 2), ids_of(23, 3), ids_of(70, 4), ids_of(MAX_LEN, 5)]  # 70, 128: several chunks


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("embed") / "llama", "llama")


@pytest.fixture(scope="module")
def hf(path):
    import transformers as tf

    return tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def reference(hf, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last layer after the final norm (AutoModel's last_hidden_state), pooled."""
    with torch.no_grad():
        h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return h[-1] if pooling == "last" else h.mean(0)


@pytest.fixture(scope="module")
def llms(path):
    made = {p: LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=64, max_num_batched_tokens=BUDGET,
                   pooling=p) for p in ("last", "mean")}
    yield made
    for llm in made.values():
        llm.close()


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.groups and not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # no block leaked
    engine.kv.check_invariants()


def run_until_done(engine, ids: set[str], max_steps: int = 500) -> tuple[dict, int]:
    """Step until every request in `ids` finished; returns their outputs and the steps it took."""
    done = {}
    for step in range(1, max_steps + 1):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if ids <= set(done):
            return done, step
    raise AssertionError(f"not finished after {max_steps} steps: {ids - set(done)}")


# ---- the engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_match_transformers(llms, hf, pooling):
    llm = llms[pooling]
    llm.engine.kv.reset_prefix_cache()
    raw = llm.embed(INPUTS, RAW, use_tqdm=False)
    normed = llm.embed(INPUTS, use_tqdm=False)  # the default: L2-normalised
    for ids, r, n in zip(INPUTS, raw, normed):
        ref = reference(hf, ids, pooling)
        assert len(r.embedding) == HIDDEN and r.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(r.embedding), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(n.embedding), torch.nn.functional.normalize(ref, dim=0),
                                   atol=2e-6, rtol=1e-4)
        assert n.outputs.embedding == n.embedding and abs(np.linalg.norm(n.embedding) - 1) < 1e-5
    assert_idle(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_long_input_is_split_by_chunked_prefill(llms, hf, pooling):
    engine = llms[pooling].engine
    engine.kv.reset_prefix_cache()
    ids = INPUTS[3]  # 70 tokens, 16 per step
    engine.add_request("long", None, SamplingParams(max_tokens=1, pooling=RAW), prompt_token_ids=ids)
    done, steps = run_until_done(engine, {"long"})
    assert steps >= -(-len(ids) // BUDGET)  # it took several steps
    torch.testing.assert_close(torch.tensor(done["long"].embedding), reference(hf, ids, pooling), atol=2e-5,
                               rtol=1e-4)
    assert_idle(llms[pooling])


def test_prefix_cache_neither_poisons_nor_is_poisoned(llms, hf):
    """Mean pooling needs every position's hidden state: it reads no cached prefix (and computes the right mean);
    last pooling may read one (the last position is computed over cached K/V). The blocks an embedding request
    computes serve a later generation as well as a generating request's would."""
    prompt = ids_of(60, 7)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for pooling, llm in llms.items():
        llm.engine.kv.reset_prefix_cache()
        solo = llm.generate([prompt], greedy, use_tqdm=False, cache_salt="apart")[0]  # its blocks under a salt
        llm.generate([prompt], greedy, use_tqdm=False)  # names the prompt's blocks in the unsalted cache
        hit = llm.embed([prompt], RAW, use_tqdm=False)[0]
        if pooling == "mean":
            assert hit.num_cached_tokens == 0
        else:
            assert hit.num_cached_tokens >= 48
        torch.testing.assert_close(torch.tensor(hit.embedding), reference(hf, prompt, pooling), atol=2e-5, rtol=1e-4)

        llm.engine.kv.reset_prefix_cache()
        first = llm.embed([prompt], RAW, use_tqdm=False)[0]  # computes and names the prompt's blocks
        assert first.num_cached_tokens == 0
        after = llm.generate([prompt], greedy, use_tqdm=False)[0]  # reads them
        assert after.num_cached_tokens >= 48
        assert after.outputs[0].token_ids == solo.outputs[0].token_ids
        assert_idle(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_beside_generation_change_nothing(llms, hf, pooling):
    """A generating request's greedy tokens are its solo run's while embedding requests share its steps."""
    llm = llms[pooling]
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    prompt = ids_of(9, 11)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    solo = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.kv.reset_prefix_cache()
    engine.add_request("gen", None, greedy, prompt_token_ids=prompt)
    embeds = {f"e{i}": ids for i, ids in enumerate(INPUTS[:4])}
    for rid, ids in embeds.items():
        engine.add_request(rid, None, SamplingParams(max_tokens=1, pooling=RAW), prompt_token_ids=ids)
    first = engine.scheduler.schedule  # record which requests each step ran
    shared = []

    def recording():
        out = first()
        shared.append({r.request_id for r, _ in out.scheduled})
        return out

    engine.scheduler.schedule = recording
    try:
        done, _ = run_until_done(engine, {"gen", *embeds})
    finally:
        del engine.scheduler.schedule
    assert any("gen" in s and len(s) > 1 for s in shared)  # they did share steps
    assert done["gen"].outputs[0].token_ids == solo
    for rid, ids in embeds.items():
        torch.testing.assert_close(torch.tensor(done[rid].embedding), reference(hf, ids, pooling), atol=2e-5,
                                   rtol=1e-4)
    assert_idle(llm)


def test_dimensions_truncate_then_renormalise(llms):
    llm = llms["last"]
    full = llm.embed(INPUTS[:2], RAW, use_tqdm=False)
    cut = llm.embed(INPUTS[:2], PoolingParams(dimensions=16), use_tqdm=False)
    cut_raw = llm.embed(INPUTS[:2], PoolingParams(dimensions=16, normalize=False), use_tqdm=False)
    for f, c, r in zip(full, cut, cut_raw):
        head = np.asarray(f.embedding[:16])
        assert len(c.embedding) == 16 and len(r.embedding) == 16
        np.testing.assert_allclose(c.embedding, head / np.linalg.norm(head), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(r.embedding, head, rtol=1e-6)
    with pytest.raises(ValueError, match="dimensions must be at most the model's hidden size 64"):
        llm.embed(INPUTS[:1], PoolingParams(dimensions=HIDDEN + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    assert_idle(llm)


def test_text_and_token_id_inputs_and_a_request_pooling(llms, hf):
    llm = llms["last"]
    text = "The quick brown fox"
    ids = llm.get_tokenizer()(text).input_ids
    a, b, c = llm.embed([text, ids, {"prompt_token_ids": ids}], use_tqdm=False)
    assert a.prompt == text and a.prompt_token_ids == ids
    np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    np.testing.assert_allclose(a.embedding, c.embedding, atol=1e-6)
    mean = llm.embed([ids], PoolingParams(pooling="mean", normalize=False), use_tqdm=False)[0]  # the request's own
    torch.testing.assert_close(torch.tensor(mean.embedding), reference(hf, ids, "mean"), atol=2e-5, rtol=1e-4)
    assert_idle(llm)


def test_bad_inputs_are_refused(llms):
    llm = llms["last"]
    with pytest.raises(ValueError, match="must be at most max_model_len"):
        llm.embed([ids_of(MAX_LEN + 1, 1)], use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty"):
        llm.embed([""], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[1, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, pooling=PoolingParams())
    with pytest.raises(ValueError, match="prompt_logprobs is not supported"):
        SamplingParams(prompt_logprobs=1, pooling=PoolingParams())
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams(pooling="cls")
    with pytest.raises(ValueError, match="pooling must be one of"):
        LLM(None, pooling="max")
    assert len(llm.embed([ids_of(MAX_LEN, 3)], use_tqdm=False)[0].embedding) == HIDDEN  # max_model_len fits
    assert_idle(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_abort_mid_prompt_frees_its_blocks(llms, pooling):
    engine = llms[pooling].engine
    engine.add_request("gone", None, SamplingParams(max_tokens=1, pooling=PoolingParams()),
                       prompt_token_ids=ids_of(100, 13))
    engine.step()
    engine.step()
    held = engine.scheduler.requests["gone"]
    assert 0 < held.num_computed_tokens < 100 and engine.kv.num_free_blocks < engine.kv.num_blocks
    engine.abort_request("gone")
    engine.step()  # the workers drop their copy
    assert_idle(llms[pooling])


def test_a_failed_embedding_is_an_engine_error(llms, monkeypatch):
    from tokenmill.testing import faults

    llm = llms["last"]
    monkeypatch.setenv(faults.ENV, "update=*")
    with pytest.raises(EngineError, match="failed: the request failed in the engine: InjectedFault"):
        llm.embed([ids_of(20, 2)], use_tqdm=False)
    monkeypatch.delenv(faults.ENV)
    assert_idle(llm)


def test_a_failed_step_neither_loses_nor_garbles_a_mean(llms, hf, monkeypatch):
    """A step that fails after reaching the workers makes them drop its requests' copies: a mean-pooled request
    half-way through its prompt loses its sum there, so it starts its prompt again (and pools every position)."""
    from tokenmill.testing import faults

    engine = llms["mean"].engine
    engine.kv.reset_prefix_cache()
    ids = INPUTS[3]
    engine.add_request("m", None, SamplingParams(max_tokens=1, pooling=RAW), prompt_token_ids=ids)
    engine.step()
    assert engine.scheduler.requests["m"].num_computed_tokens == BUDGET
    monkeypatch.setenv(faults.ENV, "sample=victim")  # raises in the workers, after the batch reached them
    engine.add_request("victim", None, SamplingParams(max_tokens=4), prompt_token_ids=ids_of(5, 9))
    done, _ = run_until_done(engine, {"m", "victim"})
    assert done["victim"].outputs[0].finish_reason == "abort"
    assert engine.scheduler.num_preemptions >= 1
    torch.testing.assert_close(torch.tensor(done["m"].embedding), reference(hf, ids, "mean"), atol=2e-5, rtol=1e-4)
    monkeypatch.delenv(faults.ENV)
    assert_idle(llms["mean"])


@pytest.mark.parametrize("kw", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)], ids=["pp2", "tp2"])
def test_parallel_workers_pool_the_same(path, hf, kw):
    """Two ranks (processes over gloo): the last pipeline stage pools each micro-batch; tensor-parallel ranks hold
    the whole hidden state after the final norm."""
    with LLM(str(path), max_model_len=MAX_LEN, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=BUDGET,
             pooling="mean", **kw) as llm:
        means = llm.embed(INPUTS[:4], RAW, use_tqdm=False)
        lasts = llm.embed(INPUTS[:4], PoolingParams(pooling="last", normalize=False), use_tqdm=False)
        for ids, m, last in zip(INPUTS, means, lasts):
            torch.testing.assert_close(torch.tensor(m.embedding), reference(hf, ids, "mean"), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(torch.tensor(last.embedding), reference(hf, ids, "last"), atol=1e-4,
                                       rtol=1e-4)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is a test extra")
def test_one_token_chunks_pool_in_decode_graphs(path, hf, monkeypatch):
    """An embedding input's last chunk of one token (a one-token input, or one whose prefix is cached) beside
    decodes makes a uniform step, which replays a decode graph (emulated on the CPU): its row is pooled the same."""
    from tokenmill.executor.cuda_graphs import GRAPHS_ENV

    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    with LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=64, attention_backend="triton_paged",
             max_num_seqs=4) as llm:
        engine = llm.engine
        cached = ids_of(33, 41)
        llm.embed([cached], use_tqdm=False)  # names its first two blocks
        engine.add_request("g", None, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           prompt_token_ids=ids_of(5, 42))
        engine.step()  # g decodes from here
        graphs = engine.runner.graphs
        before = graphs.stats.replays
        for rid, ids in (("hit", cached), ("one", [7])):
            engine.add_request(rid, None, SamplingParams(max_tokens=1, pooling=RAW), prompt_token_ids=ids)
        done = {o.request_id: o for o in engine.step() if o.finished}  # one step: g's decode and both inputs
        assert graphs.stats.replays == before + 1 and {"hit", "one"} <= set(done)
        assert done["hit"].num_cached_tokens == 32
        run_until_done(engine, {"g"})
        for rid, ids in (("hit", cached), ("one", [7])):
            torch.testing.assert_close(torch.tensor(done[rid].embedding), reference(hf, ids, "last"), atol=1e-4,
                                       rtol=1e-4)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


# ---- the server ---------------------------------------------------------------------------------
KEY = "sk-embed-0123456789"
MODEL = "tiny"
MAX_INPUTS = 4


ADMIN = {"Authorization": "Bearer sk-embed-admin"}
TIGHT = "sk-embed-tight"  # a tenant with 50 tokens a minute


@pytest.fixture(scope="module")
def server(path):
    keys = path.parent / "keys.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "team-e", "keys": [KEY]},
        {"name": "team-t", "keys": [TIGHT], "limits": {"tokens_per_minute": 50}}]}))
    srv = start_server(path, path.parent / "server.log", "--served-model-name", MODEL, "--kv-cache-memory-bytes",
                       "16M", "--max-model-len", str(MAX_LEN), "--max-prompts", str(MAX_INPUTS),
                       "--max-num-batched-tokens", str(BUDGET), "--api-keys-file", str(keys),
                       "--admin-key", ADMIN["Authorization"][7:], "--usage-db", str(path.parent / "usage.db"))
    yield srv
    assert srv.stop() == 0, srv.log()


def metrics(server) -> dict[str, float]:
    """Every tokenmill sample by name and labels (model_name left out); /metrics takes the admin key here."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url("/metrics"), headers=ADMIN, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for x in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(x.labels.items()) if k != "model_name")
            out[f"{x.name}{{{labels}}}" if labels else x.name] = x.value
    return out


def usage_of(server, key: str) -> dict:
    rows = httpx.get(server.url("/v1/usage"), params={"group_by": "tenant"}, headers={"Authorization": f"Bearer {key}"},
                     timeout=30).json()["data"]
    return rows[0] if rows else {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def tokenize(http, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def normed(hf, ids: list[int]) -> np.ndarray:
    return torch.nn.functional.normalize(reference(hf, ids, "last"), dim=0).numpy()


def test_openai_client_float_and_base64(client, http, hf):
    texts = ["The quick brown fox", "Paged attention stores keys and values in fixed-size blocks."]
    ids = [tokenize(http, t) for t in texts]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    sdk_default = client.embeddings.create(model=MODEL, input=texts)  # base64, which the SDK asks for and decodes
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == [0, 1] and all(d.object == "embedding" for d in floats.data)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for d, s, i in zip(floats.data, sdk_default.data, ids):
        np.testing.assert_allclose(d.embedding, normed(hf, i), atol=2e-6, rtol=1e-4)
        np.testing.assert_allclose(s.embedding, d.embedding, atol=1e-6)
    # One short input, alone in its step, under salts apart (no prefix read): each request computes the same
    # float32s, so base64 must carry exactly the values the float answer prints.
    one = {"model": MODEL, "input": texts[0]}
    f = http.post("/v1/embeddings", json={**one, "encoding_format": "float", "cache_salt": "f"}).json()
    b = http.post("/v1/embeddings", json={**one, "encoding_format": "base64", "cache_salt": "b"}).json()
    sdk = client.embeddings.create(**one, extra_body={"cache_salt": "s"}).data[0].embedding
    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == list(np.float32(f["data"][0]["embedding"])) == list(np.float32(sdk))


def test_token_ids_dimensions_and_normalize(client, http, hf):
    ids = [ids_of(30, 21), ids_of(3, 22)]
    batch = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    for d, i in zip(batch.data, ids):
        np.testing.assert_allclose(d.embedding, normed(hf, i), atol=2e-6, rtol=1e-4)
    np.testing.assert_allclose(one.data[0].embedding, batch.data[1].embedding, atol=1e-6)
    cut = client.embeddings.create(model=MODEL, input=ids, dimensions=8, encoding_format="float")
    for d, i in zip(cut.data, ids):
        head = reference(hf, i, "last").numpy()[:8]
        np.testing.assert_allclose(d.embedding, head / np.linalg.norm(head), atol=2e-6, rtol=1e-4)
    raw = http.post("/v1/embeddings", json={"model": MODEL, "input": ids[0], "normalize": False}).json()
    np.testing.assert_allclose(raw["data"][0]["embedding"], reference(hf, ids[0], "last").numpy(), atol=2e-5,
                               rtol=1e-4)


@pytest.mark.parametrize("body, param, says", [
    ({"input": "hi", "dimensions": HIDDEN + 1}, "dimensions", "hidden size 64"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "at least 1"),
    ({"input": ids_of(MAX_LEN + 1, 5)}, "input", "max_model_len"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", "at most 4 inputs"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": [[1, 2], []]}, "input", "must not be empty"),
    ({"input": [1, 10**6]}, "input", "outside the vocabulary"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": 3.5}, "input", ""),
    ({"input": [[[1]]]}, "input", ""),
    ({"input": ["a", [1, 2]]}, "input", ""),
    ({"input": [-1]}, "input", "outside the vocabulary"),
    ({"input": [2**70]}, "input", "outside the vocabulary"),
    ({"input": [[5] * 100] * 4 + [[5]]}, "input", "at most 4 inputs"),
    ({"input": "hi", "dimensions": True}, "dimensions", ""),
    ({"input": "hi", "dimensions": 2.0}, "dimensions", ""),
    ({"input": "hi", "normalize": "no"}, "normalize", ""),
    ({"input": "x" * (32 * MAX_LEN + 1)}, "input", "--max-input-chars"),
])
def test_bad_requests_answer_400(http, body, param, says):
    r = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and says in error["message"]


def test_unknown_model_and_no_key(server, client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    r = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_embeddings_beside_a_chat_and_the_metrics(server, client):
    """Embeddings and a completion at once over one engine; finished requests and their prompt tokens counted."""
    import concurrent.futures

    before = metrics(server)
    prompt = ids_of(7, 31)
    greedy = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    solo = client.completions.create(**greedy).choices[0].text
    inputs = [ids_of(70, 32), ids_of(40, 33)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        gen = pool.submit(lambda: client.completions.create(**greedy))
        embs = [pool.submit(client.embeddings.create, model=MODEL, input=inputs) for _ in range(3)]
        assert gen.result().choices[0].text == solo
        results = [e.result() for e in embs]
    for r in results[1:]:  # (the later ones may read the first one's prefix: equal within float rounding)
        for d, first in zip(r.data, results[0].data):
            np.testing.assert_allclose(d.embedding, first.embedding, atol=1e-6)
    after = metrics(server)
    key = 'tokenmill:request_success_total{finished_reason="stop"}'
    assert after[key] - before.get(key, 0) >= 3 * len(inputs)
    assert after["tokenmill:prompt_tokens_total"] - before["tokenmill:prompt_tokens_total"] >= 3 * (70 + 40)
    assert metrics(server)["tokenmill:kv_cache_usage_perc"] == 0.0  # every block freed


def test_tenants_are_metered_and_budgeted(server, client):
    before, prom = usage_of(server, KEY), metrics(server)
    out = client.embeddings.create(model=MODEL, input=[ids_of(20, 51), ids_of(9, 52)])
    after = usage_of(server, KEY)
    assert out.usage.prompt_tokens == 29
    assert after["requests"] == before["requests"] + 1
    assert after["prompt_tokens"] - before["prompt_tokens"] == 29
    assert after["completion_tokens"] == before["completion_tokens"]
    key = 'tokenmill:tenant_prompt_tokens_total{tenant="team-e"}'
    assert metrics(server)[key] - prom.get(key, 0) == 29
    tight = openai.OpenAI(base_url=server.url("/v1"), api_key=TIGHT, timeout=60, max_retries=0)
    assert len(tight.embeddings.create(model=MODEL, input=ids_of(20, 53)).data) == 1
    with pytest.raises(openai.RateLimitError):  # 20 of its 50 tokens used: 40 more are over the minute's budget
        tight.embeddings.create(model=MODEL, input=ids_of(40, 54))

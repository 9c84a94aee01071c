"""Speculative decoding end to end: every proposer leaves greedy output exactly as without speculation
(plain, chunked, preempted, prefix-cached, n > 1, stop strings, abort), sampling stays exact, and the
counters report what verification accepted."""
from __future__ import annotations

import pytest

from compare import assert_same_outputs
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "SELECT * FROM users WHERE id = 42; SELECT * FROM",
    "hello",
    "Once upon a time there was a small language model that could count to ten. " * 3,
]
GREEDY = SamplingParams(max_tokens=32, temperature=0, logprobs=2, ignore_eos=True)
KV = dict(kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=1))


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=2, num_hidden_layers=1))


@pytest.fixture(scope="module")
def baseline(target):
    llm = LLM(target, **KV)
    return {name: [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            for name in ("plain",)}["plain"]


def methods(target, small_draft):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "draft_model": {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 4},
        "self_draft": {"method": "draft_model", "model": target, "num_speculative_tokens": 4},
        "quantized_self": {"method": "quantized_self", "num_speculative_tokens": 3},
    }


def run(target, spec: dict, params=GREEDY, prompts=PROMPTS, **kw):
    llm = LLM(target, speculative_config=dict(spec, adaptive=False), **{**KV, **kw})
    out = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return llm, out


@pytest.mark.parametrize("name", ["ngram", "draft_model", "self_draft", "quantized_self"])
@pytest.mark.parametrize("mode", ["plain", "chunked", "preempted"])
def test_greedy_output_equals_no_speculation(target, small_draft, baseline, name, mode):
    kw = {"plain": {}, "chunked": dict(max_num_batched_tokens=24, block_size=4),
          # Few blocks: requests preempt one another mid-generation (drafts' KV slots are rolled back).
          "preempted": dict(num_gpu_blocks_override=44, block_size=4, max_num_batched_tokens=32,
                                        max_model_len=160)}[mode]
    llm, out = run(target, methods(target, small_draft)[name], **kw)
    assert_same_outputs(baseline, out, f"{name}/{mode}")
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0, "no drafts were verified"
    if mode == "preempted":
        assert llm.engine.core.scheduler.num_preemptions > 0
    if name == "self_draft":  # the draft is the target: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.core.kv.usage == 0.0  # every block (drafts' lookahead included) returned


def test_mixed_k_in_one_batch(target, baseline):
    """A small token budget cuts some requests' drafts (k differs per request, 0 included)."""
    llm, out = run(target, {"method": "draft_model", "model": target, "num_speculative_tokens": 5},
                   max_num_batched_tokens=9, max_num_seqs=4)
    assert_same_outputs(baseline, out, "mixed k")
    st = llm.engine.core.scheduler.spec_stats
    assert 0 < st.num_draft_tokens < st.num_drafts * 5  # some verifications had fewer than k drafts


def test_prefix_cache_hits_and_repeats(target, small_draft, baseline):
    """The same prompts twice: the second run's prompts come from the prefix cache, draft KV included."""
    for spec in (methods(target, small_draft)["self_draft"], methods(target, small_draft)["ngram"]):
        llm = LLM(target, speculative_config=dict(spec, adaptive=False), **KV)
        for _ in range(2):
            out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert_same_outputs(baseline, out, spec["method"])
        assert llm.engine.core.kv.stats.hits > 0
        st = llm.engine.core.scheduler.spec_stats
        if spec["model"] if "model" in spec else False:
            assert st.num_accepted_tokens == st.num_draft_tokens


def test_n_greater_than_one_stop_strings_and_logprobs(target):
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    params = SamplingParams(n=2, max_tokens=24, temperature=0, logprobs=3, stop=["ab", "the"])
    base = LLM(target, **KV).generate(PROMPTS, params, use_tqdm=False)
    _, _ = None, None
    llm = LLM(target, speculative_config=dict(spec, adaptive=False), **KV)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(base, got):
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
        assert_same_outputs(a.outputs, b.outputs, "n=2")
    assert llm.engine.core.kv.usage == 0.0


def test_sampling_with_a_perfect_draft_accepts_everything(target):
    """Draft == target at temperature 1 with top-p: q == p, so min(1, p/q) = 1 for every draft."""
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    llm, out = run(target, {"method": "draft_model", "model": target, "num_speculative_tokens": 3}, params)
    st = llm.engine.core.scheduler.spec_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert all(len(o.token_ids) == 24 for o in out)
    # Seeded: the same run gives the same tokens.
    _, again = run(target, {"method": "draft_model", "model": target, "num_speculative_tokens": 3}, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in again]


def test_sampling_with_a_different_draft_runs_and_is_seeded(target, small_draft):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    spec = {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 3}
    llm, a = run(target, spec, params)
    _, b = run(target, spec, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    st = llm.engine.core.scheduler.spec_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens


def _boundary_cases(llm: LLM, prompts: list[str]) -> tuple[list[str], list[SamplingParams], list[int]]:
    """(prompt, params, stop token) per case: for each output position p (3..19) whose greedy token x is new
    to the output, stop on x with min_tokens p or p - 2. Plain decoding then stops at p, so a speculative
    step whose rows straddle min_tokens must ban x on its earlier rows only."""
    free = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    cases = ([], [], [])
    for prompt, o in zip(prompts, llm.generate(prompts, free, use_tqdm=False)):
        out = o.outputs[0].token_ids
        for p in range(3, 20):
            if out[p] not in out[:p]:
                for m in (p, p - 2):
                    cases[0].append(prompt)
                    cases[1].append(SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, min_tokens=m,
                                                   stop_token_ids=[out[p]], logprobs=1))
                    cases[2].append(out[p])
    return cases


@pytest.mark.parametrize("name", ["ngram", "self_draft"])
def test_min_tokens_bans_stop_tokens_by_each_verification_rows_position(target, small_draft, name):
    """Row j of a request verifying k drafts scores output token num_output_tokens + j: min_tokens bans
    stop ids there only while that number is below min_tokens, so output equals plain decoding's."""
    plain = LLM(target, **KV)
    # The prompts again after their own output: n-gram lookups then propose the continuation.
    prompts = PROMPTS + [p + o.outputs[0].text + " " + p for p, o in
                         zip(PROMPTS, plain.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0),
                                                     use_tqdm=False))]
    prompts, params, _ = _boundary_cases(plain, prompts)
    base = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    llm, out = run(target, methods(target, small_draft)[name], params, prompts)
    assert_same_outputs(base, out, f"min_tokens/{name}")
    assert [o.finish_reason for o in base] == [o.finish_reason for o in out]
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0


def test_min_tokens_bans_eos_by_each_verification_rows_position(target, tmp_path):
    """The same with EOS: a copy of the target whose generation_config makes a token greedy decoding
    produces an EOS, with min_tokens just before it."""
    import json
    import shutil

    plain = LLM(target, **KV)
    prompts, params, stops = _boundary_cases(plain, PROMPTS)
    model = tmp_path / "eos_model"
    shutil.copytree(target, model)
    eos = sorted(set(stops))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    params = [SamplingParams(max_tokens=32, temperature=0, min_tokens=p.min_tokens, logprobs=1) for p in params]
    base = [o.outputs[0] for o in LLM(str(model), **KV).generate(prompts, params, use_tqdm=False)]
    assert any(o.finish_reason == "stop" for o in base)
    _, out = run(str(model), {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4}, params,
                 prompts)
    assert_same_outputs(base, out, "min_tokens/eos")


@pytest.mark.parametrize("mode", ["plain", "preempted"])
def test_penalties_count_drafts_as_output_per_row(target, mode):
    """Greedy with every penalty: row j's counts include the j drafts before it (incremental counts plus
    the drafts), and a preempted request's counts are rebuilt from its tokens."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.3, logprobs=2)
    kw = {} if mode == "plain" else dict(num_gpu_blocks_override=44, block_size=4, max_num_batched_tokens=32,
                                         max_model_len=160)
    base = [o.outputs[0] for o in LLM(target, **KV).generate(PROMPTS, params, use_tqdm=False)]
    llm, out = run(target, {"method": "draft_model", "model": target, "num_speculative_tokens": 4}, params, **kw)
    assert_same_outputs(base, out, f"penalties/{mode}")
    st = llm.engine.core.scheduler.spec_stats
    # The draft is the target without penalties: some drafts pass, so rows beyond the first are sampled.
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    if mode == "preempted":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_abort_mid_generation_frees_blocks(target):
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3,
                                          "adaptive": False}, **KV)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.kv.usage == 0.0


def test_metrics_and_diagnostics_report_acceptance(target):
    from tokenmill.serve.metrics import ServerMetrics

    llm, _ = run(target, {"method": "draft_model", "model": target, "num_speculative_tokens": 2})
    core = llm.engine.core
    stats = core.scheduler_stats()
    assert stats.spec["num_draft_tokens"] > 0 and stats.spec["acceptance_rate"] == 1.0
    assert stats.spec["mean_acceptance_length"] == 3.0
    m = ServerMetrics("tiny")
    m.on_iteration(stats, None, [])
    text = m.render().decode()
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"tokenmill:{name}" in text, name
    assert 'position="1"' in text
    d = core.diagnostics()
    assert d["speculative"]["acceptance_rate"] == 1.0


@pytest.mark.parametrize("bad, message", [
    ('{"method": "hydra"}', "unknown speculative method"),
    ('{"method": "medusa"}', "needs a model"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "draft_model"}', "needs a model"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "k": 3}', "unknown speculative_config keys: k"),
    ("{not json", "not valid JSON"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
])
def test_bad_speculative_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_vllm_aliases():
    assert SpeculativeConfig.parse({"method": "deepseek_mtp"}).method == "mtp"
    assert SpeculativeConfig.parse({"model": "/some/draft"}).method == "draft_model"


# ---- draft heads over the target's hidden states: EAGLE, EAGLE-3, MTP ---------------------------------
def _head_spec(method: str, tmp_path, target_dir, copy: bool) -> dict:
    from draft_heads_tiny import add_mtp_layers, write_eagle3_head, write_eagle_head

    if method == "eagle":
        return {"method": "eagle", "model": str(write_eagle_head(tmp_path / "eagle", target_dir, copy=copy))}
    if method == "eagle3":
        return {"method": "eagle3", "model": str(write_eagle3_head(tmp_path / "eagle3", target_dir, copy=copy))}
    add_mtp_layers(target_dir, copy=copy)
    return {"method": "mtp"}


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_copy_head_on_a_bigram_target_accepts_every_draft(tmp_path, method):
    """A head whose weights reproduce the target's next-token choice: every proposal is accepted. EAGLE-3
    carries its own feature forward in the residual stream, so its copy weights hold for the first draft
    only (k=1); EAGLE and MTP copy at every depth."""
    from draft_heads_tiny import make_bigram_target

    target_dir = make_bigram_target(make_tiny_model(tmp_path / "bigram", "llama", seed=3))
    base = [o.outputs[0] for o in LLM(str(target_dir), **KV).generate(PROMPTS, GREEDY, use_tqdm=False)]
    k = 1 if method == "eagle3" else 3
    spec = dict(_head_spec(method, tmp_path, target_dir, copy=True), num_speculative_tokens=k)
    llm, out = run(str(target_dir), spec, max_num_batched_tokens=24, block_size=4)
    assert_same_outputs(base, out, method)
    st = llm.engine.core.scheduler.spec_stats
    assert st.num_draft_tokens > 20 and st.num_accepted_tokens == st.num_draft_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("mode", ["plain", "preempted"])
def test_random_head_leaves_output_unchanged(tmp_path, method, mode):
    target_dir = make_tiny_model(tmp_path / "target", "llama", seed=4)
    base = [o.outputs[0] for o in LLM(str(target_dir), **KV).generate(PROMPTS, GREEDY, use_tqdm=False)]
    spec = dict(_head_spec(method, tmp_path, target_dir, copy=False), num_speculative_tokens=3)
    kw = {} if mode == "plain" else dict(num_gpu_blocks_override=44, block_size=4, max_num_batched_tokens=32,
                                         max_model_len=160)
    llm, out = run(str(target_dir), spec, **kw)
    assert_same_outputs(base, out, f"{method}/{mode}")
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    assert llm.engine.core.kv.usage == 0.0

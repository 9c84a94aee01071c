"""Speculative decoding and structured output on the newer families (Phi-3, Gemma 2, OLMo 2, Granite, GLM-4,
DeepSeek-V2/V3, gpt-oss) on tiny random checkpoints: n-gram drafts and the model drafting for itself (draft_model)
leave greedy tokens and logprobs exactly as without speculation, also chunked by a small token budget, with the
sliding-window layers' blocks released as they slide out (Gemma 2, gpt-oss); a JSON-schema constraint gives an
answer that validates, the same with speculation on as without."""
from __future__ import annotations

import json

import pytest

from compare import assert_same_outputs
from lora_tiny import no_failed_steps  # noqa: F401 (autouse: a failed step, rerun request by request, fails the test)
from test_deepseek import VARIANTS as DEEPSEEK
from test_deepseek import make_deepseek
from test_gpt_oss import make_gpt_oss
from test_model_families import FAMILIES, make_family_model
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

CASES = {
    **{f: (make_family_model, *FAMILIES[f]) for f in ("phi3", "glm4", "gemma2", "olmo2", "granite")},
    "deepseek-v2": (make_deepseek, *DEEPSEEK["v2"]),
    "deepseek-v3": (make_deepseek, *DEEPSEEK["v3"]),
    # Windows of 8, shorter than every prompt; seed 4's greedy tokens vary more than seed 0's (fewer repeats that
    # any draft guesses right).
    "gpt-oss": (lambda path, _: make_gpt_oss(path, seed=4), None, {}),
}
# Families with sliding-window layers: a KV cache group per window, whose blocks are released as they slide out
# (kv_cache.release_out_of_window) while drafts are verified and rolled back.
WINDOWED = {"gemma2", "gpt-oss"}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "SELECT * FROM users WHERE id = 42; SELECT * FROM",
    "Once upon a time there was a small language model that could count to ten. " * 2,
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
JSON = SamplingParams(max_tokens=40, temperature=0,
                      structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
KV = dict(max_model_len=256, num_gpu_blocks_override=96, block_size=8)


@pytest.mark.parametrize("family", sorted(CASES))
def test_speculation_and_json_schema(tmp_path, family):
    import jsonschema

    build, config_class, overrides = CASES[family]
    path = str(build(tmp_path / family, config_class, **overrides))
    plain = LLM(path, **KV)
    want = [o.outputs[0] for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    want_json = [o.outputs[0].text for o in plain.generate(PROMPTS, JSON, use_tqdm=False)]
    for text in want_json:
        jsonschema.validate(json.loads(text), SCHEMA)

    specs = {
        "ngram": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, {}),
        # The model as its own draft: every draft token is accepted, so a wrong rollback or KV slot shows.
        "self draft, chunked": ({"method": "draft_model", "model": path, "num_speculative_tokens": 3},
                                dict(max_num_batched_tokens=16)),
    }
    for label, (spec, kw) in specs.items():
        llm = LLM(path, speculative_config=dict(spec, adaptive=False), **{**KV, **kw})
        got = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert [o.token_ids for o in got] == [o.token_ids for o in want], f"{family} {label}"
        assert_same_outputs(want, got, f"{family} {label}", atol=1e-4)
        stats = llm.engine.core.scheduler.spec_stats
        assert stats.num_draft_tokens > 0, f"{family} {label}: no drafts were verified"
        if spec["method"] == "draft_model":  # the draft is the target: every draft is accepted
            assert stats.num_accepted_tokens == stats.num_draft_tokens, f"{family} {label}"
        # Under the grammar (drafts masked ahead; a batch mixing requests with drafts and without).
        assert [o.outputs[0].text for o in llm.generate(PROMPTS, JSON, use_tqdm=False)] == want_json, label
        kv = llm.engine.core.kv
        assert kv.usage == 0.0  # every block (drafts' lookahead included) returned
        if family in WINDOWED:
            assert len(kv.group_windows) > 1 and kv.num_released > 0, f"{family} {label}: the windows never bit"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_gpt_oss_drafts_with_blocks_reused_after_the_window(tmp_path, method):
    """gpt-oss against transformers with drafts verified and rolled back in a pool so small that the blocks the
    sliding layers release as they slide out of the window are handed to other requests (and requests are
    preempted): a block released one step early, or a draft's slot left in a released block, changes the tokens
    (a roomy pool leaves a released block's keys in place, so the check above would not see it)."""
    from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for

    path = make_gpt_oss(tmp_path / "gpt_oss", seed=4)
    prompts = prompts_for(384)  # 9 to 60 tokens, 32 more each
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
            "draft_model": {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}}[method]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    llm = LLM(str(path), speculative_config=dict(spec, adaptive=False), max_model_len=96, block_size=8,
              num_gpu_blocks_override=20, max_num_batched_tokens=16)
    check_against_oracle(llm.generate(prompts, sp, use_tqdm=False), hf_greedy(path, prompts), method)
    kv, scheduler = llm.engine.core.kv, llm.engine.core.scheduler
    assert kv.num_released > 0 and scheduler.num_preemptions > 0
    assert scheduler.spec_stats.num_draft_tokens > 0 and kv.usage == 0.0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_gpt_oss_drafts_from_prefix_hits_with_n2_stops_and_grammar(tmp_path, method):
    """The check every speculative method passes (spec_exactness.py) on gpt-oss: prefix-cache hits (the sliding
    group's entries before the window RELEASED), n = 2 with stop strings and logprobs, a choice grammar."""
    from spec_exactness import assert_exact_with_prefix_hits_n2_stops_and_grammar

    path = make_gpt_oss(tmp_path / "gpt_oss", seed=4)
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
            "draft_model": {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}}[method]
    llm = assert_exact_with_prefix_hits_n2_stops_and_grammar(path, dict(spec, adaptive=False))
    assert llm.engine.core.kv.num_released > 0 and llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0


def test_gpt_oss_sampled_json_schemas_and_regexes_validate(tmp_path):
    """gpt-oss sampling (temperature 1, seeded) under generated JSON schemas and regexes, with n-gram drafts masked
    by the grammar, prompts longer than the window: every answer validates and the pool is whole after."""
    import re

    import structured_cases as sc
    import torch

    path = make_gpt_oss(tmp_path / "gpt_oss", seed=4)
    # Answers bounded so that the longest prompt and answer fit the checkpoint's 256 positions.
    schemas = [s for s in sc.json_schemas(60, seed=7) if sc.max_json_chars(s) <= 160][:6]
    assert len(schemas) == 6
    rxs = sc.regexes(6, seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()}
               for n in (12, 40, 9, 70, 21, 33) * 2]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=sc.max_json_chars(s) + 16,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for i, s in enumerate(schemas)]
    params += [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=4 * sc.MAX_REGEX_CHARS + 8,
                              structured_outputs=StructuredOutputsParams(regex=rx)) for i, rx in enumerate(rxs)]
    llm = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                             "adaptive": False}, max_model_len=256, block_size=8,
              num_gpu_blocks_override=256, max_num_batched_tokens=64)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs), [(o.finish_reason, o.text) for o in outs]
    for o, s in zip(outs, schemas):
        sc.validate_json(o.text, s)
    for o, rx in zip(outs[len(schemas):], rxs):
        assert re.fullmatch(rx, o.text), (rx, o.text)
    assert len({o.text for o in outs}) > len(outs) // 2  # sampled, not one fixed text
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    kv = llm.engine.core.kv
    assert kv.usage == 0.0 and kv.num_released > 0

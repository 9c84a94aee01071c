"""Speculative decoding and structured output on the newer families (Phi-3, Gemma 2, OLMo 2, Granite, GLM-4,
DeepSeek-V2/V3) on tiny random checkpoints: n-gram drafts and the model drafting for itself (draft_model) leave
greedy tokens and logprobs exactly as without speculation, also chunked by a small token budget; a JSON-schema
constraint gives an answer that validates, the same with speculation on as without."""
from __future__ import annotations

import json

import pytest

from compare import assert_same_outputs
from lora_tiny import no_failed_steps  # noqa: F401 (autouse: a failed step, rerun request by request, fails the test)
from test_deepseek import VARIANTS as DEEPSEEK
from test_deepseek import make_deepseek
from test_model_families import FAMILIES, make_family_model
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

CASES = {
    **{f: (make_family_model, *FAMILIES[f]) for f in ("phi3", "glm4", "gemma2", "olmo2", "granite")},
    "deepseek-v2": (make_deepseek, *DEEPSEEK["v2"]),
    "deepseek-v3": (make_deepseek, *DEEPSEEK["v3"]),
}
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
        assert llm.engine.core.kv.usage == 0.0  # every block (drafts' lookahead included) returned

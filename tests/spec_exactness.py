"""A check every speculative method shares (issue 30): with the method on, prefix-cache hits, n = 2 with stop
strings and logprobs, and a grammar give exactly what the engine gives without speculation; nothing leaks."""
from __future__ import annotations

from compare import assert_same_outputs
from test_speculative import KV, PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams


def assert_exact_with_prefix_hits_n2_stops_and_grammar(target, spec: dict) -> LLM:
    params = SamplingParams(n=2, max_tokens=24, temperature=0, logprobs=3, stop=["ab", "the"])
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    plain = LLM(str(target), **KV)
    base, base_choice = plain.generate(PROMPTS, params, use_tqdm=False), plain.generate(PROMPTS, choice, use_tqdm=False)
    llm = LLM(str(target), speculative_config=spec, **KV)
    for _ in range(2):  # the second time from the prefix cache
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        for a, b in zip(base, got):
            assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
            assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
            assert_same_outputs(a.outputs, b.outputs, "n=2")
    got = llm.generate(PROMPTS, choice, use_tqdm=False)  # under a grammar: chains, not trees
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in base_choice]
    assert all(o.outputs[0].text in ("yes", "no") for o in got)
    assert llm.engine.core.kv.stats.hits > 0 and llm.engine.core.kv.usage == 0.0
    return llm

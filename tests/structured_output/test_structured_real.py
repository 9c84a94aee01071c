"""Structured output on the real embedded SmolLM2-135M at temperature 1: every output of 200 JSON schemas,
50 regexes, 20 choice lists and an arithmetic Lark grammar is valid (the model alone would often not be)."""
from __future__ import annotations

import re

import pytest

from structured_cases import (ARITH_LARK, choice_lists, json_schemas, max_json_chars, parse_arith, regexes,
                              validate_json)
from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.model.default import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def llm():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from tokenmill import LLM

    engine = LLM(None, max_model_len=2048, max_num_seqs=256, kv_cache_memory_bytes=1 << 30)
    yield engine
    engine.engine.shutdown()


def _chat(llm, asks: list[str], params: list[SamplingParams]):
    return llm.chat([[{"role": "user", "content": a}] for a in asks], params, use_tqdm=False)


def test_200_json_schemas_all_validate(llm):
    schemas = json_schemas(200, seed=0)
    # A token holds at least one character; the bound is for compact JSON, so leave room for whitespace
    # (at most a newline and 16 indentation characters between tokens, see structured_output/grammar.py).
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=2 * max_json_chars(s) + 64,
                             structured_outputs=StructuredOutputsParams(json=s))
              for i, s in enumerate(schemas)]
    # Short prompts: the test is about the constraint, and 200 prompts with their schemas would be 40k tokens.
    asks = [f"Reply with a JSON {s.get('type', 'value')}." for s in schemas]
    outs = _chat(llm, asks, params)
    bad = []
    for s, o in zip(schemas, outs):
        c = o.outputs[0]
        try:
            assert c.finish_reason == "stop", f"finish_reason {c.finish_reason}"
            validate_json(c.text, s)
        except AssertionError as e:
            bad.append((s, c.text, str(e)))
    assert not bad, f"{len(bad)} of 200 invalid; first: {bad[0]}"
    stats = llm.engine.core.structured.stats
    assert stats.compiles >= 190  # distinct schemas compile once each (a few may coincide)


def test_50_regexes_and_20_choices(llm):
    rxs = regexes(50, seed=0)
    choices = choice_lists(20, seed=0)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=r))
              for i, r in enumerate(rxs)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=48,
                              structured_outputs=StructuredOutputsParams(choice=c)) for i, c in enumerate(choices)]
    asks = ["Write a short code."] * len(rxs) + [f"Pick one of: {', '.join(c)}." for c in choices]
    outs = _chat(llm, asks, params)
    for r, o in zip(rxs, outs[:50]):
        assert re.fullmatch(r, o.outputs[0].text), (r, o.outputs[0].text)
    for c, o in zip(choices, outs[50:]):
        assert o.outputs[0].text in c, (c, o.outputs[0].text)
        assert o.outputs[0].finish_reason == "stop"


def test_lark_arithmetic_parses(llm):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(grammar=ARITH_LARK)) for i in range(16)]
    outs = _chat(llm, ["Write an arithmetic expression."] * 16, params)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        parse_arith(c.text)  # raises ValueError outside the grammar

"""Structured output (llguidance grammars) end to end on tiny random models: every constrained output is
valid for its constraint at temperature 1, bad constraints are the caller's ValueError, the token bitmask
touches only the rows it belongs to, grammars compile off the step loop (cached by spec, never stalling
other requests), n > 1, preemption, start_after_token_ids, EOS only where the grammar accepts, failures in
the core, and speculative drafts under a grammar.

The random model samples almost uniformly among the tokens the grammar allows, so every constraint here
is bounded (tests/structured_cases.py): it admits finitely many short texts and the model must finish."""
from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time

import numpy as np
import pytest
import torch

import structured_cases as sc
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams, StructuredOutputsParams

SO = StructuredOutputsParams
MAX_LEN = 512
JSON_MAX_TOKENS = sc.MAX_JSON_CHARS + 16  # byte-level BPE: a token is at least one byte
REGEX_MAX_TOKENS = 4 * sc.MAX_REGEX_CHARS + 8

GBNF = '''root   ::= answer " " number ("," number){0,2}
answer ::= "yes" | "no" | "maybe"
number ::= [1-9] [0-9]?
'''
GBNF_RE = r"(yes|no|maybe) [1-9][0-9]?(,[1-9][0-9]?){0,2}"


# ---- fixtures and helpers ------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("structured") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(path):
    # A small token budget: long prompts are chunked, so batches mix rows that sample with rows that don't.
    return LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=128, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture
def manager(llm):
    return llm.engine.core.structured


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.groups
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()
    mgr = engine.core.structured
    # Requests aborted while compiling stay in the list until the next step's poll(), which drops them.
    assert mgr.poll() == [] and mgr.num_compiling == 0


def random_prompts(n: int, seed: int = 0, lens=(5, 40, 9, 70, 13, 21)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 384, (lens[i % len(lens)],), generator=g).tolist()}
            for i in range(n)]


def sampled(so, seed: int, max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=so, **kw)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def all_stopped(outs) -> None:
    reasons = [(c.finish_reason, c.text) for o in outs for c in o.outputs]
    assert all(r == "stop" for r, _ in reasons), reasons


def compile_gate(monkeypatch, manager, needle: str, action):
    """Route the manager's compile of any grammar containing `needle` through `action(grammar, original)`."""
    original = manager._compile

    def compile(grammar):
        if needle in grammar:
            return action(grammar, original)
        return original(grammar)

    monkeypatch.setattr(manager, "_compile", compile)


def run_steps(engine, until, max_steps: int = 2000, deadline_s: float = 30.0) -> dict:
    """Step the engine until `until(finished)` holds; finished: request id -> final RequestOutput."""
    finished = {}
    t0 = time.monotonic()
    for _ in range(max_steps):
        if until(finished):
            return finished
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        if time.monotonic() - t0 > deadline_s:
            break
    assert until(finished), f"gave up after {max_steps} steps / {deadline_s} s; finished: {sorted(finished)}"
    return finished


# ---- every kind of constraint gives valid output -----------------------------------------------------
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "any_whitespace"])
def test_json_schema_outputs_validate(llm, compact):
    schemas = sc.json_schemas(12, seed=7 if compact else 8)
    params = [sampled(SO(json=s, disable_any_whitespace=compact), seed=i, max_tokens=JSON_MAX_TOKENS)
              for i, s in enumerate(schemas)]
    outs = llm.generate(random_prompts(len(schemas), seed=1), params, use_tqdm=False)
    all_stopped(outs)
    for o, s in zip(outs, schemas):
        text = o.outputs[0].text
        sc.validate_json(text, s)
        if compact:
            assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) or "\\" in text
    assert len({o.outputs[0].text for o in outs}) > len(outs) // 2  # sampled, not one fixed text
    assert_idle(llm)


def test_json_object_outputs_are_objects(llm):
    # {"type": "object"} is unbounded: a bias towards '"' and '}' lets the random model close what it opens.
    tok = llm.get_tokenizer()
    bias = {tok.convert_tokens_to_ids('"'): 4.0, tok.convert_tokens_to_ids("}"): 4.0}
    params = [sampled(SO(json_object=True), seed=i, max_tokens=300, logit_bias=bias) for i in range(8)]
    outs = llm.generate(random_prompts(8, seed=2), params, use_tqdm=False)
    all_stopped(outs)
    for o in outs:
        assert isinstance(json.loads(o.outputs[0].text), dict), o.outputs[0].text
    assert any(json.loads(o.outputs[0].text) for o in outs)  # not only "{}"
    assert_idle(llm)


def test_regex_outputs_fullmatch(llm):
    rxs = sc.regexes(17, seed=3)  # one of each family
    for seed in (0, 1):
        params = [sampled(SO(regex=rx), seed=seed * 100 + i, max_tokens=REGEX_MAX_TOKENS) for i, rx in enumerate(rxs)]
        outs = llm.generate(random_prompts(len(rxs), seed=seed), params, use_tqdm=False)
        all_stopped(outs)
        for o, rx in zip(outs, rxs):
            assert re.fullmatch(rx, o.outputs[0].text), (rx, o.outputs[0].text)
    assert_idle(llm)


def test_choice_outputs_are_one_of_the_choices(llm):
    lists = sc.choice_lists(15, seed=4)
    params = [sampled(SO(choice=c), seed=i, max_tokens=64) for i, c in enumerate(lists)]
    outs = llm.generate(random_prompts(len(lists), seed=4), params, use_tqdm=False)
    all_stopped(outs)
    for o, c in zip(outs, lists):
        assert o.outputs[0].text in c, (o.outputs[0].text, c)
    assert_idle(llm)


def test_lark_grammar_outputs_parse(llm):
    params = [sampled(SO(grammar=sc.ARITH_LARK), seed=i, max_tokens=sc.ARITH_MAX_CHARS + 8) for i in range(12)]
    outs = llm.generate(random_prompts(12, seed=5), params, use_tqdm=False)
    all_stopped(outs)
    texts = [o.outputs[0].text for o in outs]
    for t in texts:
        sc.parse_arith(t)  # raises outside the language
    assert len(set(texts)) > 6
    assert_idle(llm)


def test_gbnf_grammar_outputs_match(llm):
    params = [sampled(SO(grammar=GBNF), seed=i, max_tokens=40) for i in range(10)]
    outs = llm.generate(random_prompts(10, seed=6), params, use_tqdm=False)
    all_stopped(outs)
    for o in outs:
        assert re.fullmatch(GBNF_RE, o.outputs[0].text), o.outputs[0].text
    assert_idle(llm)


def test_dict_structured_outputs_is_accepted(llm):
    out = llm.generate("x", SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                           structured_outputs={"regex": "[0-9]{4}"}), use_tqdm=False)[0]
    assert re.fullmatch("[0-9]{4}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


# ---- bad constraints are the caller's ValueError -------------------------------------------------------
BAD = [
    (SO(regex="(ab"), r"(?s)regex.*unclosed group"),
    (SO(regex="[a-z"), r"(?s)regex.*unclosed character class"),
    (SO(json={"type": "nope"}), r"(?s)json.*nope"),
    (SO(json='{"type": '), r"not valid JSON"),
    (SO(json=[1, 2]), r"must be an object"),
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), r"missing"),
    (SO(grammar="start: undefined_rule"), r"(?s)grammar.*undefined_rule"),
    (SO(grammar='root ::= "a" missing_rule\n'), r"missing_rule"),
]


@pytest.mark.parametrize("so,message", BAD, ids=[f"{so.kind}{i}" for i, (so, _) in enumerate(BAD)])
def test_bad_constraint_is_a_value_error_and_leaks_nothing(llm, so, message):
    assert_idle(llm)
    free = llm.engine.kv.num_free_blocks
    with pytest.raises(ValueError, match=message):
        llm.generate("hello", SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False)
    # In a batch: the good requests added before it are taken back.
    with pytest.raises(ValueError, match=message):
        llm.generate(["one", "two", "three"],
                     [greedy(8), SamplingParams(max_tokens=8, structured_outputs=SO(regex="[a-z]{3}")),
                      SamplingParams(max_tokens=8, structured_outputs=so)], use_tqdm=False)
    assert llm.engine.kv.num_free_blocks == free
    assert_idle(llm)
    out = llm.generate("hello", greedy(8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    out = llm.generate("hello", sampled(SO(regex="[a-z]{3}"), 0, 10), use_tqdm=False)[0]
    assert re.fullmatch("[a-z]{3}", out.outputs[0].text)
    assert_idle(llm)


def test_params_need_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])


# ---- the sampler's bitmask ---------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1, 31, 33, 1000, 50257])
def test_unpack_bitmask_equals_llguidance(vocab):
    import llguidance.numpy as lnp

    from tokenmill.sample.sampler import unpack_bitmask
    from tokenmill.structured_output.manager import unpack_bitmask_np

    rng = np.random.default_rng(vocab)
    rows = 7
    bitmask = rng.integers(-(2**31), 2**31, size=lnp.get_bitmask_shape(rows, vocab), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1] = 0  # nothing allowed
    bitmask[2] = np.int32(-(2**31))  # only bit 31 of each word
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    expected = logits.copy()
    lnp.apply_token_bitmask_inplace(expected, bitmask)

    allowed = unpack_bitmask(torch.from_numpy(bitmask), vocab)
    assert allowed.shape == (rows, vocab) and allowed.dtype == torch.bool
    got = torch.from_numpy(logits).masked_fill(~allowed, float("-inf")).numpy()
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(unpack_bitmask_np(bitmask, vocab), allowed.numpy())
    assert allowed[0].all() and not allowed[1].any()
    assert allowed[2].nonzero().flatten().tolist() == list(range(31, vocab, 32))


def test_sampler_applies_the_mask_to_its_rows_only(llm):
    """SamplingMetadata.grammar_rows/grammar_bitmask: masked rows sample only allowed tokens; others untouched."""
    from tokenmill.sample.sampler import apply_penalties

    runner = llm.engine.runner
    vocab = llm.engine.vocab_size
    logits = torch.randn(4, vocab)
    from tokenmill.sample.sampler import SamplingMetadata

    params = [SamplingParams(temperature=0.0)] * 4
    meta = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, [None] * 4, [None] * 4, vocab, runner.device)
    words = (vocab + 31) // 32
    mask = np.zeros((2, words), dtype=np.int32)
    mask[0, 0] = 0b1010  # tokens 1 and 3
    mask[1, 2] = 1  # token 64
    meta.grammar_rows = torch.tensor([1, 3])
    meta.grammar_bitmask = torch.from_numpy(mask)
    x = apply_penalties(logits, meta)
    assert torch.equal(x[0], logits[0]) and torch.equal(x[2], logits[2])
    assert torch.isfinite(x[1]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(x[3]).nonzero().flatten().tolist() == [64]
    out = llm.engine.runner.sampler(logits, meta)
    assert out.token_ids[1].item() in (1, 3) and out.token_ids[3].item() == 64
    assert out.token_ids[0].item() == logits[0].argmax().item()


# ---- the mask never leaks to other rows ------------------------------------------------------------------
def test_mixed_batch_matches_each_request_alone(llm):
    prompts = random_prompts(10, seed=9, lens=(5, 60, 9, 45, 13, 70, 21, 8, 33, 17))
    schema = sc.json_schemas(1, seed=11)[0]
    params = [
        greedy(24, ignore_eos=True),
        sampled(SO(regex="[a-z]{3,6}( [a-z]{2,5}){0,3}"), 1, REGEX_MAX_TOKENS),
        greedy(24, ignore_eos=True),
        sampled(SO(json=schema, disable_any_whitespace=True), 2, JSON_MAX_TOKENS),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True),
        sampled(SO(choice=["alpha", "beta", "gamma"]), 3, 16),
        greedy(24, ignore_eos=True),
        sampled(SO(grammar=sc.ARITH_LARK), 4, sc.ARITH_MAX_CHARS + 8),
        SamplingParams(temperature=1.0, seed=6, max_tokens=24),
        greedy(24),
    ]
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert tokens(together) == tokens(alone)
    # The unconstrained greedy rows are what the model says, not restricted to a grammar's alphabet.
    free_text = "".join(together[i].outputs[0].text for i in (0, 2, 6))
    assert not re.fullmatch(r"[a-z ]*", free_text)
    assert re.fullmatch("[a-z]{3,6}( [a-z]{2,5}){0,3}", together[1].outputs[0].text)
    sc.validate_json(together[3].outputs[0].text, schema)
    assert together[5].outputs[0].text in ("alpha", "beta", "gamma")
    sc.parse_arith(together[7].outputs[0].text)
    assert_idle(llm)


# ---- n > 1 and preemption ---------------------------------------------------------------------------------
def test_n_and_preemption_outputs_valid_and_nothing_leaks(path):
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=10, block_size=16, max_num_seqs=16)
    mgr = llm.engine.core.structured
    seen = []
    add = mgr.add
    mgr.add = lambda req: (seen.append(req), add(req))[-1]
    schemas = [s for s in sc.json_schemas(60, seed=12) if sc.max_json_chars(s) <= 70][:3]
    rxs = sc.regexes(5, seed=13)
    cons = [("json", s) for s in schemas] + [("regex", r) for r in rxs]
    params = [sampled(SO(json=v, disable_any_whitespace=True) if k == "json" else SO(regex=v), seed=i,
                      max_tokens=100, n=3) for i, (k, v) in enumerate(cons)]
    outs = llm.generate(random_prompts(len(cons), seed=14, lens=(12, 20, 7)), params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for o, (kind, v) in zip(outs, cons):
        assert len(o.outputs) == 3
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            if kind == "json":
                sc.validate_json(c.text, v)
            else:
                assert re.fullmatch(v, c.text), (v, c.text)
    assert sum(len({c.text for c in o.outputs}) > 1 for o in outs) >= len(outs) // 2  # n seeds, not n copies
    assert len(seen) == 3 * len(cons)
    assert all(r.grammar is None for r in seen)  # matchers freed
    assert_idle(llm)
    llm.engine.shutdown()


# ---- the compiled-grammar cache ------------------------------------------------------------------------------
def _schema(*keys: str) -> dict:
    return {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in keys},
            "required": list(keys), "additionalProperties": False}


def test_cache_hit_and_key_order(llm, manager):
    st = manager.stats
    so = SO(json=_schema("cache_a", "cache_b"), disable_any_whitespace=True)
    c0, h0 = st.compiles, st.cache_hits
    first = llm.generate("x", sampled(so, 1, 40), use_tqdm=False)[0].outputs[0]
    assert (st.compiles, st.cache_hits) == (c0 + 1, h0)
    second = llm.generate("y", sampled(SO(json=_schema("cache_a", "cache_b"), disable_any_whitespace=True), 2, 40),
                          use_tqdm=False)[0].outputs[0]
    assert (st.compiles, st.cache_hits) == (c0 + 1, h0 + 1)
    for c in (first, second):
        assert list(json.loads(c.text)) == ["cache_a", "cache_b"]
    # Another key order is another grammar (the output follows the schema's order).
    swapped = llm.generate("x", sampled(SO(json=_schema("cache_b", "cache_a"), disable_any_whitespace=True), 1, 40),
                           use_tqdm=False)[0].outputs[0]
    assert (st.compiles, st.cache_hits) == (c0 + 2, h0 + 1)
    assert list(json.loads(swapped.text)) == ["cache_b", "cache_a"]
    # Whitespace options are part of the key; a dict and its compact JSON text are the same key.
    llm.generate("x", sampled(SO(json=_schema("cache_a", "cache_b")), 1, 60), use_tqdm=False)
    assert (st.compiles, st.cache_hits) == (c0 + 3, h0 + 1)
    llm.generate("x", sampled(SO(json=json.dumps(_schema("cache_a", "cache_b"), separators=(",", ":")),
                                    disable_any_whitespace=True), 3, 40),
                 use_tqdm=False)
    assert (st.compiles, st.cache_hits) == (c0 + 3, h0 + 2)
    # Three requests for one new grammar in one batch share one compile.
    outs = llm.generate(["a", "b", "c"], [sampled(SO(regex="cache[0-9]{2}"), i, 20) for i in range(3)], use_tqdm=False)
    assert st.compiles == c0 + 4
    assert all(re.fullmatch("cache[0-9]{2}", o.outputs[0].text) for o in outs)
    assert_idle(llm)


# ---- a slow compile never stalls anyone else --------------------------------------------------------------
def test_slow_grammar_does_not_stall_others(llm, manager, monkeypatch):
    engine = llm.engine
    release = threading.Event()
    started = threading.Event()

    def slow(grammar, original):
        started.set()
        assert release.wait(60), "the test never released the slow grammar"
        return original(grammar)

    compile_gate(monkeypatch, manager, "slowgrammar", slow)
    engine.add_request("slow", "first in line", sampled(SO(regex="slowgrammar[0-9]{3}"), 1, 30))
    assert started.wait(30)
    others = {
        "plain": greedy(12, ignore_eos=True),
        "regex": sampled(SO(regex="[a-z]{4}"), 2, 20),
        "json": sampled(SO(json=_schema("stall_x"), disable_any_whitespace=True), 3, 40),
    }
    for rid, sp in others.items():
        engine.add_request(rid, "behind the slow one", sp)
    done = run_steps(engine, lambda f: set(others) <= set(f))
    assert "slow" not in done
    slow_req = engine.scheduler.requests["slow"]
    assert slow_req.num_computed_tokens == 0 and slow_req.grammar.matcher is None and manager.num_compiling == 1
    assert len(done["plain"].outputs[0].token_ids) == 12
    assert re.fullmatch("[a-z]{4}", done["regex"].outputs[0].text)
    sc.validate_json(done["json"].outputs[0].text, _schema("stall_x"))

    release.set()
    done = run_steps(engine, lambda f: "slow" in f)
    out = done["slow"].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("slowgrammar[0-9]{3}", out.text), out
    assert_idle(llm)


# ---- start_after_token_ids ----------------------------------------------------------------------------------
def test_start_after_token_ids(llm, tok):
    prompt = {"prompt_token_ids": tok.encode("The quick brown fox")}
    free = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    assert len(free) >= 8 and not set(free[:6]) & llm.engine.eos_token_ids
    marker = tuple(free[2:4])  # two tokens, sampled in two steps
    rx = "[a-z]{6}"
    # Unconstrained continuation after the marker is not what the grammar would allow.
    assert not re.fullmatch(rx, tok.decode(free[4:]))

    out = llm.generate(prompt, greedy(30, structured_outputs=SO(regex=rx, start_after_token_ids=marker)),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == free[:4]  # free until the marker
    assert re.fullmatch(rx, tok.decode(out.token_ids[4:])), out
    assert out.finish_reason == "stop"

    # A marker that never comes: the constraint never applies (output as without it).
    eos = min(llm.engine.eos_token_ids)
    never = (eos, eos)
    out = llm.generate(prompt, greedy(12, structured_outputs=SO(regex=rx, start_after_token_ids=never)),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free
    assert_idle(llm)


# ---- a grammar that fails in the core ---------------------------------------------------------------------------
def _boom(grammar, original):
    raise RuntimeError("boom: the tokenizer cannot take this grammar")


def test_core_grammar_failure_aborts_only_that_request(llm, manager, monkeypatch):
    compile_gate(monkeypatch, manager, "corefail", _boom)
    prompts = ["first", "second", "third"]
    good = [greedy(10, ignore_eos=True), sampled(SO(regex="[0-9]{3}"), 3, 10)]
    ref = llm.generate(prompts[1:], good, use_tqdm=False)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=10, structured_outputs=SO(regex="corefail[0-9]"))] + good,
                        use_tqdm=False)
    bad = outs[0].outputs[0]
    assert bad.finish_reason == "abort" and bad.token_ids == []
    assert isinstance(bad.stop_reason, str) and bad.stop_reason.startswith("grammar error"), bad.stop_reason
    assert "boom" in bad.stop_reason
    assert tokens(outs[1:]) == tokens(ref)
    assert_idle(llm)


def test_core_grammar_failure_of_a_lone_request_is_reported(llm, manager, monkeypatch):
    """The core step that refuses it schedules nothing: the refusal still reaches LLMEngine.step's caller."""
    compile_gate(monkeypatch, manager, "lonefail", _boom)
    engine = llm.engine
    engine.add_request("lone", "hello", SamplingParams(max_tokens=5, structured_outputs=SO(regex="lonefail[0-9]")))
    try:
        # The loop spins on empty steps while the grammar compiles: bound it by time, not by steps.
        done = run_steps(engine, lambda f: "lone" in f, max_steps=10**7)
        out = done["lone"].outputs[0]
        assert out.finish_reason == "abort" and out.stop_reason.startswith("grammar error") and "boom" in out.stop_reason
    finally:
        engine.abort_request("lone")
    assert_idle(llm)
    out = llm.generate("hello", SamplingParams(max_tokens=5, structured_outputs=SO(regex="lonefail[0-9]")),
                       use_tqdm=False)[0].outputs[0]  # LLM.generate returns (used to wait forever)
    assert out.finish_reason == "abort"
    assert_idle(llm)


def test_core_grammar_failure_reported_in_a_step_with_kv_offload(path, monkeypatch):
    """A refusal in a step that also moves KV blocks to the host tier is reported (the core once lost it to a
    name clash with the failed KV loads)."""
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=10, block_size=16, enable_prefix_caching=True,
              kv_offload_bytes=1 << 20)
    engine = llm.engine
    compile_gate(monkeypatch, engine.core.structured, "offloadfail", _boom)
    g = torch.Generator().manual_seed(0)
    p1, p2 = (torch.randint(3, 384, (120,), generator=g).tolist() for _ in range(2))
    llm.generate({"prompt_token_ids": p1}, greedy(2), use_tqdm=False)  # fills the pool with cached blocks
    engine.add_request("bad", "hello", SamplingParams(max_tokens=5, structured_outputs=SO(regex="offloadfail[0-9]")))
    concurrent.futures.wait([engine.scheduler.requests["bad"].grammar.future], timeout=30)
    engine.add_request("good", None, greedy(3), prompt_token_ids=p2)  # evicts cached blocks: saves to the host tier
    try:
        done = run_steps(engine, lambda f: "good" in f)
        assert engine.kv.offload.stats.saves > 0
        assert "bad" in done and done["bad"].outputs[0].finish_reason == "abort"
    finally:
        engine.abort_request("bad")
        engine.shutdown()


# ---- EOS only where the grammar accepts ---------------------------------------------------------------------
def test_eos_only_where_the_grammar_accepts(llm):
    eos = sorted(llm.engine.eos_token_ids)
    push_eos = {e: 30.0 for e in eos}  # without the mask, EOS would be the first token
    assert llm.generate("x", SamplingParams(max_tokens=5, logit_bias=push_eos), use_tqdm=False)[0].outputs[0].text == ""
    outs = llm.generate(random_prompts(6, seed=20), [sampled(SO(regex="[a-z]{5}"), i, 40, logit_bias=push_eos)
                                                     for i in range(6)], use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch("[a-z]{5}", c.text), c
        assert not set(c.token_ids) & set(eos)  # finished by the grammar: the last token is text
    # Where the grammar may end or go on, EOS ends it as soon as it is allowed.
    outs = llm.generate(random_prompts(6, seed=21), [sampled(SO(regex="[a-z]{2,12}"), i, 40, logit_bias=push_eos)
                                                     for i in range(6)], use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch("[a-z]{2,12}", c.text), c
        assert c.token_ids[-1] in eos and len(c.token_ids) >= 2
        # EOS came as soon as the grammar allowed it: before the last text token, fewer than 2 letters.
        assert len(llm.get_tokenizer().decode(c.token_ids[:-2])) < 2, c
    # ignore_eos and min_tokens cannot push a request past the end of its grammar.
    outs = llm.generate(random_prompts(4, seed=22),
                        [sampled(SO(regex="[a-z]{5}"), i, 40, ignore_eos=True, min_tokens=20) for i in range(4)],
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch("[a-z]{5}", c.text), c
    assert_idle(llm)


# ---- speculative drafts under a grammar ------------------------------------------------------------------------
DRAFT_RX = "[a-z]{6}( [a-z]{4,8}){3}"


def _run_with_drafts(engine, rid, prompt, sp, propose):
    """Run one request alone, setting its drafts before every step from propose(output so far)."""
    engine.add_request(rid, None, sp, prompt_token_ids=prompt)
    steps, grew = 0, []
    final = None
    while engine.has_unfinished_requests():
        req = engine.scheduler.requests.get(rid)
        before = req.num_output_tokens if req is not None else 0
        if req is not None and req.num_output_tokens > 0:
            req.spec_token_ids = propose(list(req.output_token_ids))
        for o in engine.step():
            if o.finished:
                final = o.outputs[0]
        steps += 1
        grew.append((req.num_output_tokens if final is None else len(final.token_ids)) - before)
    return final, steps, grew


def test_drafts_under_a_grammar_change_nothing(llm, tok):
    engine = llm.engine
    prompt = tok.encode("Once upon a time")
    sp = greedy(80, structured_outputs=SO(regex=DRAFT_RX))
    ref, ref_steps, _ = _run_with_drafts(engine, "nodraft", prompt, sp, lambda out: [])
    assert ref.finish_reason == "stop" and re.fullmatch(DRAFT_RX, ref.text)
    R = ref.token_ids
    assert len(R) >= 8
    digit = tok.convert_tokens_to_ids("8")  # never allowed by DRAFT_RX
    space = tok.encode(" ")[0]
    stats = {"outside": 0, "valid": 0}

    def propose(out):
        k = len(out)
        assert out == R[:k]  # the output so far is the reference's
        right = R[k : len(R) - 1]  # up to the grammar's end: the next test
        mode = k % 3
        if mode == 0 and right:
            stats["valid"] += 1
            return right[:3]  # all correct
        if mode == 1:
            stats["outside"] += 1
            return right[:1] + [digit, space]  # then a token outside the grammar
        wrong = next(t for t in tok.encode("qzxv") if t not in right[:1])
        return [wrong] + right[1:3]  # allowed or not, but not what the model says

    out, steps, grew = _run_with_drafts(engine, "drafted", prompt, sp, propose)
    assert out.token_ids == R and out.text == ref.text and out.finish_reason == "stop"
    assert stats["valid"] and stats["outside"]
    assert max(grew) > 1 and steps < ref_steps  # drafts were verified and accepted
    assert_idle(llm)


def test_drafts_up_to_the_grammar_end_change_nothing(llm, tok):
    """Drafts that complete the grammar: the bonus row allows only EOS, and the request still ends on the grammar's
    last token (no EOS), as without drafts."""
    engine = llm.engine
    prompt = tok.encode("Once upon a time")
    sp = greedy(80, structured_outputs=SO(regex="[a-z]{16}"))
    ref, ref_steps, _ = _run_with_drafts(engine, "end-nodraft", prompt, sp, lambda out: [])
    R = ref.token_ids
    assert len(R) >= 4 and not set(R) & llm.engine.eos_token_ids
    out, steps, _ = _run_with_drafts(engine, "end-drafted", prompt, sp, lambda o: R[len(o):])  # the rest at once
    assert steps < ref_steps
    assert out.text == ref.text and out.finish_reason == "stop"
    assert out.token_ids == R
    assert_idle(llm)


def test_drafts_across_the_start_after_marker(llm, tok):
    """Drafts that complete the start_after marker are masked from the row after it on."""
    engine = llm.engine
    prompt = tok.encode("The quick brown fox")
    m = tok.convert_tokens_to_ids("8")
    sp = greedy(30, logit_bias={m: 100.0}, structured_outputs=SO(regex="[a-z]{5}", start_after_token_ids=(m, m)))
    ref, _, _ = _run_with_drafts(engine, "sa-nodraft", prompt, sp, lambda out: [])
    assert ref.token_ids[:2] == [m, m] and re.fullmatch("[a-z]{5}", tok.decode(ref.token_ids[2:]))
    out, _, _ = _run_with_drafts(engine, "sa-drafted", prompt, sp, lambda o: [m, m, m])
    try:
        assert re.fullmatch("[a-z]{5}", tok.decode(out.token_ids[2:])), out
        assert out.token_ids == ref.token_ids
    finally:
        assert_idle(llm)

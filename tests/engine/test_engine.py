"""End-to-end behaviour of the offline API (`LLM.generate` / `LLM.chat`) and the engine underneath it,
on one tiny random Llama: seeded sampling, stop conditions, logprobs, output shapes, chat templates,
aborts, priority scheduling, checkpoint formats and KV pool sizing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

MAX_LEN = 128
TEXT_PROMPTS = ["The quick brown fox", "Once upon a time", "SELECT * FROM", "Paged attention"]


def llm_for(path, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLM(str(path), **kw)


def random_prompts(n: int, seed: int = 0, lens=(5, 9, 13, 17, 21, 25)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def assert_engine_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.groups
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The model is tiny: one intra-op thread is as fast, and does not stall when the CPUs are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("engine") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(path):
    return llm_for(path)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy tokens of the text prompts, from the module's engine (the baseline for loader tests)."""
    return tokens(llm.generate(TEXT_PROMPTS, greedy(12), use_tqdm=False))


# ---- seeded sampling ---------------------------------------------------------------------------
SEEDED = dict(temperature=0.8, top_p=0.9, max_tokens=16)


def test_seeded_sampling_is_batch_and_instance_invariant(llm, path):
    prompt = "The quick brown fox"
    alone = llm.generate([prompt], SamplingParams(seed=123, **SEEDED), use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 16 or alone[-1] in llm.engine.eos_token_ids
    again = llm.generate(prompt, SamplingParams(seed=123, **SEEDED), use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone

    # Inside a batch of 16 other requests: unseeded, greedy and differently seeded, varied lengths.
    others = random_prompts(16, seed=5)
    kinds = [SamplingParams(temperature=1.0, max_tokens=20),  # unseeded
             SamplingParams(temperature=0.0, max_tokens=12),  # greedy
             SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=18),  # seeded, other seed
             SamplingParams(temperature=1.2, min_p=0.05, max_tokens=8)]
    prompts = others[:7] + [prompt] + others[7:]
    params = [kinds[i % 4] for i in range(7)] + [SamplingParams(seed=123, **SEEDED)] + [kinds[i % 4] for i in range(7, 16)]
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert len(batch) == 17
    assert batch[7].outputs[0].token_ids == alone
    # ... and the other seeded requests of the batch reproduce on their own too.
    seeded_idx = [i for i, p in enumerate(params) if p.seed == 7]
    assert seeded_idx
    for i in seeded_idx:
        assert llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids == batch[i].outputs[0].token_ids

    # A second engine instance (with a different global seed) gives the same tokens.
    other = llm_for(path, seed=99)
    assert other.generate([prompt], SamplingParams(seed=123, **SEEDED), use_tqdm=False)[0].outputs[0].token_ids == alone

    # Different seeds give different sequences.
    for seed in (124, 125, 999):
        got = llm.generate([prompt], SamplingParams(seed=seed, **SEEDED), use_tqdm=False)[0].outputs[0].token_ids
        assert got != alone, seed
    assert_engine_idle(llm)


def test_seeded_n2_gives_two_different_reproducible_sequences(llm):
    sp = SamplingParams(n=2, seed=123, **SEEDED)
    a = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    b = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert tokens([a]) == tokens([b])
    assert_engine_idle(llm)


def test_unseeded_sampling_varies(llm):
    # Without a seed, repeated sampling is not stuck on one sequence.
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    outs = llm.generate(["Once upon a time"] * 4, sp, use_tqdm=False)
    assert len({tuple(t) for t in tokens(outs)}) > 1


# ---- stop conditions ---------------------------------------------------------------------------
def _printable(s: str) -> bool:
    return all(c.isprintable() and c != "\ufffd" for c in s)


def test_stop_string_spanning_a_token_boundary(llm, tok):
    base = None
    for prompt in TEXT_PROMPTS + random_prompts(6, seed=11):
        out = llm.generate([prompt], greedy(32), use_tqdm=False)[0].outputs[0]
        text, ids = out.text, out.token_ids
        # Character offsets where a token ends, found by decoding growing prefixes.
        bounds = []
        for k in range(1, len(ids)):
            piece = tok.decode(ids[:k], skip_special_tokens=True)
            if text.startswith(piece) and 0 < len(piece) < len(text):
                bounds.append(len(piece))
        for b in bounds:
            if b < 4 or b + 3 > len(text):
                continue
            sub = text[b - 2 : b + 2]
            # The stop must straddle the boundary, be printable and first occur right there.
            if _printable(sub) and text.find(sub) == b - 2 and not any(b - 2 < c < b for c in bounds) \
                    and not any(b < c < b + 2 for c in bounds):
                base = (prompt, out, sub, b - 2)
                break
        if base:
            break
    assert base is not None, "no greedy output with a usable token boundary"
    prompt, out, sub, start = base

    stopped = llm.generate([prompt], greedy(32, stop=[sub]), use_tqdm=False)[0].outputs[0]
    assert stopped.text == out.text[:start]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == sub
    # Generation ended at the token that completed the stop string: a strict prefix of the greedy run.
    assert len(stopped.token_ids) < len(out.token_ids)
    assert stopped.token_ids == out.token_ids[: len(stopped.token_ids)]
    assert sub in tok.decode(stopped.token_ids, skip_special_tokens=True)
    assert sub not in tok.decode(stopped.token_ids[:-1], skip_special_tokens=True)

    kept = llm.generate([prompt], greedy(32, stop=[sub], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == out.text[: start + len(sub)]
    assert kept.token_ids == stopped.token_ids
    assert kept.finish_reason == "stop" and kept.stop_reason == sub

    # A stop string listed with one that never occurs: the one that occurs wins.
    two = llm.generate([prompt], greedy(32, stop=["\x00never\x00", sub]), use_tqdm=False)[0].outputs[0]
    assert two.text == stopped.text and two.stop_reason == sub


def test_stop_token_ids(llm):
    for prompt in TEXT_PROMPTS + random_prompts(6, seed=12):
        ids = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
        if len(ids) >= 6 and ids[4] not in ids[:4]:
            break
    else:
        pytest.fail("no greedy output whose 5th token is new")
    stop_id = ids[4]
    out = llm.generate([prompt], greedy(16, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:5]
    assert out.token_ids[-1] == stop_id
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert_engine_idle(llm)


def test_max_tokens_gives_length(llm):
    for n in (1, 7):
        outs = llm.generate(TEXT_PROMPTS, greedy(n, ignore_eos=True), use_tqdm=False)
        for o in outs:
            assert len(o.outputs[0].token_ids) == n
            assert o.outputs[0].finish_reason == "length"
            assert o.outputs[0].stop_reason is None
            assert o.finished


def test_max_tokens_none_runs_to_max_model_len(llm):
    prompt = random_prompts(1, seed=3, lens=(100,))[0]
    out = llm.generate([prompt], greedy(None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == MAX_LEN
    assert out.finish_reason == "length"


def test_min_tokens_bans_stop_token_ids(llm):
    prompt = "Paged attention"
    first = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids[0]
    # Without min_tokens the greedy first token stops generation at once.
    out = llm.generate([prompt], greedy(8, stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first
    # With min_tokens=3 it cannot appear among the first 3 tokens.
    out = llm.generate([prompt], greedy(8, stop_token_ids=[first], min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3
    assert first not in out.token_ids[:3]
    if first in out.token_ids:
        assert out.token_ids.index(first) == len(out.token_ids) - 1
        assert out.finish_reason == "stop" and out.stop_reason == first
    else:
        assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_min_tokens_holds_back_stop_strings(llm):
    # As in vLLM, a stop string cannot end generation before min_tokens tokens exist.
    for prompt in TEXT_PROMPTS + random_prompts(6, seed=16):
        base = llm.generate([prompt], greedy(10), use_tqdm=False)[0].outputs[0]
        if len(base.token_ids) == 10 and _printable(base.text[:2]) and len(base.text) > 4:
            break
    else:
        pytest.fail("no greedy output starting with printable text")
    stop = base.text[:2]
    early = llm.generate([prompt], greedy(10, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.text == "" and len(early.token_ids) <= 2
    out = llm.generate([prompt], greedy(10, stop=[stop], min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 5
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert base.text.startswith(out.text)
    assert len(out.text) >= 1
    if out.finish_reason == "stop":
        assert out.stop_reason == stop
        assert base.text[len(out.text):].startswith(stop)
    else:
        assert out.token_ids == base.token_ids and out.text == base.text


def test_eos_min_tokens_and_ignore_eos(llm, tok):
    eos = tok.eos_token_id
    assert eos in llm.engine.eos_token_ids
    # A logit bias makes EOS the greedy choice at every step.
    bias = {eos: 100.0}
    out = llm.generate(["Once upon a time"], greedy(8, logit_bias=bias), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == ""  # special tokens are skipped

    out = llm.generate(["Once upon a time"], greedy(8, logit_bias=bias, min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert not set(out.token_ids[:3]) & llm.engine.eos_token_ids  # every EOS id is banned, not just eos_token_id
    assert out.token_ids[3] == eos and out.finish_reason == "stop"

    out = llm.generate(["Once upon a time"], greedy(8, logit_bias=bias, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] * 8
    assert out.finish_reason == "length"

    # The second EOS id from generation_config.json stops generation too.
    other = next(iter(llm.engine.eos_token_ids - {eos}))
    out = llm.generate(["Once upon a time"], greedy(8, logit_bias={other: 100.0}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [other] and out.finish_reason == "stop"


# ---- logprobs ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_logprobs(llm, hf_model, temperature):
    N = 3
    prompt = "The quick brown fox"
    sp = SamplingParams(temperature=temperature, seed=5, max_tokens=8, logprobs=N, ignore_eos=True)
    o = llm.generate([prompt], sp, use_tqdm=False)[0]
    c = o.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 8
    ref = hf_logprobs(hf_model, o.prompt_token_ids + c.token_ids)[len(o.prompt_token_ids) - 1 : -1]
    total = 0.0
    for step, (tid, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert tid in entry
        assert len(entry) in (N, N + 1)
        row = ref[step]
        top = row.topk(N).indices.tolist()
        for r, t in enumerate(top, start=1):
            assert t in entry and entry[t].rank == r
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4
            assert lp.decoded_token == llm.get_tokenizer().decode([t])
        assert entry[tid].rank == 1 + int((row > row[tid]).sum())
        if temperature == 0.0:
            assert entry[tid].rank == 1
        assert (len(entry) == N) == (tid in top)
        total += entry[tid].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    c = llm.generate(["Paged attention"], greedy(4, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)))
    plain = llm.generate(["Paged attention"], greedy(4), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_prompt_logprobs_match_transformers(llm, hf_model):
    # Twice: the second run must not take the prompt from the prefix cache and lose its logprobs.
    prompt = random_prompts(1, seed=21, lens=(40,))[0]
    for _ in range(2):
        o = llm.generate([prompt], greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
        ref = hf_logprobs(hf_model, prompt)
        assert len(o.prompt_logprobs) == len(prompt)
        assert o.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            entry, row, t = o.prompt_logprobs[i], ref[i - 1], prompt[i]
            assert t in entry
            assert abs(entry[t].logprob - float(row[t])) < 1e-4
            assert entry[t].rank == 1 + int((row > row[t]).sum())
            for r, alt in enumerate(row.topk(2).indices.tolist(), start=1):
                assert entry[alt].rank == r
                assert abs(entry[alt].logprob - float(row[alt])) < 1e-4
    # Chunked prefill (8-token budget) splits the prompt over steps: still one entry per token.
    small = llm_for(llm.engine.config.model.model, max_num_batched_tokens=8)
    o2 = small.generate([prompt], greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
    assert len(o2.prompt_logprobs) == len(prompt)
    for a, b in zip(o.prompt_logprobs[1:], o2.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert o.prompt_logprobs is not None and llm.generate([prompt], greedy(2), use_tqdm=False)[0].prompt_logprobs is None


# ---- output shapes -----------------------------------------------------------------------------
def test_request_output_fields_and_n(llm, tok):
    prompt = "Once upon a time"
    o = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=6), use_tqdm=False)
    assert len(o) == 1
    o = o[0]
    assert o.prompt == prompt
    assert o.prompt_token_ids == tok(prompt).input_ids
    assert o.finished
    assert [c.index for c in o.outputs] == [0, 1, 2]
    for c in o.outputs:
        assert 1 <= len(c.token_ids) <= 6
        assert c.finish_reason in ("stop", "length")
        assert isinstance(c.text, str)
    assert len({tuple(c.token_ids) for c in o.outputs}) > 1


def test_text_is_the_decoded_token_ids(llm, tok):
    outs = llm.generate(TEXT_PROMPTS + random_prompts(6, seed=13), greedy(24), use_tqdm=False)
    exact = 0
    for o in outs:
        c = o.outputs[0]
        full = tok.decode(c.token_ids, skip_special_tokens=True)
        # Bytes of a character still incomplete when generation ends are not shown (as in vLLM).
        assert full.startswith(c.text)
        assert set(full[len(c.text):]) <= {"\ufffd"}
        exact += full == c.text
    assert exact >= len(outs) // 2


def test_chat_uses_the_template(llm, tok):
    o = llm.chat([{"role": "user", "content": "hi"}], greedy(4), use_tqdm=False)
    assert len(o) == 1
    o = o[0]
    assert o.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert o.prompt_token_ids == tok(o.prompt, add_special_tokens=False).input_ids
    direct = llm.generate([o.prompt_token_ids], greedy(4), use_tqdm=False)[0]
    assert o.outputs[0].token_ids == direct.outputs[0].token_ids

    convs = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count to ten"}]]
    outs = llm.chat(convs, greedy(4), use_tqdm=False)
    assert len(outs) == 2
    assert outs[0].prompt == o.prompt and outs[0].outputs[0].token_ids == o.outputs[0].token_ids
    assert outs[1].prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert outs[1].prompt.endswith("<|im_start|>assistant\n")
    no_gen = llm.chat(convs[0], greedy(2), use_tqdm=False, add_generation_prompt=False)[0]
    assert "<|im_start|>assistant" not in no_gen.prompt


def test_token_id_prompts_and_per_prompt_params(llm, tok):
    prompts = random_prompts(3, seed=14)
    params = [greedy(2, ignore_eos=True), greedy(3, ignore_eos=True), greedy(5, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.prompt for o in outs] == [None] * 3
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3, 5]
    # Each equals the same request on its own, and a single flat token list is one prompt.
    for p, sp, o in zip(prompts, params, outs):
        assert llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == o.outputs[0].token_ids
    # Text and token ids of the same prompt give the same result.
    text = llm.generate(["The quick brown fox"], greedy(6), use_tqdm=False)[0]
    ids = llm.generate([tok("The quick brown fox").input_ids], greedy(6), use_tqdm=False)[0]
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids


# ---- engine control ----------------------------------------------------------------------------
def test_abort_in_the_middle_frees_blocks(llm):
    engine = llm.engine
    assert_engine_idle(llm)
    sp = greedy(40, ignore_eos=True)
    prompts = random_prompts(2, seed=15, lens=(20, 30))
    engine.add_request("abort-a", prompts[0], sp)
    engine.add_request("abort-b", prompts[1], sp)
    seen_a = False
    for _ in range(4):
        seen_a |= any(o.request_id == "abort-a" for o in engine.step())
    assert seen_a
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    aborted = engine.abort_request("abort-a")
    assert aborted.outputs[0].finish_reason == "abort"
    assert 0 < len(aborted.outputs[0].token_ids) < 40
    assert engine.abort_request("abort-a") is None  # already gone
    assert engine.num_unfinished_requests == 1
    later = []
    while engine.has_unfinished_requests():
        later.extend(engine.step())
    assert later and all(o.request_id == "abort-b" for o in later)
    assert later[-1].finished and len(later[-1].outputs[0].token_ids) == 40
    assert_engine_idle(llm)

    # Aborting a request that is still waiting works too.
    engine.add_request("abort-c", prompts[0], sp)
    assert engine.abort_request("abort-c").outputs[0].finish_reason == "abort"
    assert engine.step() == []
    assert_engine_idle(llm)


def test_abort_one_child_group_of_n(llm):
    engine = llm.engine
    engine.add_request("abort-n", "Once upon a time", SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort_request("abort-n")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert engine.step() == []
    assert_engine_idle(llm)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_scheduling(path, policy):
    llm = llm_for(path, scheduling_policy=policy, max_num_seqs=1)
    engine = llm.engine
    sp = greedy(4, ignore_eos=True)
    engine.add_request("first-added", "The quick brown fox", sp, priority=5)
    engine.add_request("second-added", "Once upon a time", sp, priority=0)
    order = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert len(engine.scheduler.running) <= 1
            if o.finished:
                order.append(o.request_id)
    if policy == "priority":
        assert order == ["second-added", "first-added"]
    else:
        assert order == ["first-added", "second-added"]
    # The same through LLM.generate(priority=...): outputs come back in prompt order.
    outs = llm.generate(["The quick brown fox", "Once upon a time"], sp, use_tqdm=False, priority=[5, 0])
    t0, t1 = (o.metrics.finished_time for o in outs)
    assert (t1 < t0) if policy == "priority" else (t0 < t1)


def test_slo_policy_changes_the_order_never_the_tokens(path, llm):
    """SLO and batch requests mixed on a tight engine (chunked, one seat short): every output equals fcfs's;
    a request that cannot meet its TTFT is shed with --slo-shed and the others are untouched."""
    from tokenmill.core.request import RequestSLO

    prompts = random_prompts(6, seed=5, lens=(40, 9, 33, 5, 21, 60))
    want = tokens(llm.generate(prompts, greedy(8), use_tqdm=False))
    slo_llm = llm_for(path, scheduling_policy="slo", slo_shed=True, max_num_seqs=3, max_num_batched_tokens=24)
    engine = slo_llm.engine
    slos = [None, RequestSLO(ttft_ms=60_000, tpot_ms=60_000), None, RequestSLO(ttft_ms=60_000), None,
            RequestSLO(tpot_ms=60_000)]
    for i, (p, slo) in enumerate(zip(prompts, slos)):
        engine.add_request(str(i), None, greedy(8), prompt_token_ids=p, slo=slo)
    engine.add_request("hopeless", None, greedy(8), prompt_token_ids=prompts[0], slo=RequestSLO(ttft_ms=0.001))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[str(i)].outputs[0].token_ids for i in range(6)] == want
    shed = done["hopeless"].outputs[0]
    assert shed.finish_reason == "abort" and "time-to-first-token" in str(shed.stop_reason) and not shed.token_ids
    assert_engine_idle(slo_llm)
    state = engine.scheduler.policy.describe()  # the step-time model learned from the engine's own steps
    assert state["shed"] == 1 and state["steps_observed"] >= 10 and state["step_seconds_per_token"] > 0


def test_long_prefill_token_threshold_keeps_outputs_and_chunks_steps(path, llm):
    """Capped prompt chunks (vLLM's long_prefill_token_threshold) change the steps, never the tokens."""
    prompts = random_prompts(6, seed=3, lens=(40, 9, 33, 5, 21, 60))
    want = tokens(llm.generate(prompts, greedy(8), use_tqdm=False))
    capped = llm_for(path, long_prefill_token_threshold=7)
    engine = capped.engine
    chunks: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        chunks.extend(n for _, n in out.scheduled)
        return out

    engine.scheduler.schedule = recording_schedule
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, greedy(8))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        for o in outs:
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    assert [got[f"c{i}"] for i in range(len(prompts))] == want
    assert max(chunks) == 7 and chunks.count(7) >= 60 // 7  # capped, and the cap did chunk the long prompts
    assert_engine_idle(capped)


# ---- loading -----------------------------------------------------------------------------------
def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint(path, tmp_path, reference):
    import transformers as tf

    sharded = copy_model(path, tmp_path / "sharded")
    for f in sharded.glob("*.safetensors"):
        f.unlink()
    tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((sharded / s).is_file() for s in shards)
    llm = llm_for(sharded)
    assert tokens(llm.generate(TEXT_PROMPTS, greedy(12), use_tqdm=False)) == reference


def _to_v4_config(folder, rope_theta: float, dtype: str) -> None:
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    assert "rope_parameters" in cfg and "dtype" in cfg  # written by transformers 5
    del cfg["rope_parameters"], cfg["dtype"]
    cfg["rope_theta"] = rope_theta
    cfg["torch_dtype"] = dtype
    cfg["transformers_version"] = "4.46.0"
    cfg_file.write_text(json.dumps(cfg, indent=2))


def test_transformers_4_style_config(path, tmp_path, reference):
    old = copy_model(path, tmp_path / "v4")
    _to_v4_config(old, 10000.0, "float32")
    assert tokens(llm_for(old).generate(TEXT_PROMPTS, greedy(12), use_tqdm=False)) == reference
    # rope_theta is read from the 4.x key: another value changes the output.
    other = copy_model(path, tmp_path / "v4-theta")
    _to_v4_config(other, 50.0, "float32")
    assert tokens(llm_for(other).generate(TEXT_PROMPTS, greedy(12), use_tqdm=False)) != reference


def test_bfloat16_checkpoint_loads_with_auto(tmp_path, path):
    from safetensors import safe_open

    from tokenmill.platform import cpu_supports

    bf = make_tiny_model(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    with safe_open(str(bf / "model.safetensors"), framework="pt") as st:
        assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.bfloat16}
    llm = llm_for(bf, dtype="auto")
    expected = torch.bfloat16 if cpu_supports(torch.bfloat16) else torch.float32
    assert next(llm.engine.model.parameters()).dtype == expected
    assert llm.engine.runner.kv_dtype == expected
    sp = greedy(6, logprobs=1, ignore_eos=True)
    out = llm.generate(TEXT_PROMPTS, sp, use_tqdm=False)
    f32 = llm_for(bf, dtype="float32").generate(TEXT_PROMPTS, sp, use_tqdm=False)
    for a, b in zip(out, f32):
        assert len(a.outputs[0].token_ids) == 6
        t = b.outputs[0].token_ids[0]
        lp_a = a.outputs[0].logprobs[0]
        if t in lp_a:
            assert abs(lp_a[t].logprob - b.outputs[0].logprobs[0][t].logprob) < 0.1
    # The same checkpoint described in 4.x style (torch_dtype) is also recognised as bfloat16.
    _to_v4_config(bf, 10000.0, "bfloat16")
    assert next(llm_for(bf, dtype="auto").engine.model.parameters()).dtype == expected


# ---- KV pool sizing ----------------------------------------------------------------------------
def test_kv_cache_memory_bytes_sets_block_count(path):
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_size = 16
    per_block = cfg["num_hidden_layers"] * 2 * block_size * cfg["num_key_value_heads"] * head_dim * 4  # float32
    budget = 37 * per_block + per_block // 2
    llm = LLM(str(path), max_model_len=MAX_LEN, kv_cache_memory_bytes=budget, block_size=block_size)
    assert llm.engine.runner.bytes_per_block == per_block
    assert llm.engine.runner.num_blocks == budget // per_block == 37
    assert llm.engine.kv.num_blocks == 37
    k = llm.engine.runner.attn_layers[0].k_cache
    assert tuple(k.shape) == (37, block_size, cfg["num_key_value_heads"], head_dim)
    assert len(llm.generate(TEXT_PROMPTS, greedy(4), use_tqdm=False)) == len(TEXT_PROMPTS)


def test_kv_pool_too_small_for_max_model_len(path):
    # 128 tokens in blocks of 16 need 8 blocks.
    with pytest.raises(ValueError) as e:
        LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=7)
    assert "num_gpu_blocks_override" in str(e.value) and "max_model_len" in str(e.value)
    per_block = LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=8).engine.runner.bytes_per_block
    with pytest.raises(ValueError) as e:
        LLM(str(path), max_model_len=MAX_LEN, kv_cache_memory_bytes=8 * per_block - 1)
    assert "kv_cache_memory_bytes" in str(e.value) and "max_model_len" in str(e.value)
    assert LLM(str(path), max_model_len=MAX_LEN, kv_cache_memory_bytes=8 * per_block).engine.kv.num_blocks == 8


# ---- progress bar ------------------------------------------------------------------------------
def test_progress_bar(llm, capsys):
    llm.generate(TEXT_PROMPTS, greedy(2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(TEXT_PROMPTS, greedy(2), use_tqdm=False)
    captured = capsys.readouterr()
    assert "Processed prompts" not in captured.err + captured.out


def test_close_hands_the_kv_pool_back_even_while_the_model_is_referenced(path):
    """LLM.close() frees the pool although the caller still holds the runner (on a GPU a kept handle left 90 % of
    the card taken and the next engine in the process found 0 blocks): the storages shrink to nothing."""
    llm = LLM(str(path), max_model_len=MAX_LEN, num_gpu_blocks_override=16)
    runner = llm.engine.runner
    pools = runner.kv_caches()
    assert pools and all(t.untyped_storage().nbytes() > 0 for t in pools)
    llm.close()
    assert all(t.untyped_storage().nbytes() == 0 for t in pools) and runner.graphs is None

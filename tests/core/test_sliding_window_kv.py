"""Sliding-window KV (issue 29): blocks that slid out of an attention window are released as requests advance.

A model whose layers all share one window (Mistral) releases them from its one block table; a model mixing
windowed and full layers (Gemma 3) gets KV cache groups (executor/kv_groups.py), a block table per group over
one pool, and only the windowed groups release. Outputs equal transformers' in plain, chunked, preempted,
prefix-cached and n = 2 runs, on the native and the masked (torch SDPA) backends; a pool too small for whole
contexts runs more requests at once; --disable-hybrid-kv-cache-manager turns it off."""
from __future__ import annotations

import pytest

from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

WINDOW = 24  # tests/tiny.py's mistral
LENS = [40, 52, 61, 70, 77, 85, 90, 93]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("swa") / "mistral", "mistral")


@pytest.fixture(scope="module")
def prompts():
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope="module")
def oracle(mistral, prompts):
    return hf_greedy(mistral, prompts)


SP = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)


def idle(llm: LLM) -> None:
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    kv.check_invariants()


def run_all(llm: LLM, prompts) -> tuple[list, int]:
    """All prompts added at once and stepped to the end: their outputs, and the most blocks one request held."""
    engine, most, done = llm.engine, 0, {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, SP, prompt_token_ids=p)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[int(o.request_id)] = o
        most = max([most] + [r.num_held_blocks for r in engine.scheduler.running])
    idle(llm)
    return [done[i] for i in range(len(prompts))], most


# model fixture, its oracle's, its KV cache groups' windows, a roomy pool, a small pool. Mistral: 12 blocks, what one
# request needs at most with 64-token chunks (every block released as one is taken: requests wait to be admitted
# rather than preempt); Gemma 3: 40, where a context takes 16 blocks in the full group and up to 5 in each windowed
# one, and requests preempt each other.
MODELS = {"mistral": ("mistral", "oracle", (WINDOW,), 128, 12),
          "gemma3": ("gemma3", "gemma3_oracle", (None, WINDOW, WINDOW), 400, 40)}


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_sdpa"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_released_blocks_never_change_the_output(request, prompts, model, backend):
    name, oracle_name, windows, roomy, tight_blocks = MODELS[model]
    path, oracle = request.getfixturevalue(name), request.getfixturevalue(oracle_name)
    kw = dict(max_model_len=128, attention_backend=backend, block_size=8)
    plain = LLM(str(path), num_gpu_blocks_override=roomy, **kw)
    kv = plain.engine.kv
    assert kv.group_windows == windows
    check_against_oracle(plain.generate(prompts, SP, use_tqdm=False), oracle, f"{backend} plain")
    first = kv.stats.hits
    check_against_oracle(plain.generate(prompts, SP, use_tqdm=False), oracle, f"{backend} prefix hits")
    assert kv.num_released > 0 and kv.stats.hits - first > 0.8 * sum(map(len, prompts))  # the windows were there
    chunked = LLM(str(path), num_gpu_blocks_override=roomy, max_num_batched_tokens=16, **kw)
    check_against_oracle(chunked.generate(prompts, SP, use_tqdm=False), oracle, f"{backend} chunked")
    tight = LLM(str(path), num_gpu_blocks_override=tight_blocks, max_num_batched_tokens=64, **kw)
    check_against_oracle(tight.generate(prompts, SP, use_tqdm=False), oracle, f"{backend} tight pool")
    assert tight.engine.scheduler.num_preemptions > 0 or None not in windows
    two = plain.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, n=2), use_tqdm=False)
    for out, (tokens, _) in zip(two, oracle[:3]):
        assert [c.token_ids for c in out.outputs] == [tokens, tokens]
    for llm in (plain, chunked, tight):
        idle(llm)


def test_a_request_holds_about_a_window_so_a_small_pool_never_preempts(mistral, prompts, oracle):
    """32 blocks of 8, eight requests of up to 125 tokens, prompts in chunks of 8: holding whole contexts (up to
    16 blocks each) the pool runs dry and requests are preempted; holding the window (24 tokens) and the chunk
    being computed, none is."""
    def run(**kw):
        llm = LLM(str(mistral), max_model_len=128, num_gpu_blocks_override=32, block_size=8,
                  long_prefill_token_threshold=8, **kw)
        outs, most = run_all(llm, prompts)
        return outs, most, llm.engine.scheduler.num_preemptions, llm.engine.kv.num_released

    outs, most, preempted, released = run()
    kept_outs, kept_most, kept_preempted, kept_released = run(disable_hybrid_kv_cache_manager=True)
    check_against_oracle(outs, oracle, "released")
    check_against_oracle(kept_outs, oracle, "kept")
    assert released > 0 and kept_released == 0
    assert most <= (WINDOW + 8) // 8 + 1 and kept_most >= 15, (most, kept_most)
    assert preempted == 0 and kept_preempted > 0


def test_a_model_whose_layers_all_slide_releases(tmp_path):
    path = make_tiny_model(tmp_path / "gemma3", "gemma3", layer_types=["sliding_attention"] * 2)
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, block_size=8)
    assert llm.engine.kv.group_windows == (24,)
    llm.generate([list(range(3, 80))], SamplingParams(max_tokens=8), use_tqdm=False)
    assert llm.engine.kv.num_released > 0


def test_failed_steps_resend_tables_with_released_blocks(mistral, prompts, oracle, monkeypatch):
    """Request 6 fails in sampling at its first step, admitted while earlier ones (of staggered lengths) have
    released blocks: the step reruns one request at a time and the workers get those requests' block tables
    whole again, their released entries naming a block they hold. Only request 6 fails; the others finish with
    transformers' output."""
    resent = fail_request_6(mistral, prompts, oracle, monkeypatch)
    assert any(n for _, n in resent[len(prompts):]), resent  # a resent table had released entries


def fail_request_6(path, prompts, oracle, monkeypatch) -> list[tuple[int, int]]:
    """Run the prompts with request 6 failing in sampling at its first step; check that only it fails and the
    pool is whole after. Returns the (group, released entries) of every block table sent whole."""
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.testing import faults

    resent = []
    table = Scheduler._table
    monkeypatch.setattr(Scheduler, "_table", staticmethod(
        lambda req, group: resent.append((group, req.num_released[group])) or table(req, group)))
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=200, block_size=8, max_num_seqs=4)
    lengths = [8 + 3 * i for i in range(len(prompts))]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths]
    monkeypatch.setenv(faults.ENV, "sample=6")
    outs = llm.generate(prompts, sps, use_tqdm=False)
    monkeypatch.delenv(faults.ENV)
    assert [o.outputs[0].finish_reason == "abort" for o in outs] == [i == 6 for i in range(len(prompts))]
    for i, (o, (tokens, _)) in enumerate(zip(outs, oracle)):
        if i != 6:
            assert o.outputs[0].token_ids == tokens[: lengths[i]], i
    idle(llm)
    return resent


# ---- KV cache groups: Gemma 3's windowed layers release, its full layers keep -------------------------------
GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]  # 3 groups of one layer: full, 24, 24


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("swa") / "gemma3", "gemma3", num_hidden_layers=3,
                           layer_types=GEMMA_LAYERS)


@pytest.fixture(scope="module")
def gemma3_oracle(gemma3, prompts):
    return hf_greedy(gemma3, prompts)


def test_kv_groups_fit_more_requests_in_the_same_memory(gemma3, prompts, gemma3_oracle):
    """The same KV bytes with and without groups: a block of the grouped pool is one layer's K/V (three layers'
    without), and a request holds its context in the full group and about a window in the windowed ones, so the
    grouped pool runs the eight requests without preempting; holding every layer's whole context it preempts.
    (With one full layer in three the saving is at most 3x; Gemma 3's one in six: benchmarks/long_context.py.)"""
    def run(**kw):
        llm = LLM(str(gemma3), max_model_len=128, block_size=8, long_prefill_token_threshold=8,
                  kv_cache_memory_bytes=kv_bytes, **kw)
        outs, most = run_all(llm, prompts)
        info = llm.engine.core.info
        return outs, most * info.bytes_per_block, llm.engine.scheduler.num_preemptions, info

    per_layer_block = 2 * 8 * 2 * 16 * 4  # K and V, 8 tokens, 2 KV heads, head_dim 16, float32
    # 80 blocks of all three layers: five whole contexts of up to 125 tokens, fewer than the eight requests; grouped,
    # 240 blocks of one layer, and each request needs at most 16 + 2 x 5 of them
    kv_bytes = 3 * per_layer_block * 80
    outs, most, preempted, info = run()
    kept_outs, kept_most, kept_preempted, kept_info = run(disable_hybrid_kv_cache_manager=True)
    assert info.kv_group_windows == (None, WINDOW, WINDOW) and kept_info.kv_group_windows == (None,)
    assert info.bytes_per_block == per_layer_block and kept_info.bytes_per_block == 3 * per_layer_block
    assert info.num_blocks == 3 * kept_info.num_blocks
    check_against_oracle(outs, gemma3_oracle, "groups")
    check_against_oracle(kept_outs, gemma3_oracle, "kept")
    # one request's most: its whole context in one layer and (24 + 8) tokens in two, against three whole contexts
    assert most <= per_layer_block * (16 + 2 * ((WINDOW + 8) // 8 + 1)) and kept_most >= 15 * 3 * per_layer_block
    assert preempted == 0 and kept_preempted > 0


def test_a_failed_step_resends_every_groups_table(gemma3, prompts, gemma3_oracle, monkeypatch):
    """As test_failed_steps_resend_tables_with_released_blocks, with three block tables per request."""
    resent = fail_request_6(gemma3, prompts, gemma3_oracle, monkeypatch)
    assert {g for g, _ in resent} == {0, 1, 2}
    assert any(n for g, n in resent[3 * len(prompts):] if g) and not any(n for g, n in resent if g == 0)


def test_groups_off_keeps_one_table(gemma3):
    llm = LLM(str(gemma3), max_model_len=128, num_gpu_blocks_override=64, block_size=8,
              disable_hybrid_kv_cache_manager=True)
    assert llm.engine.kv.group_windows == (None,)
    llm.generate([list(range(3, 80))], SamplingParams(max_tokens=8), use_tqdm=False)
    assert llm.engine.kv.num_released == 0
    idle(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_kv_groups_with_speculation(gemma3, prompts, gemma3_oracle, tmp_path_factory, method):
    """A drafter keeps its K/V in the full group's blocks (group 0 never releases); rejected drafts' slots are
    trimmed in every group. Greedy output equals transformers', plain and on a pool that preempts; a model whose
    every layer slides keeps all blocks with a drafter."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=2, num_hidden_layers=1))
    else:
        spec["prompt_lookup_max"] = 3
    for kw in (dict(num_gpu_blocks_override=400), dict(num_gpu_blocks_override=44, max_num_batched_tokens=64)):
        llm = LLM(str(gemma3), max_model_len=128, block_size=8, speculative_config=spec, **kw)
        assert llm.engine.kv.group_windows == (None, WINDOW, WINDOW)
        check_against_oracle(llm.generate(prompts, SP, use_tqdm=False), gemma3_oracle, f"{method} {kw}")
        assert llm.engine.kv.num_released > 0
        if method == "draft_model":
            assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
        if kw["num_gpu_blocks_override"] == 44:
            assert llm.engine.scheduler.num_preemptions > 0
        idle(llm)
    sliding = make_tiny_model(tmp_path_factory.mktemp("all_local"), "gemma3", layer_types=["sliding_attention"] * 2)
    llm = LLM(str(sliding), max_model_len=128, num_gpu_blocks_override=64, block_size=8, speculative_config=spec)
    assert llm.engine.kv.group_windows == (None,)


def test_kv_groups_with_the_host_and_disk_tiers(gemma3, prompts, gemma3_oracle, tmp_path):
    """Blocks of every group are saved to the lower tiers under their group's key when evicted and loaded back
    for a prefix hit: the full group's whole chain, each windowed group's window before the hit's end. A pool of
    50 blocks evicts every request's blocks before the next one; the second pass loads its prefixes back and
    equals transformers."""
    llm = LLM(str(gemma3), max_model_len=128, block_size=8, num_gpu_blocks_override=50, kv_offload_bytes=2 << 20,
              kv_offload_dir=str(tmp_path / "kv"), kv_offload_min_blocks=1)
    assert llm.engine.kv.group_windows == (None, WINDOW, WINDOW)
    for _ in range(2):
        outs = [llm.generate([p], SP, use_tqdm=False)[0] for p in prompts]
        check_against_oracle(outs, gemma3_oracle, "tiers")
    st = llm.engine.kv.offload.stats
    assert st.saves > 0 and st.host_loads + st.disk_loads > 0 and st.load_failures == 0, st
    groups = {llm.engine.kv.blocks[b].group for b in llm.engine.kv.cached.values()}
    assert groups == {0, 1, 2}
    idle(llm)

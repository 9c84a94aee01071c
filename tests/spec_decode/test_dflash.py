"""Block drafting (issue 30, `method: "dflash"`, spec_decode/dflash.py): a drafter emitting a block of K drafts in
one forward over the target's hidden state, cut by its acceptance estimate (DSpark). Greedy output equals no
speculation (plain, chunked, preempted, both backends; prefix hits, n = 2, stop strings, structured output); a
drafter that copies a constant target has every draft accepted, and its estimate decides the block length; the
layout is checked on load; `tokenmill train-dflash` writes a drafter that serves."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compare import assert_same_outputs
from medusa_tiny import make_constant_target
from spec_exactness import assert_exact_with_prefix_hits_n2_stops_and_grammar
from test_speculative import GREEDY, KV, PROMPTS
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.dflash import BlockDrafter, BlockDrafterConfig, block_lengths, load_block_drafter


def write_drafter(folder, target_dir, block: int = 4, seed: int = 0, copy_dim: int | None = None,
                  accept_bias: float | None = None):
    """A random block drafter for the target (2 layers, 2 heads), or with copy_dim: every position's feature is
    the target's hidden state's component copy_dim alone (the blocks add nothing), which a constant target's LM
    head maps to its token. accept_bias: a constant acceptance estimate sigmoid(bias) at every position."""
    cfg_t = json.loads((target_dir / "config.json").read_text())
    H, V = cfg_t["hidden_size"], cfg_t["vocab_size"]
    d = BlockDrafter(BlockDrafterConfig(block, H, 2, 2, 2 * H, V), accept=accept_bias is not None or copy_dim is None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if copy_dim is None:
            for p in d.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            d.norm.fill_(1.0)
        else:
            d.in_proj_weight[copy_dim, copy_dim] = 1.0
            d.norm.fill_(1.0)
            d.attn_norm.fill_(1.0)
            d.mlp_norm.fill_(1.0)
        if accept_bias is not None:
            d.accept_weight.zero_()
            d.accept_bias.fill_(accept_bias)
    return d.save(folder)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=1)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, target):
    return write_drafter(tmp_path_factory.mktemp("dflash"), target)


@pytest.fixture(scope="module")
def baseline(target):
    return [o.outputs[0] for o in LLM(str(target), **KV).generate(PROMPTS, GREEDY, use_tqdm=False)]


def dflash(folder, k: int = 4, threshold: float = 0.0) -> dict:
    return {"method": "dflash", "model": str(folder), "num_speculative_tokens": k, "adaptive": False,
            "block_threshold": threshold}


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
@pytest.mark.parametrize("mode", ["plain", "chunked", "preempted"])
def test_greedy_output_equals_no_speculation(target, drafter, baseline, mode, backend):
    kw = {"plain": {}, "chunked": dict(max_num_batched_tokens=24, block_size=4),
          "preempted": dict(num_gpu_blocks_override=44, block_size=4, max_num_batched_tokens=32, max_model_len=160)}
    llm = LLM(str(target), speculative_config=dflash(drafter), attention_backend=backend, **{**KV, **kw[mode]})
    out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_same_outputs(baseline, out, f"dflash/{mode}")
    core = llm.engine.core
    st = core.scheduler.spec_stats
    assert st.num_draft_tokens > 3 * st.num_drafts > 0  # blocks of 4 (threshold 0: whole blocks)
    if mode == "preempted":
        assert core.scheduler.num_preemptions > 0
    assert core.kv.usage == 0.0


def test_prefix_hits_n_two_stop_strings_and_structured_output(target, drafter):
    assert_exact_with_prefix_hits_n2_stops_and_grammar(target, dflash(drafter))


@pytest.mark.parametrize("bias, per_verification", [(6.0, 4), (-6.0, 1)])
def test_a_copy_drafter_is_accepted_and_its_estimate_sets_the_block(target, tmp_path, bias, per_verification):
    """A constant target (always token 42) and a drafter whose every position reads it: all drafts accepted.
    Estimated acceptance sigmoid(6) per position keeps the whole block of 4 (0.99^4 >= 0.3); sigmoid(-6) cuts
    every block to its one-draft minimum."""
    path = tmp_path / "constant"
    shutil.copytree(target, path)
    make_constant_target(path, token=42)
    folder = write_drafter(tmp_path / "copy", path, copy_dim=0, accept_bias=bias)
    llm = LLM(str(path), speculative_config=dflash(folder, k=4, threshold=0.3), **KV)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) == {42} for o in out)
    st = llm.engine.core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.num_draft_tokens <= per_verification * st.num_drafts
    assert st.num_draft_tokens >= per_verification * (st.num_drafts - len(PROMPTS))  # (fewer near max_tokens)


def test_block_lengths_cut_at_the_estimated_acceptance():
    est = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.9, 0.9, 0.9], [0.1, 1.0, 1.0, 1.0]])
    assert block_lengths(est, 0.7, 4).tolist() == [3, 1, 1]  # 0.9^3 = 0.73, 0.9^4 = 0.66
    assert block_lengths(est, 0.0, 4).tolist() == [4, 4, 4]
    assert block_lengths(est, 0.0, 2).tolist() == [2, 2, 2]


def test_sampling_with_blocks_is_seeded(target, drafter):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    llm = LLM(str(target), speculative_config=dflash(drafter), **KV)
    a = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert a == b and llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0


def test_bad_folders_fail_naming_what_is_wrong(target, drafter, tmp_path):
    def broken(name: str, edit) -> str:
        folder = tmp_path / name
        shutil.copytree(drafter, folder)
        edit(folder)
        return str(folder)

    def drop_marker(f):
        cfg = json.loads((f / "config.json").read_text())
        del cfg["tokenmill_block_drafter"]
        (f / "config.json").write_text(json.dumps(cfg))

    def other_vocab(f):
        cfg = json.loads((f / "config.json").read_text())
        cfg["vocab_size"] += 1
        (f / "config.json").write_text(json.dumps(cfg))

    def drop_tensor(f):
        w = load_file(str(f / "block_drafter.safetensors"))
        del w["layers.1.qkv.weight"]
        save_file(w, str(f / "block_drafter.safetensors"))

    cases = [(broken("marker", drop_marker), "not a tokenmill block drafter"),
             (broken("vocab", other_vocab), "vocabulary"),
             (broken("tensor", drop_tensor), "lacks layers.1.qkv.weight"),
             (str(tmp_path / "missing"), "no config.json")]
    for folder, message in cases:
        with pytest.raises(ValueError, match=message):
            load_block_drafter(folder, 64, 384, torch.float32)
    with pytest.raises(ValueError, match="needs a model"):
        LLM(str(target), speculative_config={"method": "dflash"}, **KV)
    with pytest.raises(ValueError, match="block_threshold"):
        LLM(str(target), speculative_config={"method": "dflash", "model": str(drafter), "block_threshold": 2}, **KV)


def test_train_dflash_writes_a_drafter_that_loads_and_serves(target, tmp_path, baseline):
    from tokenmill.spec_decode.dflash_train import train_dflash

    r = train_dflash(str(target), str(tmp_path / "block"), block_size=3, steps=20, batch=32, max_tokens=16,
                     prompts=["hello there", "the quick brown fox", "SELECT * FROM", "once upon a time"],
                     kv_cache_memory_bytes=8 << 20)
    assert r.sequences == 4 and r.positions > 40 and len(r.top1) == 3 and 0 <= r.accepted <= 3
    d = load_block_drafter(str(tmp_path / "block"), 64, 384, torch.float32)
    assert d.cfg.block_size == 3 and d.accept_weight is not None and d.qkv.abs().sum() > 0
    llm = LLM(str(target), speculative_config=dflash(tmp_path / "block", k=3, threshold=0.0), **KV)
    out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_same_outputs(baseline, out, "trained drafter")
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0

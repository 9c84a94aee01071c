"""Medusa heads (issue 30, spec_decode/medusa.py): loaded from the published layout, run over the row of the
target's hidden states that produced each request's last token; greedy output equals no speculation (plain,
chunked, preempted, prefix hits, n = 2 with stop strings) with random heads; heads that copy a target's path
have every draft accepted; sampling with heads stays seeded and exact in distribution (point-mass drafts); bad
folders fail naming what is wrong; the proposer registry names every method the config accepts."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compare import assert_same_outputs
from medusa_tiny import make_constant_target, write_medusa
from spec_exactness import assert_exact_with_prefix_hits_n2_stops_and_grammar
from test_speculative import GREEDY, KV, PROMPTS
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SPEC_METHODS
from tokenmill.spec_decode.medusa import load_medusa
from tokenmill.spec_decode.proposers import PROPOSERS


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=1)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    return write_medusa(tmp_path_factory.mktemp("medusa"), target, heads=4, layers=1)


@pytest.fixture(scope="module")
def baseline(target):
    return [o.outputs[0] for o in LLM(str(target), **KV).generate(PROMPTS, GREEDY, use_tqdm=False)]


CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


def medusa(folder, k: int = 3, choices=None) -> dict:
    spec = {"method": "medusa", "model": str(folder), "num_speculative_tokens": k, "adaptive": False}
    return spec if choices is None else {**spec, "medusa_choices": choices}


def test_the_registry_names_every_method_the_config_accepts():
    assert set(PROPOSERS) == set(SPEC_METHODS)
    assert PROPOSERS["medusa"].kind == "lookup" and PROPOSERS["eagle"].kind == "head"


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("mode", ["plain", "chunked", "preempted"])
def test_greedy_output_equals_no_speculation(target, heads, baseline, mode, shape, backend):
    kw = {"plain": {}, "chunked": dict(max_num_batched_tokens=24, block_size=4),
          "preempted": dict(num_gpu_blocks_override=44, block_size=4, max_num_batched_tokens=32, max_model_len=160)}
    spec = medusa(heads, k=3 if shape == "chain" else 8, choices=CHAIN if shape == "chain" else None)
    llm = LLM(str(target), speculative_config=spec, attention_backend=backend, **{**KV, **kw[mode]})
    runner = llm.engine.core.executor.worker.runner
    moved = []  # accepted paths off the first nodes: their K/V moved into place
    compact = runner._compact_accepted_paths
    runner._compact_accepted_paths = lambda inp, trees, index, rows: moved.extend(
        r for t, r in zip(trees, rows) if [x - t.root_row - 1 for x in r[1:]] != list(range(len(r) - 1))) or \
        compact(inp, trees, index, rows)
    out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_same_outputs(baseline, out, f"medusa/{mode}")
    core = llm.engine.core
    st = core.scheduler.spec_stats
    assert st.num_draft_tokens > 0
    if shape == "tree":  # 8 nodes verified per step, more than the 4 heads' chain could; some paths moved
        assert st.num_draft_tokens > 4 * st.num_drafts and moved
    if mode == "preempted":
        assert core.scheduler.num_preemptions > 0
    assert core.kv.usage == 0.0


def test_prefix_hits_n_two_stop_strings_and_structured_output(target, heads):
    assert_exact_with_prefix_hits_n2_stops_and_grammar(target, medusa(heads, k=8))


def test_heads_read_the_row_that_produced_the_last_token(target, tmp_path):
    """Heads whose projection is the target's LM head predict, from the right row, the token the target just
    emitted: every proposal (greedy) is that token k times, whatever the step was (a prompt's last chunk, a
    decode, a verification that accepted some drafts)."""
    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    folder = write_medusa(tmp_path / "echo", target, heads=3, proj=lm_head)
    llm = LLM(str(target), speculative_config=medusa(folder, choices=CHAIN), max_num_batched_tokens=24, block_size=4,
              **KV)
    drafter = llm.engine.core.executor.worker.runner.spec.drafter
    seen = []
    propose = drafter.propose

    def recording(view, want, k):
        out = propose(view, want, k)
        seen.extend((d.token_ids, view.accepted[i][-1]) for i, d in out.items())
        return out

    drafter.propose = recording
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(seen) > 20 and all(tokens == [last] * 3 for tokens, last in seen)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_copy_heads_have_every_draft_of_their_path_accepted(target, tmp_path, shape):
    """A target that answers one token after any token, and heads whose top candidate is that token: a chain of
    k is accepted whole (k + 1 tokens per verification); in a tree, every node on the path of top candidates is
    (the default tree's first 8 nodes hold that path to depth 3: 4 tokens per verification)."""
    path = tmp_path / "constant"
    shutil.copytree(target, path)
    proj = make_constant_target(path, token=42)
    folder = write_medusa(tmp_path / "copy", path, heads=4, proj=proj)
    k = 4 if shape == "chain" else 8
    llm = LLM(str(path), speculative_config=medusa(folder, k=k, choices=CHAIN if shape == "chain" else None), **KV)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) == {42} for o in out)
    st = llm.engine.core.scheduler.spec_stats
    per_step = 4 if shape == "chain" else 3  # accepted drafts per verification
    assert st.num_drafts > 0 and st.num_accepted_tokens >= per_step * (st.num_drafts - len(PROMPTS))
    assert st.num_accepted_tokens <= per_step * st.num_drafts
    if shape == "chain":
        assert st.num_accepted_tokens == st.num_draft_tokens


def test_sampling_with_heads_is_seeded(target, heads):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in
             LLM(str(target), speculative_config=medusa(heads, k=8), **KV).generate(PROMPTS, params, use_tqdm=False)]
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 20 for t in runs[0])


def test_heads_without_projections_use_the_targets_lm_head(target, tmp_path, baseline):
    """The tokenmill extension: no medusa_head.{i}.{L}.weight -> the target's LM head: the same proposals as heads
    holding a copy of it, and greedy output equal to no speculation."""
    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    full = write_medusa(tmp_path / "full", target, heads=3, seed=4)
    w = load_file(str(full / "medusa_lm_head.safetensors"))
    shared = tmp_path / "shared"
    shutil.copytree(full, shared)
    save_file({k: v for k, v in w.items() if not k.endswith(".1.weight")}, str(shared / "medusa_lm_head.safetensors"))
    for k in list(w):
        if k.endswith(".1.weight"):
            w[k] = lm_head.clone()
    save_file(w, str(full / "medusa_lm_head.safetensors"))
    a = load_medusa(str(full), 64, 384, torch.float32)
    b = load_medusa(str(shared), 64, 384, torch.float32)
    assert b.proj is None
    b.lm_head = lambda x: x @ lm_head.T
    h = torch.randn(5, 64)
    torch.testing.assert_close(a(h), b(h))
    llm = LLM(str(target), speculative_config=medusa(shared, k=6), **KV)
    assert_same_outputs(baseline, [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], "shared")
    w.pop("medusa_head.1.1.weight")
    save_file(w, str(full / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="either every head"):
        load_medusa(str(full), 64, 384, torch.float32)


def test_pt_layout_and_unprefixed_names_load_the_same(target, tmp_path):
    a = load_medusa(str(write_medusa(tmp_path / "a", target, seed=5)), 64, 384, torch.float32)
    b = load_medusa(str(write_medusa(tmp_path / "b", target, seed=5, fmt="pt", prefix="")), 64, 384, torch.float32)
    assert torch.equal(a.proj, b.proj) and torch.equal(a.res_weight, b.res_weight)


def test_bad_folders_fail_naming_what_is_wrong(target, tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_medusa(str(tmp_path), 64, 384, torch.float32)
    folder = write_medusa(tmp_path / "m", target)
    w = load_file(str(folder / "medusa_lm_head.safetensors"))
    save_file({k: v for k, v in w.items() if k != "medusa_head.2.1.weight"}, str(folder / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"lacks medusa_head.2.1.weight"):
        load_medusa(str(folder), 64, 384, torch.float32)
    with pytest.raises(ValueError, match=r"the target's hidden size 32"):
        load_medusa(str(write_medusa(tmp_path / "n", target)), 32, 384, torch.float32)
    with pytest.raises(ValueError, match="needs a model"):
        LLM(str(target), speculative_config={"method": "medusa"})


def test_train_medusa_writes_heads_that_load_and_serve(target, tmp_path, baseline):
    """`tokenmill train-medusa` end to end on the tiny target: its continuations, features and a few steps; the
    folder holds residual blocks only (the target's LM head serves as the projection), loads, serves with output
    equal to no speculation, and its training moved the heads off their zero start."""
    from tokenmill.spec_decode.medusa_train import train_medusa

    r = train_medusa(str(target), str(tmp_path / "heads"), heads=2, steps=20, batch=32, max_tokens=16,
                     prompts=["hello there", "the quick brown fox", "SELECT * FROM", "once upon a time"],
                     kv_cache_memory_bytes=8 << 20)
    assert r.sequences == 4 and r.positions > 40 and len(r.top1) == 2
    w = load_file(str(tmp_path / "heads" / "medusa_lm_head.safetensors"))
    assert sorted(w) == [f"medusa_head.{i}.0.linear.{p}" for i in range(2) for p in ("bias", "weight")]
    assert all(t.abs().sum() > 0 for t in w.values())
    heads = load_medusa(str(tmp_path / "heads"), 64, 384, torch.float32)
    assert heads.proj is None and heads.num_heads == 2
    llm = LLM(str(target), speculative_config=medusa(tmp_path / "heads", k=3), **KV)
    out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_same_outputs(baseline, out, "trained heads")

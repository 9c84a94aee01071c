"""EAGLE-2 dynamic draft trees (issue 30, spec_decode/eagle_tree.py): a draft head grown into a tree per step and
verified as one. Greedy output equals no speculation (EAGLE, EAGLE-3, MTP; plain, chunked, preempted; both
backends; prefix hits, n = 2, stop strings, structured output); the tree's top path is the chain the same head
drafts (the tree attention in the head is right); a head that copies the target has its whole top path accepted;
sampling stays seeded; bad shapes are refused."""
from __future__ import annotations

import pytest
import torch

from compare import assert_same_outputs
from draft_heads_tiny import add_mtp_layers, make_bigram_target, write_eagle3_head, write_eagle_head
from spec_exactness import assert_exact_with_prefix_hits_n2_stops_and_grammar
from test_speculative import GREEDY, KV, PROMPTS
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=4)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target):
    return write_eagle_head(tmp_path_factory.mktemp("eagle"), target, copy=False)


@pytest.fixture(scope="module")
def baseline(target):
    return [o.outputs[0] for o in LLM(str(target), **KV).generate(PROMPTS, GREEDY, use_tqdm=False)]


def tree_spec(method: str, model=None, k: int = 10, topk: int = 3, depth: int = 4) -> dict:
    spec = {"method": method, "num_speculative_tokens": k, "tree_topk": topk, "tree_depth": depth, "adaptive": False}
    return spec if model is None else {**spec, "model": str(model)}


def recording(llm) -> list:
    """Wrap the draft runner's propose: records (sequence so far, draft) for every proposal."""
    runner = llm.engine.core.executor.worker.runner.spec.drafter
    seen, propose = [], runner.propose

    def wrapped(view, want, k, catch_up_all):
        out = propose(view, want, k, catch_up_all)
        seen.extend((tuple(view.tokens(i, 0, view.length(i))), d) for i, d in out.items())
        return out

    runner.propose = wrapped
    return seen


def top_path(draft) -> list[int]:
    """The tokens along each level's first child (a node's children are listed best first)."""
    if draft.parents is None:
        return draft.token_ids
    path, node = [], -1
    while True:
        child = next((m for m, p in enumerate(draft.parents) if p == node), None)
        if child is None:
            return path
        path.append(draft.token_ids[child])
        node = child


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
@pytest.mark.parametrize("mode", ["plain", "chunked", "preempted"])
def test_greedy_output_equals_no_speculation(target, head, baseline, mode, backend):
    kw = {"plain": {}, "chunked": dict(max_num_batched_tokens=24, block_size=4),
          "preempted": dict(num_gpu_blocks_override=44, block_size=4, max_num_batched_tokens=32, max_model_len=160)}
    llm = LLM(str(target), speculative_config=tree_spec("eagle", head), attention_backend=backend,
              **{**KV, **kw[mode]})
    seen = recording(llm)
    out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_same_outputs(baseline, out, f"eagle tree/{mode}")
    trees = [d for _, d in seen if d.parents is not None]
    assert trees and all(len(d.token_ids) == 10 for d in trees)
    core = llm.engine.core
    if mode == "preempted":
        assert core.scheduler.num_preemptions > 0
    assert core.kv.usage == 0.0


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_other_heads_grow_trees_with_output_unchanged(tmp_path, method):
    target = make_tiny_model(tmp_path / "target", "llama", seed=4)
    base = [o.outputs[0] for o in LLM(str(target), **KV).generate(PROMPTS, GREEDY, use_tqdm=False)]
    if method == "eagle3":
        spec = tree_spec("eagle3", write_eagle3_head(tmp_path / "eagle3", target, copy=False), k=8, topk=2)
    else:
        add_mtp_layers(target, copy=False)
        spec = tree_spec("mtp", k=8, topk=2)
    llm = LLM(str(target), speculative_config=spec, max_num_batched_tokens=24, block_size=4, **KV)
    seen = recording(llm)
    out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    if method == "eagle3":
        assert_same_outputs(base, out, method)
    else:  # the MTP layers change the checkpoint but not the target's own output
        assert [o.token_ids for o in out] == [o.token_ids for o in base]
    assert any(d.parents is not None for _, d in seen) and llm.engine.core.kv.usage == 0.0


def test_the_trees_top_path_is_the_chain_the_head_drafts(target, head):
    """Where the chain run and the tree run draft after the same sequence, the tree's path of first children is
    a prefix of the chain's drafts: the head saw each node's ancestors, positions and features as a chain's."""
    chain_llm = LLM(str(target), speculative_config=tree_spec("eagle", head, k=4, topk=1), **KV)
    chain_seen = recording(chain_llm)
    chain_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tree_llm = LLM(str(target), speculative_config=tree_spec("eagle", head, k=12, topk=3, depth=5), **KV)
    tree_seen = recording(tree_llm)
    tree_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    chains = {ctx: d.token_ids for ctx, d in chain_seen}
    compared = deep = 0
    for ctx, d in tree_seen:
        if ctx in chains and d.parents is not None:
            path = top_path(d)
            assert path == chains[ctx][: len(path)], ctx
            compared += 1
            deep += len(path) >= 2
    assert compared > 20 and deep > 0


def test_a_copy_head_has_its_whole_top_path_accepted(tmp_path):
    target = make_bigram_target(make_tiny_model(tmp_path / "bigram", "llama", seed=3))
    head = write_eagle_head(tmp_path / "copy", target, copy=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    base = LLM(str(target), **KV).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(target), speculative_config=tree_spec("eagle", head), **KV)
    seen = recording(llm)
    req = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert req.outputs[0].token_ids == base.token_ids
    lengths = [len(ctx) for ctx, _ in seen]
    end = len(req.prompt_token_ids) + params.max_tokens
    for (ctx, d), nxt in zip(seen, lengths[1:]):  # each step emits the whole top path and one token more
        if len(ctx) + len(d.token_ids) < end:  # (near max_tokens the scheduler verifies fewer nodes)
            assert nxt - len(ctx) == len(top_path(d)) + 1
    assert sum(len(top_path(d)) for _, d in seen) >= len(seen) + 3  # some paths go past the first level


def test_prefix_hits_n_two_stop_strings_and_structured_output(target, head):
    assert_exact_with_prefix_hits_n2_stops_and_grammar(target, tree_spec("eagle", head))


def test_sampling_with_trees_is_seeded(target, head):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    llm = LLM(str(target), speculative_config=tree_spec("eagle", head), **KV)
    seen = recording(llm)
    a = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert a == b and any(d.parents is not None for _, d in seen)


def test_bad_tree_shapes_are_refused():
    with pytest.raises(ValueError, match="tree_topk"):
        SpeculativeConfig.parse({"method": "ngram", "tree_topk": 2})
    with pytest.raises(ValueError, match="tree_depth"):
        SpeculativeConfig.parse({"method": "eagle", "model": "x", "tree_topk": 2, "tree_depth": 1})
    with pytest.raises(ValueError, match="tree_topk"):
        SpeculativeConfig.parse({"method": "eagle", "model": "x", "tree_topk": 0})


def test_train_eagle_writes_a_head_tokenmill_runs_as_it_was_trained(target, tmp_path, baseline):
    """The head train-eagle writes, loaded by tokenmill and run under its paged attention, gives the training
    module's outputs (the layout, rotary and norms agree); it serves with trees, output unchanged."""
    import json

    from safetensors.torch import load_file, save_file

    from test_draft_heads import load, load_target, run_head, target_features
    from tokenmill.spec_decode.eagle_train import TrainableEagle, train_eagle

    r = train_eagle(str(target), str(tmp_path / "head"), steps=15, batch=2, max_tokens=16,
                    prompts=["hello there", "the quick brown fox", "SELECT * FROM", "once upon a time"],
                    kv_cache_memory_bytes=8 << 20)
    assert r.sequences == 4 and 0.0 <= r.top1 <= 1.0
    folder = tmp_path / "head"
    trained = TrainableEagle(json.loads((folder / "config.json").read_text()))
    w = load_file(str(folder / "model.safetensors"))
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):  # the layer must matter
        w[name] = w[name] * 30
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    trained.fc.load_state_dict({k[3:]: v for k, v in w.items() if k.startswith("fc.")})
    trained.layer.load_state_dict({k[9:]: v for k, v in w.items() if k.startswith("layers.0.")})
    model = load_target(target)
    head = load("eagle", folder, model, target)
    ids = torch.randint(0, model.spec.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    _, feats = target_features(model, ids)
    nxt, _ = run_head(head, ids[1:], feats[:-1], [11])
    with torch.no_grad():
        want = trained(model.embed_tokens(ids[1:]).float().unsqueeze(0), feats[:-1].unsqueeze(0))[0]
    assert (want - trained.fc(torch.cat([model.embed_tokens(ids[1:]).float(), feats[:-1]], -1))).abs().max() > 0.1
    torch.testing.assert_close(nxt, want, atol=2e-4, rtol=2e-4)
    llm = LLM(str(target), speculative_config=tree_spec("eagle", folder), **KV)
    out = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert_same_outputs(baseline, out, "trained head")

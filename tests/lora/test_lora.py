"""LoRA adapters against transformers + PEFT (the oracle) on tiny random models: every adapter's greedy tokens
and logprobs equal PEFT's, alone and mixed with other adapters and the base model in one batch, with chunked
prefill, preemption, fewer slots than adapters, and the prefix cache on. Bad adapters are refused at admission
with the file and the reason, and the engine goes on serving."""
from __future__ import annotations

import json

import pytest
import torch

from lora_tiny import ALL, make_adapter, no_failed_steps, peft_greedy  # noqa: F401 (an autouse fixture)
from test_parity import check_against_oracle, prompts_for
from tiny import make_tiny_model
from tokenmill import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 12


# (rank, alpha, rsLoRA, targets): ranks 1 / 8 / 64, alpha != r, rsLoRA on and off, packed and single layers.
ADAPTERS = {
    "r1": (1, 4, False, ALL),
    "r8-rslora-qv": (8, 16, True, ["q_proj", "v_proj"]),
    "r64-mlp-o": (64, 32, False, ["o_proj", "gate_proj", "down_proj"]),
    "r8-all": (8, 8, False, ALL),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def family(request, tmp_path_factory):
    """A base model, four adapters and the oracle's outputs for three prompts under each (and the base)."""
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_model(root / "base", request.param)
    prompts = prompts_for(384, seed=3)[1:7:2]  # 9, 21, 38 tokens
    adapters = {name: make_adapter(base, root / name, r, a, rs, t, seed=i)
                for i, (name, (r, a, rs, t)) in enumerate(ADAPTERS.items())}
    oracle = {name: peft_greedy(base, path, prompts, NEW_TOKENS) for name, path in adapters.items()}
    oracle[None] = peft_greedy(base, None, prompts, NEW_TOKENS)
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    return base, prompts, requests, oracle


def mixed(prompts, requests):
    """Every prompt under every adapter and the base model, interleaved (one batch mixes them all)."""
    order = [None, *requests]
    return ([p for p in prompts for _ in order], [requests.get(n) for _ in prompts for n in order],
            [n for _ in prompts for n in order])


def check(llm, prompts, requests, oracle, label):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    ps, loras, names = mixed(prompts, requests)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False, lora_request=loras)
    for i, name in enumerate(names):
        check_against_oracle([outs[i]], [oracle[name][i // (len(requests) + 1)]], f"{label} {name}")
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()


def test_each_adapter_alone_equals_peft(family):
    base, prompts, requests, oracle = family
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=64, max_model_len=128,
              num_gpu_blocks_override=64)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=2)
    for name, lora in requests.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=lora)
        check_against_oracle(outs, oracle[name], f"alone {name}")
    check_against_oracle(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False),
                         oracle[None], "base")


def test_mixed_batches_equal_peft(family):
    base, prompts, requests, oracle = family
    # All four adapters and the base model in every step.
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=64, max_model_len=128,
              num_gpu_blocks_override=64)
    check(llm, prompts, requests, oracle, "mixed")
    # Again: the prompts' blocks are cached now, each under its own adapter (a hit must never cross adapters).
    check(llm, prompts, requests, oracle, "mixed, prefix-cached")
    assert llm.engine.kv.stats.hits > 0
    # Two slots for four adapters, prompts chunked by a 16-token budget, from a host cache of two.
    chunked = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=64, max_model_len=128,
                  num_gpu_blocks_override=64, max_num_batched_tokens=16)
    check(chunked, prompts, requests, oracle, "two slots, chunked")
    manager = chunked.engine.runner.lora
    assert manager.swaps > 4 and manager.loads > 4  # adapters moved in and out of the slots and the host cache
    # A pool too small for the batch: requests are preempted and recompute under their adapter.
    tight = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=64, max_model_len=64, block_size=8,
                num_gpu_blocks_override=12, max_num_batched_tokens=64)
    check(tight, prompts, requests, oracle, "preempted")
    assert tight.engine.scheduler.num_preemptions > 0


def test_torch_path_mixed_batches_equal_peft(family, monkeypatch):
    """The portable delta (per-adapter GEMMs; the one every non-CPU device runs) in the engine end to end."""
    from tokenmill.layers.lora import NATIVE_ENV

    monkeypatch.setenv(NATIVE_ENV, "0")
    base, prompts, requests, oracle = family
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=64, max_model_len=128,
              num_gpu_blocks_override=64, max_num_batched_tokens=24)
    assert not any(layer.lora.native for layer in llm.engine.runner.lora.targets.layers.values())
    check(llm, prompts, requests, oracle, "torch path")


def test_steps_never_hold_more_adapters_than_slots(family):
    base, prompts, requests, oracle = family
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=64, max_model_len=128,
              num_gpu_blocks_override=64)
    manager = llm.engine.runner.lora
    seen = []
    prepare = manager.prepare

    def spy(reqs, num_tokens):
        seen.append({r.lora.cache_key for r in reqs if r.lora is not None})
        prepare(reqs, num_tokens)

    manager.prepare = spy
    check(llm, prompts, requests, oracle, "two slots")
    assert max(len(s) for s in seen) == 2 and len(set().union(*seen)) == 4


def test_n_and_seeded_sampling_with_an_adapter(family):
    base, prompts, requests, _ = family
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=64, max_model_len=128,
              num_gpu_blocks_override=64)
    lora = requests["r8-all"]
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, min_tokens=8)
    together = llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False, lora_request=lora)[0]
    alone = llm.generate([{"prompt_token_ids": prompts[0]}] * 2, sp, use_tqdm=False, lora_request=[lora, None])
    # A seeded request's draws do not depend on what shares its batch; the base model differs from the adapter.
    assert [c.token_ids for c in together.outputs] == [c.token_ids for c in alone[0].outputs]
    assert [c.token_ids for c in alone[1].outputs] != [c.token_ids for c in alone[0].outputs]


# ---- bad adapters -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    base = make_tiny_model(root / "base", "llama")
    good = make_adapter(base, root / "good", r=4, alpha=8)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128,
              num_gpu_blocks_override=64)
    return root, base, good, llm


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _bad_adapters(root, base, good):
    from safetensors.torch import load_file, save_file

    other = make_tiny_model(root / "other-base", "llama", hidden_size=32, intermediate_size=64)
    cases = {
        "missing folder": (root / "nope", "no such folder"),
        "rank above the limit": (make_adapter(base, root / "r32", r=32, alpha=8), "above --max-lora-rank 16"),
        "modules_to_save": (_edit_config(good, root / "mts", modules_to_save=["lm_head"]), "modules_to_save"),
        "DoRA": (_edit_config(good, root / "dora", use_dora=True), "DoRA"),
        "unknown target": (_edit_config(good, root / "emb", target_modules=["embed_tokens"]), "embed_tokens"),
        "another base": (make_adapter(other, root / "other", r=4), "another base model"),
    }
    broken = _edit_config(good, root / "json", r=4)
    (broken / "adapter_config.json").write_text("{not json")
    cases["malformed config"] = (broken, "unreadable")
    half = _edit_config(good, root / "half")
    tensors = load_file(half / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "lora_B" not in k}, half / "adapter_model.safetensors")
    cases["lora_A without lora_B"] = (half, "without its pair")
    garbage = _edit_config(good, root / "garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    cases["corrupt weights"] = (garbage, "unreadable")
    return cases


def test_bad_adapters_are_refused_and_the_engine_goes_on(served):
    root, base, good, llm = served
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    want = llm.generate(prompt, sp, use_tqdm=False, lora_request=LoRARequest("good", 1, str(good)))
    for i, (label, (path, reason)) in enumerate(_bad_adapters(root, base, good).items()):
        with pytest.raises(ValueError, match=reason):
            llm.generate(prompt, sp, use_tqdm=False, lora_request=LoRARequest(label, 100 + i, str(path)))
        assert llm.engine.num_unfinished_requests == 0, label
    again = llm.generate(prompt, sp, use_tqdm=False, lora_request=LoRARequest("good", 1, str(good)))
    assert again[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_requests_need_enable_lora(tmp_path):
    base = make_tiny_model(tmp_path / "base", "llama")
    good = make_adapter(base, tmp_path / "good", r=4)
    llm = LLM(str(base), max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("good", 1, str(good)))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, str(good))


def test_adapter_file_gone_before_the_worker_reads_it_fails_only_its_request(served, tmp_path):
    """Checked at admission, deleted before the worker loads it: that request ends with an error, the others
    finish with their own output."""
    import shutil

    root, base, good, llm = served
    doomed = shutil.copytree(good, tmp_path / "doomed")
    lora = LoRARequest("doomed", 50, str(doomed))
    llm.engine.processor.check_lora(lora)
    shutil.rmtree(doomed)
    sp = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    prompt = {"prompt_token_ids": [9, 10, 11, 12, 13]}
    solo = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([prompt, prompt], sp, use_tqdm=False, lora_request=[lora, None])
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].outputs[0].token_ids == solo
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("run", [2, 70])  # 70: runs long enough for the GEMMs on the native path
@pytest.mark.parametrize("hidden", [16, 37])  # 37: vector tails in the shrink's dot products
@pytest.mark.parametrize("path", ["native", "torch"])
def test_delta_kernel_gathered_rows_equal_contiguous(path, hidden, run, monkeypatch):
    """The grouped delta of a packed (q, k, v) layer against float64, on the native kernel and the torch path:
    tokens of one adapter spread over the batch (gathered and scattered back) give what they give when
    contiguous; base-model tokens and another adapter's do not change them."""
    from tokenmill import native
    from tokenmill.layers.linear import QKVParallelLinear
    from tokenmill.layers.lora import NATIVE_ENV, LoRALayer, LoRAStep

    if path == "native" and not native.has_op("lora_delta"):
        pytest.skip(f"native kernels without lora_delta: {native.load()}")
    monkeypatch.setenv(NATIVE_ENV, "1" if path == "native" else "0")
    layer = QKVParallelLinear(hidden, 4, 4, 2)  # q 16 rows, k and v 8 each
    step = LoRAStep()
    lora = LoRALayer(layer, step, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    assert lora.native == (path == "native")
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(r, hidden, generator=g), torch.randn(n, r, generator=g))
             for r, n in zip((4, 2, 4), lora.sizes)]
    lora.set(1, [parts[0], None, parts[2]])  # v adapted at rank 4, k not at all
    lora.set(0, [(torch.randn(3, hidden, generator=g), torch.randn(n, 3, generator=g)) for n in lora.sizes])
    T = 3 * run + 2
    x = torch.randn(T, hidden, generator=g)
    mine = [*range(run), *range(2 * run + 2, T)]  # slot 1's tokens; slot 0 and the base model in between
    step.set([(1, 0, run), (0, run, 2 * run), (1, 2 * run + 2, T)], T, torch.device("cpu"))
    gathered = lora.add_delta(x, torch.zeros(T, 32))
    step.set([(1, 0, T)], T, torch.device("cpu"))
    whole = lora.add_delta(x, torch.zeros(T, 32))
    torch.testing.assert_close(gathered[mine], whole[mine])
    assert gathered[2 * run : 2 * run + 2].abs().sum() == 0
    xd = x.double()
    ref = torch.cat([xd @ parts[0][0].double().t() @ parts[0][1].double().t(), torch.zeros(T, 8, dtype=torch.float64),
                     xd @ parts[2][0].double().t() @ parts[2][1].double().t()], dim=1)
    torch.testing.assert_close(whole.double(), ref, rtol=1e-5, atol=1e-4)
    lora.clear(1)
    assert lora.add_delta(x, torch.zeros(T, 32)).abs().sum() == 0


def test_tensor_parallel_adapters_equal_peft(family):
    """Two gloo ranks: each keeps its rows of B (column-parallel layers) or its columns of A (row-parallel
    layers, whose partial deltas the all-reduce adds up)."""
    base, prompts, requests, oracle = family
    if "mistral" in str(base):
        pytest.skip("one architecture is enough for the sharding")
    with LLM(str(base), tensor_parallel_size=2, enable_lora=True, max_loras=4, max_lora_rank=64, max_model_len=128,
             num_gpu_blocks_override=64) as llm:
        check(llm, prompts, requests, oracle, "tp=2")


def test_ngram_speculation_and_structured_output_with_adapters(family):
    """ngram drafts verified under the adapter keep greedy output exact; a grammar constrains an adapter request."""
    from tokenmill import StructuredOutputsParams

    base, prompts, requests, oracle = family
    if "llama" not in str(base):
        pytest.skip("one architecture is enough")
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=64, max_model_len=128,
              num_gpu_blocks_override=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    check(llm, prompts, requests, oracle, "ngram speculation")
    sp = SamplingParams(temperature=0.0, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate([{"prompt_token_ids": prompts[0]}] * 2, sp, use_tqdm=False,
                       lora_request=[requests["r8-all"], None])
    assert all(o.outputs[0].text in ("yes", "no") for o in out)


def test_drafters_that_know_only_the_base_are_refused(family):
    base = family[0]
    with pytest.raises(ValueError, match="drafter knows only the base model"):
        LLM(str(base), enable_lora=True, speculative_config={"method": "draft_model", "model": str(base)})

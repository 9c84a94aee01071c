"""MLA's up-projected form for prompt chunks (layers/mla_up.py): the per-step rule picks it where its FLOPs are
fewer; forced on every step (`always`), off (`never`) and by the rule (`auto`), DeepSeek-V2 and V3 give
transformers' greedy tokens and logprobs, batched, again from the prefix cache and chunked by a 16-token budget
(later chunks read the earlier ones from the latent cache), and the forms equal each other to float32 tolerance;
one layer over a paged cache equals the dense up-projected reference chunk by chunk."""
from __future__ import annotations

import pytest
import torch

from compare import assert_same_outputs
from test_deepseek import VARIANTS, make_deepseek, up_projected_reference
from test_parity import NEW_TOKENS, check_against_oracle, hf_greedy, prompts_for
from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention_backends.base import BatchLayout
from tokenmill.layers import mla_up
from tokenmill.layers.mla_up import MODE_ENV, MLAStep, step_costs


def v3_geometry():
    import tokenmill.layers.quantization  # noqa: F401 (imported first, layers.mla alone meets an import cycle)
    from tokenmill.layers.mla import MLASpec

    return MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def layout(query_len: list[int], kv_len: list[int], **kw) -> BatchLayout:
    q, k = torch.tensor(query_len), torch.tensor(kv_len)
    return BatchLayout(query_start=torch.cumsum(q, 0) - q, query_len=q, kv_len=k, block_table=torch.zeros(len(q), 1),
                       slot_mapping=torch.zeros(int(q.sum())), num_tokens=int(q.sum()), max_query_len=int(q.max()),
                       max_kv_len=int(k.max()), **kw)


def test_rule_takes_the_cheaper_form():
    V3 = v3_geometry()
    # The docstring's counts for V3: a decode costs k * 1088 + 131072 absorbed, k * 131392 up-projected.
    assert step_costs(V3, [1], [4096]) == (4096 * 1088 + 131072, 4096 * 320 + 4096 * 131072)
    step = MLAStep(V3)
    for query_len, kv_len, up in [
        ([1], [4096], False),  # a decode
        ([2], [2], False), ([512], [512], False), ([1024], [1024], True), ([4096], [4096], True),  # fresh prompts
        ([550], [8192], False), ([650], [8192], True),  # a chunk after a long prefix: the ~590 crossover
        ([1] * 64, [4096] * 64, False),  # decodes only
        # A prompt beside decodes: up-projecting makes each decode up-project its whole context, so it pays only
        # beside a few short ones.
        ([1] * 4 + [2048], [256] * 4 + [2048], True), ([1] * 4 + [2048], [4096] * 4 + [2048], False),
        ([1] * 200 + [256], [4096] * 200 + [256], False),
    ]:
        step.set(layout(query_len, kv_len))
        assert (step.layout is not None) == up, (query_len[-1], kv_len[-1])
    step.set(layout([512], [512], tree_req=torch.tensor([0]), tree_mask=torch.ones(1, 512, 512, dtype=torch.bool)))
    assert step.layout is None  # a draft tree's mask is not causal: absorbed
    step.set(None)
    assert step.layout is None
    forced = MLAStep(V3, mode="always")
    forced.set(layout([1], [9]))
    assert forced.layout is not None
    never = MLAStep(V3, mode="never")
    never.set(layout([4096], [4096]))
    assert never.layout is None


def test_bad_mode_is_named(monkeypatch):
    from tokenmill.layers.mla_up import mode

    monkeypatch.setenv(MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="TOKENMILL_MLA_UP_PROJECT='sometimes'"):
        mode()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    config_class, overrides = VARIANTS[request.param]
    path = make_deepseek(tmp_path_factory.mktemp(request.param), config_class, **overrides)
    prompts = prompts_for(384)
    return request.param, path, prompts, hf_greedy(path, prompts)


def test_both_forms_equal_transformers_and_each_other(variant, monkeypatch):
    from tokenmill.layers import mla

    name, path, prompts, oracle = variant
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)
    calls = []
    real = mla.up_projected_attention
    monkeypatch.setattr(mla, "up_projected_attention", lambda *a: calls.append(a[-1].num_tokens) or real(*a))
    # The tiny geometry's FLOPs favour up-projecting every prompt step only without the CPU margin.
    monkeypatch.setattr(mla_up, "UP_MARGIN", 1.0)
    outs = {}
    for form in ("never", "always", "auto"):
        monkeypatch.setenv(MODE_ENV, form)
        calls.clear()
        llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, block_size=16, enable_prefix_caching=True)
        first = llm.generate(prompts, sp, use_tqdm=False)
        check_against_oracle(first, oracle, f"{name} {form}")
        again = llm.generate(prompts, sp, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in again) > 0
        check_against_oracle(again, oracle, f"{name} {form} prefix hit")
        chunked = LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=16)
        third = chunked.generate(prompts, sp, use_tqdm=False)
        check_against_oracle(third, oracle, f"{name} {form} chunked")
        outs[form] = [o.outputs[0] for o in first + again + third]
        layers = sum(1 for a in llm.engine.model.layers if isinstance(a.self_attn, mla.MLAttention))
        if form == "never":
            assert not calls
        elif form == "always":  # every step of the three runs, decodes included
            assert len(calls) % layers == 0 and min(calls) == 1 and max(calls) > 16
        else:  # the prompt steps only: none of a single token
            assert calls and min(calls) > 1
        for engine in (llm.engine, chunked.engine):
            assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert_same_outputs(outs["never"], outs["always"], f"{name} always vs never", atol=1e-5)
    assert_same_outputs(outs["never"], outs["auto"], f"{name} auto vs never", atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_one_layer_chunk_by_chunk_equals_the_dense_reference(variant, kv_dtype):
    """One MLA layer over a paged cache (blocks out of order): chunks of 13, 8 and 1 tokens up-projected from the
    latents cached so far, then decodes absorbed, equal to the dense up-projected reference over the whole
    sequence (int8: to its rounding); the absorbed form on the same chunks equals it too."""
    from tokenmill.layers.attention_backends.registry import get_attention_backend
    from tokenmill.model.loader import load_model

    name, path, _, _ = variant
    attn = load_model(str(path), dtype="float32")[0].layers[1].self_attn
    x = torch.randn(34, attn.o_proj.output_size, generator=torch.Generator().manual_seed(2))
    ref = up_projected_reference(attn, x)
    chunks = [13, 8, 1, 8] + [1] * 4
    got = {}
    for form in ("up", "absorbed"):
        backend = get_attention_backend("torch_sdpa", "cpu")(4, torch.device("cpu"))
        backend.allocate_kv_cache([attn.attn], 12, kv_dtype)
        blocks = torch.randperm(12, generator=torch.Generator().manual_seed(1))
        attn.step = MLAStep(attn.mla, mode="always" if form == "up" else "never")
        outs, start = [], 0
        for n in chunks:
            pos = torch.arange(start, start + n)
            lay = BatchLayout(query_start=torch.tensor([0]), query_len=torch.tensor([n]),
                              kv_len=torch.tensor([start + n]), block_table=blocks[:-(-(start + n) // 4)][None],
                              slot_mapping=blocks[pos // 4] * 4 + pos % 4, num_tokens=n, max_query_len=n,
                              max_kv_len=start + n)
            meta = backend.build_metadata(lay)
            attn.step.set(lay)
            outs.append(attn(pos, x[start:start + n], meta))
            start += n
        got[form] = torch.cat(outs)
    attn.step = None
    tol = dict(atol=2e-5, rtol=1e-4) if kv_dtype == torch.float32 else dict(atol=2e-2, rtol=0)
    torch.testing.assert_close(got["up"], ref, **tol)
    torch.testing.assert_close(got["absorbed"], ref, **tol)
    torch.testing.assert_close(got["up"], got["absorbed"], atol=2e-5, rtol=1e-4)

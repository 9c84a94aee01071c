"""Parallel linear layers, the vocabulary-parallel embedding, the quant-method seam and the generic
weight loader. Tensor parallelism is checked without processes where it can be: two rank objects,
their outputs combined by hand, against a dense F.linear over the full weight. One test runs the real
collectives in two gloo processes."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                     ReplicatedLinear, RowParallelLinear)
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantization import QuantizationConfig, UnquantizedLinearMethod
from tokenmill.layers.quantization.unquantized import dense_matmul
from tokenmill.model.weights import WeightNaming, load_weights

ATOL = 1e-5


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def load(layer: nn.Module, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


# ---- linear layers ------------------------------------------------------------------------------
def test_tp1_layers_equal_dense_and_take_the_tensor_without_copy():
    W, b, x = randn(12, 8, seed=1), randn(12, seed=2), randn(5, 8, seed=3)
    for cls in (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear):
        layer = cls(8, 12, bias=True)
        load(layer, "weight", W)
        load(layer, "bias", b)
        assert layer.weight.data_ptr() == W.data_ptr()  # no second copy of the weights at load
        # the native dense kernel (csrc/dense_linear.cpp) sums in its own order: float rounding apart from MKL's
        torch.testing.assert_close(layer(x), F.linear(x, W, b), rtol=1e-6, atol=1e-6)


def test_column_parallel_tp2_concatenates_to_dense():
    W, b, x = randn(12, 8, seed=1), randn(12, seed=2), randn(5, 8, seed=3)
    ranks = [ColumnParallelLinear(8, 12, bias=True, tp_rank=r, tp_size=2) for r in range(2)]
    for layer in ranks:
        load(layer, "weight", W)
        load(layer, "bias", b)
        assert tuple(layer.weight.shape) == (6, 8)  # only this rank's shard
    y = torch.cat([layer(x) for layer in ranks], dim=-1)
    torch.testing.assert_close(y, F.linear(x, W, b), rtol=0, atol=ATOL)
    torch.testing.assert_close(ranks[1].weight, W[6:])


def test_row_parallel_tp2_partial_sums_add_to_dense():
    W, b, x = randn(6, 10, seed=4), randn(6, seed=5), randn(3, 10, seed=6)
    ranks = [RowParallelLinear(10, 6, bias=True, reduce_results=False, tp_rank=r, tp_size=2) for r in range(2)]
    full_input = [RowParallelLinear(10, 6, bias=True, input_is_parallel=False, reduce_results=False, tp_rank=r,
                                    tp_size=2) for r in range(2)]
    for layer in ranks + full_input:
        load(layer, "weight", W)
        load(layer, "bias", b)
        assert tuple(layer.weight.shape) == (6, 5)
    y = ranks[0](x[:, :5]) + ranks[1](x[:, 5:])
    torch.testing.assert_close(y, F.linear(x, W, b), rtol=0, atol=ATOL)
    # Given the whole input, each rank takes its own slice; the bias is added once (rank 0).
    torch.testing.assert_close(full_input[0](x) + full_input[1](x), F.linear(x, W, b), rtol=0, atol=ATOL)


def test_merged_column_places_gate_and_up_shards():
    gate, up, x = randn(8, 6, seed=7), randn(8, 6, seed=8), randn(4, 6, seed=9)
    ranks = [MergedColumnParallelLinear(6, [8, 8], tp_rank=r, tp_size=2) for r in range(2)]
    for layer in ranks:
        load(layer, "weight", up, 1)  # order of arrival does not matter
        load(layer, "weight", gate, 0)
    r1 = ranks[1].weight
    torch.testing.assert_close(r1[:4], gate[4:])
    torch.testing.assert_close(r1[4:], up[4:])
    outs = [layer(x).chunk(2, dim=-1) for layer in ranks]  # each rank: [its gate slice, its up slice]
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), F.linear(x, gate), rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), F.linear(x, up), rtol=0, atol=ATOL)
    # A checkpoint that already packs gate and up loads the same.
    fused = MergedColumnParallelLinear(6, [8, 8], tp_rank=1, tp_size=2)
    load(fused, "weight", torch.cat([gate, up]))
    torch.testing.assert_close(fused.weight, r1, rtol=0, atol=0)


def test_gated_mlp_tp2_equals_dense():
    H, I = 6, 8
    gate, up, down, x = randn(I, H, seed=10), randn(I, H, seed=11), randn(H, I, seed=12), randn(3, H, seed=13)
    dense = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    total = 0
    for r in range(2):
        gu = MergedColumnParallelLinear(H, [I, I], tp_rank=r, tp_size=2)
        dn = RowParallelLinear(I, H, reduce_results=False, tp_rank=r, tp_size=2)
        load(gu, "weight", gate, 0)
        load(gu, "weight", up, 1)
        load(dn, "weight", down)
        g, u = gu(x).chunk(2, dim=-1)
        total = total + dn(F.silu(g) * u)
    torch.testing.assert_close(total, dense, rtol=0, atol=ATOL)


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 2), (4, 1, 2), (4, 2, 4), (4, 4, 1)])
def test_qkv_parallel_shards_heads(heads, kv_heads, tp):
    D, hidden = 3, 5
    Wq, Wk = randn(heads * D, hidden, seed=14), randn(kv_heads * D, hidden, seed=15)
    Wv = randn(kv_heads * D, hidden, seed=16)
    bq, bk, bv = randn(heads * D, seed=17), randn(kv_heads * D, seed=18), randn(kv_heads * D, seed=19)
    x = randn(2, hidden, seed=20)
    q_full, k_full, v_full = F.linear(x, Wq, bq), F.linear(x, Wk, bk), F.linear(x, Wv, bv)
    qs, ks, vs = [], [], []
    for r in range(tp):
        layer = QKVParallelLinear(hidden, D, heads, kv_heads, bias=True, tp_rank=r, tp_size=tp)
        for sid, w, b in (("v", Wv, bv), ("q", Wq, bq), ("k", Wk, bk)):
            load(layer, "weight", w, sid)
            load(layer, "bias", b, sid)
        assert layer.num_heads == heads // tp and layer.num_kv_heads == max(1, kv_heads // tp)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        # Rank r's KV heads are heads [r // replicas * n, +n) of the checkpoint.
        kv_head = r // layer.num_kv_head_replicas * layer.num_kv_heads
        torch.testing.assert_close(k, k_full[:, kv_head * D : (kv_head + layer.num_kv_heads) * D], rtol=0, atol=ATOL)
        torch.testing.assert_close(v, v_full[:, kv_head * D : (kv_head + layer.num_kv_heads) * D], rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat(qs, -1), q_full, rtol=0, atol=ATOL)
    replicas = max(1, tp // kv_heads)
    torch.testing.assert_close(torch.cat(ks[::replicas], -1), k_full, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat(vs[::replicas], -1), v_full, rtol=0, atol=ATOL)
    # A fused qkv tensor lands in the same places.
    fused = QKVParallelLinear(hidden, D, heads, kv_heads, bias=True, tp_rank=tp - 1, tp_size=tp)
    load(fused, "weight", torch.cat([Wq, Wk, Wv]))
    load(fused, "bias", torch.cat([bq, bk, bv]))
    torch.testing.assert_close(fused(x), torch.cat([qs[-1], ks[-1], vs[-1]], -1), rtol=0, atol=0)


def test_weight_loader_rejects_wrong_shapes_and_shard_ids():
    layer = QKVParallelLinear(5, 3, 4, 2, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"has shape \(6, 5\), expected \(12, 5\)"):
        load(layer, "weight", randn(6, 5), "q")  # a rank-sized tensor is not the checkpoint's
    with pytest.raises(ValueError, match="shard id"):
        load(layer, "weight", randn(12, 5), "o")
    with pytest.raises(ValueError, match="does not divide"):
        QKVParallelLinear(5, 3, 4, 3, tp_size=2)


# ---- embedding and LM head ----------------------------------------------------------------------
@pytest.fixture
def single_process_group(tmp_path):
    """A world of one: all_reduce is the identity, so each rank object returns its own partial sum."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_vocab_parallel_embedding_tp2_equals_full(single_process_group):
    V, D = 11, 4  # 11 rows over 2 ranks: 6 + 5, rank 1 has one padding row
    table = randn(V, D, seed=21)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    ranks = [VocabParallelEmbedding(V, D, tp_rank=r, tp_size=2) for r in range(2)]
    for emb in ranks:
        load(emb, "weight", table)
    assert [tuple(e.weight.shape) for e in ranks] == [(6, D), (6, D)]
    assert torch.count_nonzero(ranks[1].weight[5]) == 0
    torch.testing.assert_close(ranks[0](ids) + ranks[1](ids), F.embedding(ids, table), rtol=0, atol=0)
    full = VocabParallelEmbedding(V, D)
    load(full, "weight", table)
    torch.testing.assert_close(full(ids), F.embedding(ids, table), rtol=0, atol=0)


def test_lm_head_logits_and_tying():
    V, D = 11, 4
    table, h = randn(V, D, seed=22), randn(3, D, seed=23)
    emb = VocabParallelEmbedding(V, D)
    load(emb, "weight", table)
    head = ParallelLMHead(V, D).tie_weights(emb)
    assert head.weight is emb.weight
    logits = head.compute_logits(h)
    assert logits.dtype == torch.float32
    # float32 rows on the CPU: the native dense_linear where built (its own summation order), as the linear layers
    torch.testing.assert_close(logits, dense_matmul(h, table), rtol=0, atol=0)
    torch.testing.assert_close(logits, F.linear(h, table), rtol=1e-6, atol=1e-6)
    # bf16 storage: the GEMM runs in the hidden states' dtype, then float32, as the dense head did.
    b16 = ParallelLMHead(V, D, params_dtype=torch.bfloat16)
    load(b16, "weight", table.bfloat16())
    torch.testing.assert_close(b16.compute_logits(h), F.linear(h, table.bfloat16().float()), rtol=0, atol=0)
    # At tp=2 each rank's rows are its slice of the vocabulary; in order they are the whole head.
    ranks = [ParallelLMHead(V, D, tp_rank=r, tp_size=2) for r in range(2)]
    for r in ranks:
        load(r, "weight", table)
    parts = torch.cat([F.linear(h, r.weight) for r in ranks], dim=-1)[:, :V]
    torch.testing.assert_close(parts, logits, rtol=0, atol=ATOL)


# ---- the quant-method seam ----------------------------------------------------------------------
def test_unquantized_method_contract():
    method = UnquantizedLinearMethod()
    layer = nn.Module()
    marker = object()
    method.create_weights(layer, 6, [4, 2], 12, 6, torch.bfloat16, weight_loader=marker)
    w = layer.weight
    assert isinstance(w, nn.Parameter) and not w.requires_grad
    assert tuple(w.shape) == (6, 6) and w.dtype == torch.bfloat16
    assert (w.input_dim, w.output_dim, w.weight_loader) == (1, 0, marker)
    src = randn(6, 6, seed=24).bfloat16()
    w.data.copy_(src)
    x, b = randn(2, 6, seed=25), randn(6, seed=26).bfloat16()
    # fp32 activations over bf16 storage compute in fp32 on the upcast weight
    y = method.apply(layer, x, b)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, src.float(), b.float()), rtol=0, atol=0)
    method.process_weights_after_loading(layer)
    from tokenmill.layers.quantization import onednn_pack

    if onednn_pack.packable(w):  # bf16 math on this CPU: packed once for oneDNN, same values, same attributes
        assert layer.weight.is_mkldnn and torch.equal(layer.weight.to_dense(), src)
        assert (layer.weight.input_dim, layer.weight.output_dim, layer.weight.weight_loader) == (1, 0, marker)
        torch.testing.assert_close(method.apply(layer, x, b), F.linear(x, src.float(), b.float()), rtol=0, atol=0)
    else:
        assert layer.weight is w  # kept as loaded


class RecordingMethod(UnquantizedLinearMethod):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def apply(self, layer, x, bias=None):
        self.calls.append("apply")
        return super().apply(layer, x, bias) * 2

    def process_weights_after_loading(self, layer) -> None:
        self.calls.append("processed")


class RecordingConfig(QuantizationConfig):
    name = "recording"

    def __init__(self) -> None:
        self.seen: list[tuple[type, str]] = []

    def get_quant_method(self, layer, prefix):
        self.seen.append((type(layer), prefix))
        return RecordingMethod() if prefix.endswith("up") else None


def test_quant_config_picks_each_layers_method():
    cfg = RecordingConfig()
    up = ColumnParallelLinear(4, 4, quant_config=cfg, prefix="mlp.up")
    down = RowParallelLinear(4, 4, quant_config=cfg, prefix="mlp.down")
    assert cfg.seen == [(ColumnParallelLinear, "mlp.up"), (RowParallelLinear, "mlp.down")]
    assert isinstance(up.quant_method, RecordingMethod) and type(down.quant_method) is UnquantizedLinearMethod
    W, x = randn(4, 4, seed=27), randn(1, 4, seed=28)
    load(up, "weight", W)
    torch.testing.assert_close(up(x), 2 * F.linear(x, W))  # the forward is the method's apply
    assert up.quant_method.calls == ["apply"]


# ---- the generic loader -------------------------------------------------------------------------
class Toy(nn.Module):
    """A checkpoint-shaped module tree: packed q/k/v and gate/up, a norm, a tied-away LM head."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    weight_naming = WeightNaming()
    tie_word_embeddings = True

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, quant_config=None) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv_proj = QKVParallelLinear(6, 2, 4, 2, bias=True, tp_rank=tp_rank, tp_size=tp_size)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(6, [4, 4], tp_rank=tp_rank, tp_size=tp_size,
                                                           quant_config=quant_config, prefix="mlp.gate_up")
        self.mlp.down_proj = RowParallelLinear(4, 6, reduce_results=False, tp_rank=tp_rank, tp_size=tp_size)
        self.norm = RMSNorm(6)


def toy_checkpoint() -> dict[str, torch.Tensor]:
    shapes = {"attn.q_proj.weight": (8, 6), "attn.k_proj.weight": (4, 6), "attn.v_proj.weight": (4, 6),
              "attn.q_proj.bias": (8,), "attn.k_proj.bias": (4,), "attn.v_proj.bias": (4,),
              "mlp.gate_proj.weight": (4, 6), "mlp.up_proj.weight": (4, 6), "mlp.down_proj.weight": (6, 4),
              "norm.weight": (6,)}
    ckpt = {f"model.{n}": randn(*s, seed=i) for i, (n, s) in enumerate(shapes.items())}
    ckpt["lm_head.weight"] = torch.zeros(3, 3)  # tied: skipped, whatever its shape
    ckpt["model.attn.rotary_emb.inv_freq"] = torch.zeros(1)  # old checkpoints: skipped
    return ckpt


def test_loader_places_packed_shards_on_each_rank():
    ckpt = toy_checkpoint()
    x = randn(3, 6, seed=30)
    qkv_full = F.linear(x, torch.cat([ckpt[f"model.attn.{p}_proj.weight"] for p in "qkv"]),
                        torch.cat([ckpt[f"model.attn.{p}_proj.bias"] for p in "qkv"]))
    mlp_in = F.linear(x, ckpt["model.mlp.gate_proj.weight"]), F.linear(x, ckpt["model.mlp.up_proj.weight"])
    down_full = F.linear(F.silu(mlp_in[0]) * mlp_in[1], ckpt["model.mlp.down_proj.weight"])
    one = Toy()
    load_weights(one, ckpt.items())
    torch.testing.assert_close(one.attn.qkv_proj(x), qkv_full, rtol=0, atol=ATOL)
    torch.testing.assert_close(one.norm.weight, ckpt["model.norm.weight"], rtol=0, atol=0)
    down = 0
    for r in range(2):
        toy = Toy(r, 2)
        load_weights(toy, ckpt.items())
        g, u = toy.mlp.gate_up_proj(x).chunk(2, dim=-1)
        down = down + toy.mlp.down_proj(F.silu(g) * u)
    torch.testing.assert_close(down, down_full, rtol=0, atol=ATOL)


def test_loader_names_missing_and_misshapen_tensors_as_the_checkpoint_does():
    ckpt = toy_checkpoint()
    del ckpt["model.attn.k_proj.weight"], ckpt["model.mlp.up_proj.weight"], ckpt["model.norm.weight"]
    with pytest.raises(ValueError, match="checkpoint is missing weight tensors") as e:
        load_weights(Toy(), ckpt.items())
    msg = str(e.value)
    assert "attn.k_proj.weight" in msg and "mlp.up_proj.weight" in msg and "norm.weight" in msg
    assert "qkv_proj" not in msg and "gate_up_proj" not in msg and "k_proj.bias" not in msg
    bad = toy_checkpoint()
    bad["model.attn.v_proj.weight"] = randn(5, 6)
    with pytest.raises(ValueError, match=r"weight model\.attn\.v_proj\.weight has shape \(5, 6\), expected \(4, 6\)"):
        load_weights(Toy(), bad.items())


def test_loader_runs_process_weights_after_loading():
    cfg = RecordingConfig()
    toy = Toy(quant_config=cfg)
    load_weights(toy, toy_checkpoint().items())
    assert toy.mlp.gate_up_proj.quant_method.calls == ["processed"]


# ---- real collectives ---------------------------------------------------------------------------
def _tp2_layers(rank: int, tensors: dict) -> dict:
    x, ids = tensors["x"], tensors["ids"]
    col = ColumnParallelLinear(8, 12, bias=True, gather_output=True, tp_rank=rank, tp_size=2)
    row = RowParallelLinear(8, 6, bias=True, input_is_parallel=False, tp_rank=rank, tp_size=2)
    emb = VocabParallelEmbedding(11, 8, tp_rank=rank, tp_size=2)
    head = ParallelLMHead(11, 8, tp_rank=rank, tp_size=2)
    for layer, w, b in ((col, "Wc", "bc"), (row, "Wr", "br")):
        load(layer, "weight", tensors[w])
        load(layer, "bias", tensors[b])
    load(emb, "weight", tensors["E"])
    head.tie_weights(emb)
    return {"col": col(x), "row": row(x), "emb": emb(ids), "logits": head.compute_logits(x)}


def test_collectives_in_two_processes():
    from gloo_ranks import run_ranks

    t = {"x": randn(3, 8, seed=40), "ids": torch.tensor([0, 6, 10, 5]), "Wc": randn(12, 8, seed=41),
         "bc": randn(12, seed=42), "Wr": randn(6, 8, seed=43), "br": randn(6, seed=44), "E": randn(11, 8, seed=45)}
    results = run_ranks(_tp2_layers, t)
    for r in range(2):
        out = results[r]
        torch.testing.assert_close(out["col"], F.linear(t["x"], t["Wc"], t["bc"]), rtol=0, atol=ATOL)
        torch.testing.assert_close(out["row"], F.linear(t["x"], t["Wr"], t["br"]), rtol=0, atol=ATOL)
        torch.testing.assert_close(out["emb"], F.embedding(t["ids"], t["E"]), rtol=0, atol=0)
        torch.testing.assert_close(out["logits"], F.linear(t["x"], t["E"]), rtol=0, atol=ATOL)


def test_models_expose_storage_dtype_and_only_linear_base_layers():
    from tiny import make_config

    from tokenmill.model.gemma3 import Gemma3ForCausalLM
    from tokenmill.model.llama import LlamaForCausalLM

    for cls, arch in ((LlamaForCausalLM, "qwen2"), (Gemma3ForCausalLM, "gemma3")):
        cfg = make_config(arch, vocab_size=64)
        model = cls(cfg, dtype=torch.bfloat16, compute_dtype=torch.float32, max_positions=32)
        assert (model.storage_dtype, model.compute_dtype) == (torch.bfloat16, torch.float32)
        assert next(model.parameters()).dtype == torch.bfloat16
        layer = model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, QKVParallelLinear)
        assert isinstance(layer.mlp.down_proj, RowParallelLinear)
        assert all(isinstance(m.quant_method, UnquantizedLinearMethod) for m in model.modules()
                   if isinstance(m, LinearBase))
        # tp=2: half the heads and half the MLP on each rank, KV heads split (2 over 2 ranks)
        shard = cls(cfg, dtype=torch.float32, compute_dtype=torch.float32, max_positions=32, tp_rank=1, tp_size=2)
        attn = shard.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (cfg.num_attention_heads // 2, cfg.num_key_value_heads // 2)
        assert attn.attn.num_heads == attn.num_heads
        assert shard.layers[0].mlp.down_proj.weight.shape[1] == cfg.intermediate_size // 2

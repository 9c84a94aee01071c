"""Decode attention of one MLA layer at a long context: the latent cache (tokenmill's layout, absorbed form)
against the same layer expanded to multi-head attention (per-head K and V cached), through one attention backend.

    python benchmarks/mla.py                                   # V2-Lite's geometry, 4 requests x 4,096 tokens
    python benchmarks/mla.py --heads 128 --requests 1          # V3's 128 heads
    python benchmarks/mla.py --context 512 --repeats 3         # smoke test
    python benchmarks/mla.py --prefill 2048                    # a prompt: absorbed against up-projected

latent: each token caches c_kv and k_pe (kv_lora_rank + qk_rope_head_dim values); a step multiplies the queries'
no-rope part by W_UK into the latent space, attends with one KV head of the latent width (V = its first
kv_lora_rank features, the same tensor), and multiplies the result by W_UV (the two per-head products are timed).
mha: each token caches per-head K (qk_nope + qk_rope) and V (v_head_dim, zero-padded to K's width: the backends take
one head size), the form a server without MLA support keeps; a step attends with H KV heads.

Both write this step's K/V and read every request's whole context from a paged cache whose blocks are in random
order. Per form it prints the median step time of --repeats (after --warmup), decode tokens/s (requests / step
time), the KV bytes per token and layer and the bytes a step reads, and the output difference between the forms
(the same attention, to float32 rounding). The machine may be shared: the load average is printed with the times.

--prefill N times instead one fresh prompt of N tokens through the latent cache in both of tokenmill's forms: the
absorbed one (as decode) and the up-projected one (layers/mla_up.py: every key up-projected from its latent, then
multi-head attention), with the FLOP counts its per-step rule compares and the form the rule picks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import BatchLayout, get_attention_backend
from tokenmill.layers.mla import LatentAttention, MLASpec
from tokenmill.layers.mla_up import MLAStep, step_costs, up_projected_attention


def layout(requests: int, context: int, block_size: int, num_blocks: int, g: torch.Generator) -> BatchLayout:
    """One decode token per request at position context - 1, each request's blocks drawn at random."""
    per = -(-context // block_size)
    blocks = torch.randperm(num_blocks, generator=g)[: requests * per].view(requests, per)
    pos = context - 1
    return BatchLayout(query_start=torch.arange(requests), query_len=torch.ones(requests, dtype=torch.long),
                       kv_len=torch.full((requests,), context), block_table=blocks,
                       slot_mapping=blocks[:, pos // block_size] * block_size + pos % block_size,
                       num_tokens=requests, max_query_len=1, max_kv_len=context)


def timed(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--nope-dim", type=int, default=128)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--backend", default=None, help="attention backend (default: the CPU's)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=0, help="time a prompt of this many tokens instead")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    if a.prefill:
        prefill(a)
        return
    g = torch.Generator().manual_seed(0)
    H, r, dr, dn, dv, B = a.heads, a.kv_lora_rank, a.rope_dim, a.nope_dim, a.v_dim, a.requests
    backend_cls = get_attention_backend(a.backend, "cpu")
    num_blocks = B * -(-a.context // a.block_size) + 1
    meta_layout = layout(B, a.context, a.block_size, num_blocks, g)
    scale = (dn + dr) ** -0.5

    # The latents of every cached token and the up-projection: both forms attend over the same keys and values.
    w = torch.randn(H, dn + dv, r, generator=g) * r ** -0.5  # kv_b_proj per head
    c_kv = torch.randn(num_blocks, a.block_size, r, generator=g)
    k_pe = torch.randn(num_blocks, a.block_size, dr, generator=g)
    q_nope, q_pe = torch.randn(B, H, dn, generator=g), torch.randn(B, H, dr, generator=g)
    new = meta_layout.slot_mapping
    new_latent = torch.cat([c_kv, k_pe], -1).view(-1, r + dr)[new].unsqueeze(1)  # [B, 1, r + dr]

    latent_backend = backend_cls(a.block_size, torch.device("cpu"))
    latent = LatentAttention(H, 1, r + dr, scale)
    latent_backend.allocate_kv_cache([latent], num_blocks, torch.float32)
    latent.k_cache.copy_(torch.cat([c_kv, k_pe], -1).unsqueeze(2))
    latent_meta = latent_backend.build_metadata(meta_layout)

    def step_latent() -> torch.Tensor:
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w[:, :dn]).transpose(0, 1), q_pe], -1)
        o = latent_backend.forward(latent, q, new_latent, new_latent, latent_meta)[..., :r]
        return torch.bmm(o.transpose(0, 1), w[:, dn:].transpose(1, 2)).transpose(0, 1)

    mha_backend = backend_cls(a.block_size, torch.device("cpu"))
    D = dn + dr
    mha = Attention(H, H, D, scale)
    mha_backend.allocate_kv_cache([mha], num_blocks, torch.float32)
    kv = torch.einsum("nbr,hcr->nbhc", c_kv, w)  # [blocks, bs, H, dn + dv]
    mha.k_cache.copy_(torch.cat([kv[..., :dn], k_pe.unsqueeze(2).expand(-1, -1, H, -1)], -1))
    mha.v_cache.zero_()[..., :dv].copy_(kv[..., dn:])
    k_new = mha.k_cache.view(-1, H, D)[new].clone()
    v_new = mha.v_cache.view(-1, H, D)[new].clone()
    q_mha = torch.cat([q_nope, q_pe], -1)
    mha_meta = mha_backend.build_metadata(meta_layout)

    def step_mha() -> torch.Tensor:
        return mha_backend.forward(mha, q_mha, k_new, v_new, mha_meta)[..., :dv]

    diff = float((step_latent() - step_mha()).abs().max())
    times = {}
    for name, fn in (("latent", step_latent), ("mha", step_mha)):  # interleaved would need equal warm-up; in turn
        times[name] = timed(fn, a.warmup, a.repeats)
    per_token = {"latent": (r + dr) * 4, "mha": 2 * H * D * 4}
    print(f"backend {backend_cls.name}, {H} heads, kv_lora_rank {r}, rope {dr}, nope {dn}, v {dv}; "
          f"{B} requests x {a.context} tokens; threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for name in ("latent", "mha"):
        t = times[name]
        print(f"  {name:6s} step {t * 1e3:8.2f} ms  {B / t:9.1f} tokens/s  KV {per_token[name]:7d} B/token/layer  "
              f"reads {per_token[name] * B * a.context / 2**20:8.1f} MiB/step")
    print(f"  latent / mha time: {times['latent'] / times['mha']:.2f}; KV bytes per token mha / latent: "
          f"{per_token['mha'] / per_token['latent']:.1f}; max |latent - mha| = {diff:.2e}")


def prefill(a) -> None:
    """One fresh prompt of a.prefill tokens, both forms over the same latent cache."""
    g = torch.Generator().manual_seed(0)
    H, r, dr, dn, dv, P, bs = a.heads, a.kv_lora_rank, a.rope_dim, a.nope_dim, a.v_dim, a.prefill, a.block_size
    mla = MLASpec(None, r, dn, dr, dv)
    num_blocks = -(-P // bs) + 1
    blocks = torch.randperm(num_blocks, generator=g)[: -(-P // bs)]
    pos = torch.arange(P)
    lay = BatchLayout(query_start=torch.tensor([0]), query_len=torch.tensor([P]), kv_len=torch.tensor([P]),
                      block_table=blocks[None], slot_mapping=blocks[pos // bs] * bs + pos % bs, num_tokens=P,
                      max_query_len=P, max_kv_len=P)
    backend = get_attention_backend(a.backend, "cpu")(bs, torch.device("cpu"))
    attn = LatentAttention(H, 1, r + dr, (dn + dr) ** -0.5)
    backend.allocate_kv_cache([attn], num_blocks, torch.float32)
    meta = backend.build_metadata(lay)
    w = torch.randn(H, dn + dv, r, generator=g) * r ** -0.5
    q_nope, q_pe = torch.randn(P, H, dn, generator=g), torch.randn(P, H, dr, generator=g)
    latent = torch.randn(P, 1, r + dr, generator=g)

    def absorbed() -> torch.Tensor:
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w[:, :dn]).transpose(0, 1), q_pe], -1)
        o = backend.forward(attn, q, latent, latent, meta)[..., :r]
        return torch.bmm(o.transpose(0, 1), w[:, dn:].transpose(1, 2)).transpose(0, 1)

    def up() -> torch.Tensor:
        return up_projected_attention(attn, mla, q_nope, q_pe, latent, w, lay)

    diff = float((absorbed() - up()).abs().max())
    times = {name: timed(fn, a.warmup, a.repeats) for name, fn in (("absorbed", absorbed), ("up", up))}
    costs = dict(zip(("absorbed", "up"), step_costs(mla, [P], [P])))
    step = MLAStep(mla)
    step.set(lay)
    print(f"backend {backend.name}, {H} heads, kv_lora_rank {r}, rope {dr}, nope {dn}, v {dv}; prompt of {P} "
          f"tokens; threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for name in ("absorbed", "up"):
        print(f"  {name:8s} {times[name] * 1e3:9.2f} ms  {P / times[name]:9.1f} tokens/s  "
              f"{costs[name] * H * 2 / 1e9:8.2f} GFLOP (the rule's count)")
    print(f"  absorbed / up time: {times['absorbed'] / times['up']:.2f}; the rule picks "
          f"{'up' if step.layout is not None else 'absorbed'}; max |absorbed - up| = {diff:.2e}")


if __name__ == "__main__":
    main()

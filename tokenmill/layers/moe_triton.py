"""Float mixture-of-experts on the GPU without a host sync (issue 31): one grouped GEMM launch per projection.

FusedMoE's CPU path reads the per-expert token counts back to the host (`.tolist()`) to slice the sorted pairs
and run one GEMM per expert. On CUDA that read is a device sync per layer and cannot be captured in a CUDA
graph. Here every shape is a static function of (T*k, E, block_m):

- `align_by_expert` sorts the T*k (token, expert) pairs by expert on the device and pads each expert's run to
  a multiple of block_m, so that every block_m block of the sorted list belongs to one expert. The padded
  length is bounded by T*k + min(E, T*k)*(block_m-1) (at most that many experts are non-empty, each wasting
  under block_m slots); the list is allocated at that bound and the blocks past the used ones are skipped by
  the kernel (their expert is E, and it reads the used-block count from the device).
- `grouped_gemm` (Triton) runs one program per (block, N tile): it gathers the block's A rows, multiplies by
  that block's expert's weight and writes the product back to each pair's own row (optionally scaled by its
  routing weight), so no scatter or per-expert slice is needed afterwards.
- `fused_moe_triton` chains gate_up GEMM -> gated activation -> down GEMM -> the sum of each token's k rows.

Triton is imported lazily by the caller (moe.py): TRITON_INTERPRET is read when Triton is first imported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.layers.activation import act_fn, gated

BLOCK_N = 64  # output columns per program
BLOCK_K = 32  # reduction step


@dataclass
class ExpertBlocks:
    """The pairs sorted by expert, each expert's run padded to a multiple of block_m (all on the device)."""

    sorted_pair_ids: torch.Tensor  # [L] int64: pair index (t*k + j); padding slots hold num_pairs
    expert_of_block: torch.Tensor  # [L // block_m] int64: the block's (local) expert; E past the used blocks
    num_used_blocks: torch.Tensor  # [] int64: blocks holding pairs (a device tensor: never read on the host)
    num_pairs: int
    block_m: int


def padded_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The static size of sorted_pair_ids: every pair once, plus under block_m padding per non-empty expert."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return max(block_m, triton.cdiv(bound, block_m) * block_m)


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the mean rows per expert (a host-side function of shapes only): small blocks waste
    little padding in decode batches, larger ones reuse each weight tile over more rows in prefills."""
    mean = num_pairs / max(num_experts, 1)
    return 16 if mean <= 16 else 32 if mean <= 64 else 64


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids [T, k] local expert ids; ids outside [0, num_experts) (other ranks' experts under expert
    parallelism) are left out. Only device ops without a host read (no bincount: on CUDA it reads its max)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P, E = flat.numel(), num_experts
    L = padded_length(P, E, block_m)
    flat = torch.where((flat >= 0) & (flat < E), flat, E)  # E: "not here", sorts last and is dropped
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    # Each pair's slot: its expert's padded start + its rank within the expert (stable sort keeps token order).
    padded_start = torch.cat([padded_end - padded, padded_end.new_full((1,), L)])  # "not here" -> trash slot L
    run_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)
    rank = torch.arange(P, device=dev) - run_start.index_select(0, expert)
    slot = torch.where(expert < E, padded_start.index_select(0, expert) + rank, L)
    sorted_ids = torch.full((L + 1,), P, dtype=torch.long, device=dev).scatter_(0, slot, order)[:L]
    block_start = torch.arange(0, L, block_m, device=dev)
    expert_of_block = torch.searchsorted(padded_end, block_start, right=True)  # E once past the last run
    return ExpertBlocks(sorted_ids, expert_of_block, padded_end[-1] // block_m, P, block_m)


@triton.jit
def grouped_gemm_kernel(
    A, W, C, route_w, sorted_ids, expert_of_block, num_used,
    num_pairs, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    TOP_K: tl.constexpr, MUL_ROUTE: tl.constexpr, IEEE_F32: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    if block >= tl.load(num_used):  # the static grid covers the worst case; most trailing blocks are empty
        return
    e = tl.load(expert_of_block + block).to(tl.int64)
    pair = tl.load(sorted_ids + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs  # padding slots hold num_pairs
    a_row = pair // TOP_K  # token activations: one row per token; per-pair activations: TOP_K == 1
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(A + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w = w.to(a.dtype)  # weights stored wider or narrower than x: computed in x's dtype, as F.linear is
        if UPCAST:  # (the interpreter's dot multiplies bfloat16 as its raw uint16 bits; float32 is exact here)
            a, w = a.to(tl.float32), w.to(tl.float32)
        if IEEE_F32:  # float32 as torch computes it by default (torch.backends.cuda.matmul.allow_tf32 is off)
            acc += tl.dot(a, w, input_precision="ieee")
        else:  # 16-bit inputs, or float32 where torch allows tf32
            acc += tl.dot(a, w)
    if MUL_ROUTE:
        acc = acc * tl.load(route_w + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(C + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, top_k: int,
                 route_weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[p] = a[p // top_k] @ w[expert(p)].T (times route_weights[p]) for every pair p in `blocks`; the rows of
    pairs not in it are left as they were. a [rows, K], w [E, N, K], out [num_pairs, N]."""
    E, N, K = w.shape
    assert a.shape[-1] == K and out.shape == (blocks.num_pairs, N), (a.shape, w.shape, out.shape)
    # (on the CPU the kernel runs in Triton's interpreter: UPCAST works around its bfloat16 dot)
    ieee = a.dtype == torch.float32 and not (a.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    grid = (blocks.expert_of_block.numel(), triton.cdiv(N, BLOCK_N))
    grouped_gemm_kernel[grid](
        a, w, out, route_weights if route_weights is not None else out, blocks.sorted_pair_ids,
        blocks.expert_of_block, blocks.num_used_blocks,
        blocks.num_pairs, N, K,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        TOP_K=top_k, MUL_ROUTE=route_weights is not None, IEEE_F32=ieee, UPCAST=a.device.type == "cpu",
        BLOCK_M=blocks.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, first_expert: int = 0, num_local: int | None = None,
                     act: str = "silu") -> torch.Tensor:
    """x [T, H], w13 [E_local, 2I, H], w2 [E_local, H, I], topk_* [T, k] (global expert ids) -> [T, H].
    Pairs routed outside [first_expert, first_expert + num_local) (other ranks' experts) contribute zero."""
    T, k = topk_ids.shape
    num_local = w13.shape[0] if num_local is None else num_local
    blocks = align_by_expert(topk_ids - first_expert, num_local, choose_block_m(T * k, num_local))
    gate_up = grouped_gemm(x, w13, x.new_empty(T * k, w13.shape[1]), blocks, k)
    # Rows of pairs that are not here stay uninitialized through the activation; the down GEMM never reads them.
    h = gated(gate_up, act_fn(act), act)
    # zeros: the rows of pairs that are not here must add nothing to their token's sum
    y = grouped_gemm(h, w2, x.new_zeros(T * k, w2.shape[1]), blocks, 1,
                     topk_weights.reshape(-1).float().contiguous())
    return y.view(T, k, w2.shape[1]).sum(1)  # (an explicit H: -1 is ambiguous for an empty batch)

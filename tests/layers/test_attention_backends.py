"""Conformance of every registered attention backend (tokenmill/layers/attention_backends) on CPU.

Each backend runs multi-step scenarios over a paged pool filled with NaN garbage and shuffled block
ids: ragged prompts, a prompt split in two chunks, decodes mixed with chunks, a prefix-cache hit on
another request's blocks (computed earlier, and in the same step), speculative rows on a long
context, a sliding-window layer next to a full one. Every output row is compared with plain causal
softmax attention in float64 over the request's full ground-truth K/V. Also: the registry, that
allocation does not zero the pool, that K/V land in the slots given, and externally filled blocks.
"""
from __future__ import annotations

from pathlib import Path
import random
from dataclasses import dataclass

import pytest
import torch

from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import (
    AttentionBackend,
    BatchLayout,
    available_backends,
    get_attention_backend,
    register_backend,
    registry,
)

from tokenmill import native

CPU = torch.device("cpu")
# triton_paged (available here under the interpreter) runs these scenarios in test_triton_attention.py, on fewer
# shapes: the interpreter is slow.
BACKENDS = [b for b in available_backends(CPU) if b != "triton_paged"]
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def dense_reference(q, k, v, scale: float, window: int | None, soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, H, D], the last n positions of k/v: [N, Hk, D] (float64). Returns [n, H, D]. `sinks` [H]: a logit per
    head in the softmax's denominator (gpt-oss), its weight dropped."""
    n, H, _ = q.shape
    N, Hk, _ = k.shape
    k, v = k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    q_pos = torch.arange(N - n, N).unsqueeze(1)
    k_pos = torch.arange(N).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    sink = sinks.double().view(H, 1, 1).expand(H, n, 1)
    p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, v)


@dataclass
class Seq:
    q: torch.Tensor  # [layers, N, H, D] float64 ground truth, already rounded to the cache dtype
    k: torch.Tensor  # [layers, N, Hk, D]
    v: torch.Tensor
    blocks: list[int]
    computed: int = 0


class Harness:
    """A pool, some layers, and requests whose steps are checked against the dense reference."""

    def __init__(self, backend: AttentionBackend, layers: list[Attention], dtype, seed: int = 0,
                 table_dtype=torch.long) -> None:
        self.backend, self.layers, self.dtype, self.table_dtype = backend, layers, dtype, table_dtype
        self.H, self.Hk, self.D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
        self.bs = backend.block_size
        self.gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(layers[0].k_cache.shape[0], generator=self.gen).tolist()

    @classmethod
    def make(cls, backend: str, dtype, H: int, Hk: int, D: int, windows, soft_cap=None, block_size: int = 8,
             num_blocks: int = 64, seed: int = 0, table_dtype=torch.long, sinks: torch.Tensor | None = None) -> Harness:
        b = get_attention_backend(backend, CPU)(block_size, CPU)
        layers = [Attention(H, Hk, D, D**-0.5, w, logits_soft_cap=soft_cap, sinks=sinks is not None) for w in windows]
        for a in layers:
            if sinks is not None:
                a.sinks.data.copy_(sinks)
        b.allocate_kv_cache(layers, num_blocks, dtype)
        for a in layers:  # what torch.empty may hold: lazy initialisation must make it harmless
            a.k_cache.fill_(float("nan"))
            a.v_cache.fill_(float("nan"))
        return cls(b, layers, dtype, seed, table_dtype)

    def _rand(self, n: int, heads: int) -> torch.Tensor:
        x = torch.randn(len(self.layers), n, heads, self.D, generator=self.gen, dtype=torch.float64)
        return x.to(self.dtype).double()

    def new_seq(self, length: int, prefix_of: Seq | None = None, shared_blocks: int = 0) -> Seq:
        q, k, v = self._rand(length, self.H), self._rand(length, self.Hk), self._rand(length, self.Hk)
        blocks: list[int] = []
        if prefix_of is not None:
            n = shared_blocks * self.bs
            k[:, :n], v[:, :n] = prefix_of.k[:, :n], prefix_of.v[:, :n]
            blocks = prefix_of.blocks[:shared_blocks]
        blocks = blocks + [self.free.pop() for _ in range(-(-length // self.bs) - len(blocks))]
        return Seq(q, k, v, blocks, computed=shared_blocks * self.bs)

    def layout(self, work: list[tuple[Seq, int]]) -> BatchLayout:
        q_len = torch.tensor([n for _, n in work])
        kv_len = torch.tensor([s.computed + n for s, n in work])
        table = torch.zeros(len(work), max(len(s.blocks) for s, _ in work), dtype=self.table_dtype)
        slots = []
        for i, (s, n) in enumerate(work):
            table[i, : len(s.blocks)] = torch.tensor(s.blocks)
            pos = torch.arange(s.computed, s.computed + n)
            slots.append(torch.tensor(s.blocks)[pos // self.bs] * self.bs + pos % self.bs)
        return BatchLayout(
            query_start=torch.cumsum(q_len, 0) - q_len, query_len=q_len, kv_len=kv_len, block_table=table,
            slot_mapping=torch.cat(slots), num_tokens=int(q_len.sum()),
            max_query_len=int(q_len.max()), max_kv_len=int(kv_len.max()),
        )

    def _packed(self, work: list[tuple[Seq, int]], layer: int, name: str) -> torch.Tensor:
        """This step's rows of q, k or v for every request, packed as the model passes them."""
        return torch.cat([getattr(s, name)[layer, s.computed : s.computed + n] for s, n in work]).to(self.dtype)

    def step(self, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        meta = self.backend.build_metadata(self.layout(work))
        outs = []
        for li, layer in enumerate(self.layers):
            out = layer(*(self._packed(work, li, name) for name in "qkv"), meta)
            assert out.shape == (sum(n for _, n in work), self.H, self.D) and out.dtype == self.dtype
            row = 0
            for s, n in work:
                end = s.computed + n
                want = dense_reference(s.q[li, s.computed : end], s.k[li, :end], s.v[li, :end],
                                       layer.scale, layer.sliding_window, layer.logits_soft_cap, layer.sinks)
                torch.testing.assert_close(out[row : row + n].double(), want, **TOLERANCE[self.dtype])
                row += n
            outs.append(out)
        for s, n in work:
            s.computed += n
        return outs


def run_scenario(h: Harness, rng: random.Random) -> None:
    bs = h.bs
    pA = rng.randint(3 * bs, 5 * bs)
    A = h.new_seq(pA + 2)  # prompt in two chunks, then decodes
    B = h.new_seq((pB := rng.randint(1, bs)) + 4)  # short prompt, then decodes
    C = h.new_seq((pC := rng.randint(bs + 1, 3 * bs)) + 3)
    E = h.new_seq((pE := rng.randint(5 * bs, 7 * bs)) + 12)  # long context, then speculative rows
    G = h.new_seq(bs + rng.randint(1, bs + 3) + 2, prefix_of=C, shared_blocks=1)  # hit on blocks C fills this step
    first = rng.randint(2 * bs, pA - bs)
    h.step([(A, first), (B, pB), (C, pC), (E, pE), (G, G.q.shape[1] - G.computed - 2)])

    D = h.new_seq(2 * bs + rng.randint(1, 2 * bs) + 2, prefix_of=A, shared_blocks=2)  # hit on A's computed blocks
    k1 = rng.randint(1, 4)
    h.step([(B, 1), (A, pA - first), (C, 1), (D, D.q.shape[1] - D.computed - 2), (E, k1 + 1), (G, 1)])

    k2 = rng.randint(1, 4)
    h.step([(E, k2 + 1), (A, 1), (D, 1), (B, 1), (C, 1)])
    h.step([(D, 1), (B, 1), (A, 1), (G, 1), (C, 1), (E, 1)])  # decodes only, ragged contexts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hk", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_dense_attention(backend, dtype, H, Hk, D, seed):
    rng = random.Random(seed * 1000 + D + H * 10 + Hk)
    window = rng.randint(3, 20)
    h = Harness.make(backend, dtype, H, Hk, D, windows=[None, window], seed=seed,
                table_dtype=torch.int32 if seed else torch.long)
    run_scenario(h, rng)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_other_block_sizes(backend, block_size):
    h = Harness.make(backend, torch.float32, 4, 2, 64, windows=[None, 5], block_size=block_size, num_blocks=800)
    run_scenario(h, random.Random(block_size))


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_soft_cap(backend):
    h = Harness.make(backend, torch.float32, 4, 2, 64, windows=[None, 7], soft_cap=0.5)
    try:
        run_scenario(h, random.Random(3))
    except NotImplementedError:
        pytest.skip(f"{backend} has no logits soft cap")


# ---- allocation, initialisation, the KV write ------------------------------------------------
def _slot_view(backend: AttentionBackend, cache: torch.Tensor, Hk: int, D: int) -> torch.Tensor:
    if tuple(cache.shape[1:]) != (backend.block_size, Hk, D):
        pytest.skip(f"{backend.name} keeps its own cache layout {tuple(cache.shape)}")
    return cache.view(-1, Hk, D)


@pytest.mark.parametrize("backend", BACKENDS)
def test_allocation_does_not_zero_and_first_use_is_finite(backend, monkeypatch):
    real_empty = torch.empty

    def garbage_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    H, Hk, D, bs, nb = 4, 2, 64, 8, 16
    b = get_attention_backend(backend, CPU)(bs, CPU)
    layers = [Attention(H, Hk, D, D**-0.5), Attention(H, Hk, D, D**-0.5, sliding_window=4)]
    monkeypatch.setattr(torch, "empty", garbage_empty)
    b.allocate_kv_cache(layers, nb, torch.float32)
    monkeypatch.undo()
    for a in layers:
        assert a.backend is b
        assert tuple(a.k_cache.shape) == b.kv_cache_shape(nb, Hk, D) == tuple(a.v_cache.shape)
        assert a.k_cache.dtype == torch.float32
        assert torch.isnan(a.k_cache).all() and torch.isnan(a.v_cache).all(), "allocation wrote the pool"
    assert b.bytes_per_block(layers, torch.float32) * nb == sum(2 * a.k_cache.nbytes for a in layers)

    # Requests whose last block is partly written (NaN in its tail) and shorter rows padded with block 0.
    h = Harness(b, layers, torch.float32)
    h.free = [11, 3, 7, 9, 5]
    long, short = h.new_seq(14), h.new_seq(4)
    outs = h.step([(long, 13), (short, 3)])
    h.step([(long, 1), (short, 1)])
    assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_kv_to_the_slots_given(backend):
    H, Hk, D, bs = 4, 2, 64, 4
    b = get_attention_backend(backend, CPU)(bs, CPU)
    layer = Attention(H, Hk, D, D**-0.5)
    b.allocate_kv_cache([layer], 8, torch.bfloat16)
    kc, vc = _slot_view(b, layer.k_cache, Hk, D), _slot_view(b, layer.v_cache, Hk, D)
    # One request, 6 tokens over blocks [5, 2]: slots 20..23 then 8..9.
    layout = BatchLayout(
        query_start=torch.tensor([0]), query_len=torch.tensor([6]), kv_len=torch.tensor([6]),
        block_table=torch.tensor([[5, 2]]), slot_mapping=torch.tensor([20, 21, 22, 23, 8, 9]),
        num_tokens=6, max_query_len=6, max_kv_len=6,
    )
    q, k, v = torch.randn(6, H, D), torch.randn(6, Hk, D), torch.randn(6, Hk, D)
    layer(q.bfloat16(), k, v, b.build_metadata(layout))  # k/v in another dtype: cast to the cache's
    slots = layout.slot_mapping
    assert torch.equal(kc[slots], k.bfloat16()) and torch.equal(vc[slots], v.bfloat16())


@pytest.mark.parametrize("backend", BACKENDS)
def test_externally_filled_blocks_are_kept(backend):
    """Blocks a KV transfer loads before their first step must survive lazy initialisation."""
    H, Hk, D, bs = 2, 1, 64, 4
    b = get_attention_backend(backend, CPU)(bs, CPU)
    layer = Attention(H, Hk, D, D**-0.5)
    b.allocate_kv_cache([layer], 8, torch.float32)
    kc, vc = _slot_view(b, layer.k_cache, Hk, D), _slot_view(b, layer.v_cache, Hk, D)
    layer.k_cache.fill_(float("nan"))
    layer.v_cache.fill_(float("nan"))
    k_all, v_all = torch.randn(6, Hk, D, dtype=torch.float64), torch.randn(6, Hk, D, dtype=torch.float64)
    loaded = torch.arange(6 * 4, 7 * 4)  # block 6 holds positions 0..3
    kc[loaded], vc[loaded] = k_all[:4].float(), v_all[:4].float()
    b.mark_initialized(torch.tensor([6]))
    layout = BatchLayout(
        query_start=torch.tensor([0]), query_len=torch.tensor([2]), kv_len=torch.tensor([6]),
        block_table=torch.tensor([[6, 1]]), slot_mapping=torch.tensor([4, 5]),
        num_tokens=2, max_query_len=2, max_kv_len=6,
    )
    q = torch.randn(2, H, D, dtype=torch.float64)
    out = layer(q.float(), k_all[4:].float(), v_all[4:].float(), b.build_metadata(layout))
    want = dense_reference(q, k_all.float().double(), v_all.float().double(), layer.scale, None)
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.float32])


# ---- registry ----------------------------------------------------------------------------
def test_registry_default_and_choices():
    assert "torch_sdpa" in BACKENDS
    # The native kernel is the CPU default wherever it was built (make test builds it).
    assert get_attention_backend(None, CPU).name == ("cpu_paged" if native.available() else "torch_sdpa")
    assert get_attention_backend("torch_sdpa", "cpu").name == "torch_sdpa"
    # no CUDA needed to choose: Triton's kernels where Triton is installed (issue 31), else torch SDPA
    from tokenmill.layers.attention_backends.triton_paged import _triton_missing

    cuda_default = "torch_sdpa" if _triton_missing() else "triton_paged"
    assert get_attention_backend(None, torch.device("cuda")).name == cuda_default
    with pytest.raises(ValueError, match="torch_sdpa"):
        get_attention_backend("no_such_backend", CPU)


def test_cpu_default_falls_back_to_torch_sdpa_without_native_kernels(monkeypatch, caplog):
    """No compiler at install time (or TOKENMILL_NO_NATIVE=1): one log line, torch_sdpa, never an error."""
    monkeypatch.setattr(native, "load", lambda: "tokenmill._C was not built (forced by the test)")
    monkeypatch.setattr(registry, "_warned", set())
    with caplog.at_level("WARNING", logger=registry.__name__):
        assert get_attention_backend(None, CPU).name == "torch_sdpa"
        assert get_attention_backend(None, CPU).name == "torch_sdpa"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "cpu_paged" in lines[0] and "forced by the test" in lines[0]
    assert "cpu_paged" not in available_backends(CPU)
    with pytest.raises(ValueError, match="not supported.*valid choices: torch_sdpa"):
        get_attention_backend("cpu_paged", CPU)


def test_engine_without_native_kernels_generates_the_same_tokens(tmp_path):
    """TOKENMILL_NO_NATIVE=1 in a fresh process: the engine runs on torch_sdpa and agrees with cpu_paged."""
    import json
    import os
    import subprocess
    import sys

    from tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "llama")
    code = (
        "import json, sys; from tokenmill import LLM, SamplingParams; "
        f"llm = LLM({str(path)!r}, max_model_len=256, kv_cache_memory_bytes=8 << 20); "
        "out = llm.generate([[1, 2, 3, 4, 5] * 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)); "
        "print(json.dumps([llm.engine.core.info.attention_backend, out[0].outputs[0].token_ids]))"
    )
    got = {}
    for flag in ("1", "0"):
        env = dict(os.environ, TOKENMILL_NO_NATIVE=flag, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                           cwd=str(Path(__file__).resolve().parents[2]))
        assert r.returncode == 0, r.stderr[-2000:]
        got[flag] = json.loads(r.stdout.strip().splitlines()[-1])
        if flag == "1":
            assert "cpu_paged is not available" in r.stderr and "TOKENMILL_NO_NATIVE=1" in r.stderr
    assert got["1"][0] == "torch_sdpa"
    assert got["0"][0] == ("cpu_paged" if native.available() else "torch_sdpa")
    assert got["1"][1] == got["0"][1]


def test_registry_rejects_a_backend_the_device_cannot_run(monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))

    @register_backend
    class CudaOnly(AttentionBackend):
        name = "cuda_only_test"

        @classmethod
        def supports(cls, device: torch.device) -> bool:
            return device.type == "cuda"

    assert "cuda_only_test" not in available_backends(CPU)
    assert "cuda_only_test" in available_backends("cuda")
    with pytest.raises(ValueError, match="not supported.*valid choices: .*torch_sdpa"):
        get_attention_backend("cuda_only_test", CPU)
    with pytest.raises(ValueError, match="already registered"):
        register_backend(type("Clash", (AttentionBackend,), {"name": "cuda_only_test"}))

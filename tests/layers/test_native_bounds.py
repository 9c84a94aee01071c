"""A block id or slot outside the KV pool (a bookkeeping bug upstream) raises IndexError in every attention
kernel, native (cpu_paged: paged_attention, paged_attention_quant) and pure torch (torch_sdpa), negative
indices included, instead of reading or overwriting memory it does not own. The native kernels check
before writing anything: the cache is left as it was."""
from __future__ import annotations

import pytest
import torch

from tokenmill import native
from tokenmill.layers.attention import Attention
from tokenmill.layers.attention_backends import BatchLayout, get_attention_backend
from tokenmill.layers.attention_backends.kv_quant import FP8

NUM_BLOCKS, BLOCK, H, HK, D = 6, 4, 4, 2, 16
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": FP8}
BACKENDS = [pytest.param("cpu_paged", marks=pytest.mark.skipif(not native.available(),
                                                               reason=f"native kernels not built: {native.load()}")),
            "torch_sdpa"]


def layer_for(backend_name: str, dtype: torch.dtype, window: int | None = None) -> Attention:
    backend = get_attention_backend(backend_name, "cpu")(BLOCK, torch.device("cpu"))
    layer = Attention(H, HK, D, D ** -0.5, sliding_window=window)
    backend.allocate_kv_cache([layer], NUM_BLOCKS, dtype)
    g = torch.Generator().manual_seed(0)
    for cache in (layer.k_cache, layer.v_cache):  # finite contents, written "before" this step
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    if layer.k_scale_cache is not None:
        layer.k_scale_cache.fill_(0.05)
        layer.v_scale_cache.fill_(0.05)
    backend.mark_initialized(torch.arange(NUM_BLOCKS))  # torch_sdpa: keep these contents (no zeroing)
    return layer


def layout(table: list[list[int]], slots: list[int]) -> BatchLayout:
    """Two requests: a decode at position 5 (blocks 0-1 of its table) and a 3-token chunk at positions 2..4."""
    q_len, kv_len = torch.tensor([1, 3]), torch.tensor([6, 5])
    return BatchLayout(query_start=torch.tensor([0, 1]), query_len=q_len, kv_len=kv_len,
                       block_table=torch.tensor(table), slot_mapping=torch.tensor(slots), num_tokens=4,
                       max_query_len=3, max_kv_len=6)


TABLE = [[2, 4], [5, 1]]
SLOTS = [4 * BLOCK + 1, 5 * BLOCK + 2, 5 * BLOCK + 3, 1 * BLOCK + 0]  # block * BLOCK + position % BLOCK


def run(layer: Attention, lay: BatchLayout) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, H, D, generator=g)
    k, v = torch.randn(4, HK, D, generator=g), torch.randn(4, HK, D, generator=g)
    return layer(q, k, v, layer.backend.build_metadata(lay))


def snapshot(layer: Attention) -> list[torch.Tensor]:
    caches = [layer.k_cache, layer.v_cache] + ([layer.k_scale_cache, layer.v_scale_cache]
                                               if layer.k_scale_cache is not None else [])
    return [c.view(torch.uint8).clone() if c.dtype == FP8 else c.clone() for c in caches]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_in_range_indices_run(backend, dtype):
    out = run(layer_for(backend, dtype), layout(TABLE, SLOTS))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bad", [NUM_BLOCKS, -1, 1 << 20])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_id_outside_the_pool_raises(backend, dtype, bad):
    layer = layer_for(backend, dtype)
    before = snapshot(layer)
    table = [[2, bad], [5, 1]]  # the decode's second block: one it reads
    with pytest.raises(IndexError):
        run(layer, layout(table, SLOTS))
    if backend == "cpu_paged":  # checked before anything is written
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(layer)))


@pytest.mark.parametrize("bad", [NUM_BLOCKS * BLOCK, -1, -NUM_BLOCKS * BLOCK - 1])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_outside_the_pool_raises(backend, dtype, bad):
    layer = layer_for(backend, dtype)
    before = snapshot(layer)
    with pytest.raises(IndexError):
        run(layer, layout(TABLE, SLOTS[:2] + [bad] + SLOTS[3:]))
    if backend == "cpu_paged":
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(layer)))


@pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.load()}")
@pytest.mark.parametrize("field, value", [
    ("kv_len", [6, 9]),  # more keys than the chunk's 2-block table holds
    ("query_start", [0, 2]),  # the chunk's rows run past q's 4 rows
    ("query_len", [1, 6]),  # more query rows than keys
])
def test_native_rejects_inconsistent_metadata(field, value):
    layer = layer_for("cpu_paged", torch.float32)
    lay = layout(TABLE, SLOTS)
    setattr(lay, field, torch.tensor(value))
    with pytest.raises(IndexError):
        run(layer, lay)


@pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.load()}")
def test_native_checks_only_the_blocks_a_sliding_window_reads():
    """Blocks that slid out of the window are never read: whatever their table entries hold is no error."""
    layer = layer_for("cpu_paged", torch.float32, window=2)
    out = run(layer, layout([[-7, 4], [5, 1]], SLOTS))  # the decode at position 5 sees positions 4..5 only
    assert torch.isfinite(out).all()

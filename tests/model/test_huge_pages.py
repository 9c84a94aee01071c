"""tokenmill/huge_pages.py: large GGUF weights moved into 2 MiB-aligned private mappings advised MADV_HUGEPAGE.

- to_huge_pages keeps the values, starts a large tensor on a 2 MiB boundary, and the kernel sees the advice (the
  `hg` flag of the mapping in /proc/self/smaps); smaller tensors share arena mappings, one after another in the
  order they came, each on a cache line; tiny, non-contiguous or non-CPU tensors, and TOKENMILL_HUGE_PAGES=0,
  keep the tensor as it was.
- A GGUF model's kernel weights land there (the threshold lowered so the tiny test model's count) and its greedy
  tokens equal those of the same model with TOKENMILL_HUGE_PAGES=0.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tokenmill import huge_pages, native

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import model_shapes as ms  # noqa: E402

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this machine")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_values_kept_aligned_and_advised():
    t = torch.randint(0, 256, (3 * huge_pages.HUGE + 1000,), dtype=torch.uint8)  # a tail past the last whole page
    out = huge_pages.to_huge_pages(t)
    assert out is not t and torch.equal(out, t) and out.dtype == t.dtype and out.shape == t.shape
    assert out.data_ptr() % huge_pages.HUGE == 0
    assert "hg" in vm_flags(out.data_ptr())  # MADV_HUGEPAGE took
    f = torch.randn(2 * huge_pages.HUGE // 4 + 7)
    g = huge_pages.to_huge_pages(f)
    assert torch.equal(g, f) and g.dtype == torch.float32


@needs_thp
def test_smaller_tensors_share_an_arena_in_load_order(monkeypatch):
    monkeypatch.setattr(huge_pages, "_ARENA", huge_pages._Arena())  # a fresh arena: placements start at 0
    sizes = [300_000, 5000, 2 * huge_pages.HUGE + 123, 70_000]
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    outs = [huge_pages.to_huge_pages(t) for t in ts]
    for t, out in zip(ts, outs):
        assert out is not t and torch.equal(out, t) and out.data_ptr() % huge_pages.ALIGN == 0
        assert "hg" in vm_flags(out.data_ptr())
    starts = [o.data_ptr() for o in outs]
    assert starts[0] % huge_pages.HUGE == 0 and starts == sorted(starts)  # one after another, no overlap
    assert all(a + n <= b for a, n, b in zip(starts, sizes, starts[1:]))
    assert starts[-1] + sizes[-1] - starts[0] < huge_pages.ARENA_BYTES  # one mapping
    # A tensor that does not fit the rest of the arena starts a new one; values stay put in the old one.
    rest = huge_pages.ARENA_BYTES // 2 - 64
    a, b, c = (huge_pages.to_huge_pages(torch.full((rest,), v, dtype=torch.uint8)) for v in (7, 9, 11))
    assert a.data_ptr() > starts[-1] and b.data_ptr() % huge_pages.HUGE == 0 and c.data_ptr() > b.data_ptr()
    assert int(a[0]) == 7 and int(b[-1]) == 9 and int(c[5]) == 11
    assert all(torch.equal(o, t) for o, t in zip(outs, ts))
    # Once ended (a model's load is done), the next tensor starts a new mapping.
    huge_pages.end_arena()
    d = huge_pages.to_huge_pages(torch.ones(5000, dtype=torch.uint8))
    assert d.data_ptr() % huge_pages.HUGE == 0 and int(c[-1]) == 11


def test_left_alone(monkeypatch):
    small = torch.zeros(1000, dtype=torch.uint8)
    assert huge_pages.to_huge_pages(small) is small
    wide = torch.zeros(4 * huge_pages.HUGE, dtype=torch.uint8).view(2, -1)
    strided = wide[:, ::2]
    assert huge_pages.to_huge_pages(strided) is strided
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    big = torch.zeros(4 * huge_pages.HUGE, dtype=torch.uint8)
    assert not huge_pages.available() and huge_pages.to_huge_pages(big) is big


@needs_thp
@pytest.mark.skipif(not native.available(), reason="tokenmill._C not built: GGUF weights are not kept as blocks")
def test_gguf_weights_moved_and_output_unchanged(tmp_path, monkeypatch):
    from tokenmill import LLM, SamplingParams

    path = ms.ensure_gguf("tiny-test", "Q4_0", tmp_path)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    ids = [{"prompt_token_ids": [5, 17, 300, 2000, 41]}]

    def run() -> tuple[list[int], list[torch.Tensor]]:
        llm = LLM(str(path), max_model_len=256, kv_cache_memory_bytes=16 << 20)
        tokens = list(llm.generate(ids, greedy, use_tqdm=False)[0].outputs[0].token_ids)
        blocks = [p for p in llm.engine.runner.model.parameters() if p.dtype == torch.uint8]
        llm.close()
        return tokens, blocks

    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1)  # the tiny model's matrices are a few KiB
    moved_tokens, moved = run()
    assert moved and all("hg" in vm_flags(p.data_ptr()) for p in moved)
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    kept_tokens, kept = run()
    assert not all("hg" in vm_flags(p.data_ptr()) for p in kept)  # (large tensors may come advised from elsewhere)
    assert moved_tokens == kept_tokens


@needs_thp
def test_separate_mappings_for_models_whose_layers_stream():
    """A model whose layers will stream from disk loads with no arena: small tensors stay put, large ones get a
    mapping of their own (freed with the tensor when the store replaces it by a view of its file)."""
    small = torch.ones(300_000, dtype=torch.uint8)
    large = torch.ones(2 * huge_pages.HUGE + 5, dtype=torch.uint8)
    with huge_pages.separate_mappings():
        assert huge_pages.to_huge_pages(small) is small
        moved = huge_pages.to_huge_pages(large)
    assert moved.data_ptr() % huge_pages.HUGE == 0 and torch.equal(moved, large)
    assert huge_pages.to_huge_pages(small) is not small  # outside: the arena again

"""Tests for the KV transfer executor (tokenmill/executor/kv_transfer.py) and the disk file format
(kv_disk.py): copies are bit-exact in every tier, files are checked on load (flipped bytes in data
or header, truncation, a missing file all fail), pending writes are readable before they land."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill.core.kv_offload import DeleteFileOp, LoadOp, SaveOp, SpillOp
from tokenmill.executor import kv_disk
from tokenmill.executor.kv_transfer import KVTransfer

NUM_BLOCKS, BS, HK, D = 6, 4, 2, 8


def make_caches(dtype=torch.float32, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, BS, HK, D, generator=g).to(dtype) for _ in range(2 * layers)]


def H(i: int) -> bytes:
    return bytes([i]) * 32


def block(caches, b):
    return [c[b].clone() for c in caches]


def same(x, y) -> bool:
    return all(torch.equal(a, b) for a, b in zip(x, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_round_trip_is_bit_exact(dtype):
    caches = make_caches(dtype)
    t = KVTransfer(caches, num_host_slots=3, disk_dir=None)
    assert t.bytes_per_block == 4 * BS * HK * D * caches[0].element_size()
    want = [block(caches, b) for b in (1, 4)]
    t.run([SaveOp(1, 2, H(1)), SaveOp(4, 0, H(4))])
    for c in caches:
        c.fill_(float("nan"))
    assert t.run([LoadOp(5, H(1), slot=2), LoadOp(0, H(4), slot=0)]) == []
    assert same(block(caches, 5), want[0]) and same(block(caches, 0), want[1])


def test_disk_round_trip_pending_then_on_disk(tmp_path):
    caches = make_caches()
    t = KVTransfer(caches, num_host_slots=2, disk_dir=str(tmp_path))
    want = [block(caches, b) for b in range(2)]
    t.run([SaveOp(0, 0, H(0)), SaveOp(1, 1, H(1)), SpillOp(7, (1, 0), (H(1), H(0)))])
    t.run([SaveOp(2, 0, H(2))])  # the slot is reused at once: the spill took a copy
    for c in caches:
        c.zero_()
    # Maybe still in the writer's queue, maybe written: either way it loads.
    assert t.run([LoadOp(3, H(0), file_id=7, index=1)]) == []
    t.flush()
    assert os.path.exists(t.path(7)) and t.writer.pending == {}
    assert t.run([LoadOp(4, H(1), file_id=7, index=0)]) == []
    assert same(block(caches, 3), want[0]) and same(block(caches, 4), want[1])
    with open(t.path(7), "rb") as f:
        header = kv_disk.read_header(f, t.bytes_per_block)
    assert header.hashes == [H(1), H(0)]
    assert os.path.getsize(t.path(7)) == kv_disk.header_size(2) + 2 * t.bytes_per_block
    t.run([DeleteFileOp(7)])
    t.flush()
    assert not os.path.exists(t.path(7))
    d = t.dir
    t.close()
    assert not os.path.exists(d)  # the engine's own folder goes with it


def _spilled(tmp_path, n=3):
    caches = make_caches()
    t = KVTransfer(caches, num_host_slots=n, disk_dir=str(tmp_path))
    t.run([SaveOp(b, b, H(b)) for b in range(n)] + [SpillOp(0, tuple(range(n)), tuple(H(b) for b in range(n)))])
    t.flush()
    return t, caches, [block(caches, b) for b in range(n)]


def test_flipped_data_byte_fails_only_that_block(tmp_path):
    t, caches, want = _spilled(tmp_path)
    path = t.path(0)
    data = bytearray(open(path, "rb").read())
    data[kv_disk.header_size(3) + t.bytes_per_block + 5] ^= 0x40  # inside block 1
    open(path, "wb").write(bytes(data))
    for c in caches:
        c.zero_()
    loads = [LoadOp(3, H(0), file_id=0, index=0), LoadOp(4, H(1), file_id=0, index=1), LoadOp(5, H(2), file_id=0, index=2)]
    assert t.run(loads) == [loads[1]]
    assert same(block(caches, 3), want[0]) and same(block(caches, 5), want[2])
    assert all(torch.count_nonzero(c[4]) == 0 for c in caches)  # the bad block was not copied


@pytest.mark.parametrize("damage", ["header-byte", "truncate-data", "truncate-header", "missing", "wrong-hash"])
def test_damaged_file_fails_its_loads(tmp_path, damage):
    t, caches, _ = _spilled(tmp_path)
    path = t.path(0)
    raw = open(path, "rb").read()
    expect = H(2)
    if damage == "header-byte":
        raw = raw[:20] + bytes([raw[20] ^ 1]) + raw[21:]  # inside the first entry's hash
    elif damage == "truncate-data":
        raw = raw[: len(raw) - 10]
    elif damage == "truncate-header":
        raw = raw[:30]
    elif damage == "wrong-hash":
        expect = H(9)
    if damage == "missing":
        os.remove(path)
    else:
        open(path, "wb").write(raw)
    op = LoadOp(4, expect, file_id=0, index=2)
    assert t.run([op]) == [op]


def test_header_checksum_covers_entries():
    blocks = torch.arange(2 * 16, dtype=torch.uint8).view(2, 16).numpy()
    head = bytearray(kv_disk.encode_header([H(1), H(2)], blocks))
    import io

    assert kv_disk.read_header(io.BytesIO(bytes(head)), 16).hashes == [H(1), H(2)]
    head[-6] ^= 1  # a crc byte of the last entry
    with pytest.raises(kv_disk.CorruptBlock):
        kv_disk.read_header(io.BytesIO(bytes(head)), 16)
    with pytest.raises(kv_disk.CorruptBlock):
        kv_disk.read_header(io.BytesIO(kv_disk.encode_header([H(1)], blocks[:1])), 32)  # other block size

"""Disk tier files: one file per group of KV blocks, a checksummed header, a background writer.

Layout (little-endian):
    header:  magic b"TMKV", version u32, n u32, bytes_per_block u64
             n entries of (block hash: 32 bytes, crc32 of the block's bytes: u32)
             crc32 of everything above: u32
    data:    n blocks of bytes_per_block bytes

A load checks the magic, the header crc, that the entry names the hash it was asked for, that the
block is all there and that its crc32 matches: a flipped byte or a truncated file is recomputed,
never served. crc32 (zlib, ~1 GB/s, releases the GIL) is enough for corruption; the block's identity
is already its sha256 name. Files are written to a temporary name and renamed, so a reader never
sees a half-written file from this process.
"""
from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"TMKV"
VERSION = 1
_HEAD = struct.Struct("<4sIIQ")
_ENTRY = struct.Struct("<32sI")
_CRC = struct.Struct("<I")


class CorruptBlock(Exception):
    """A disk block failed a check; the caller recomputes it."""


def header_size(n: int) -> int:
    return _HEAD.size + n * _ENTRY.size + _CRC.size


def encode_header(hashes: list[bytes], blocks: np.ndarray) -> bytes:
    """blocks: uint8 [n, bytes_per_block]."""
    head = _HEAD.pack(MAGIC, VERSION, len(hashes), blocks.shape[1])
    head += b"".join(_ENTRY.pack(h, zlib.crc32(blocks[i])) for i, h in enumerate(hashes))
    return head + _CRC.pack(zlib.crc32(head))


@dataclass
class Header:
    hashes: list[bytes]
    crcs: list[int]
    bytes_per_block: int

    def offset(self, index: int) -> int:
        return header_size(len(self.hashes)) + index * self.bytes_per_block


def read_header(f, bytes_per_block: int) -> Header:
    raw = f.read(_HEAD.size)
    if len(raw) < _HEAD.size:
        raise CorruptBlock("truncated header")
    magic, version, n, bpb = _HEAD.unpack(raw)
    if magic != MAGIC or version != VERSION or bpb != bytes_per_block or n > 1 << 20:
        raise CorruptBlock("bad header")
    rest = f.read(n * _ENTRY.size + _CRC.size)
    if len(rest) < n * _ENTRY.size + _CRC.size:
        raise CorruptBlock("truncated header")
    (crc,) = _CRC.unpack_from(rest, n * _ENTRY.size)
    if zlib.crc32(raw + rest[: n * _ENTRY.size]) != crc:
        raise CorruptBlock("header checksum mismatch")
    entries = [_ENTRY.unpack_from(rest, i * _ENTRY.size) for i in range(n)]
    return Header([h for h, _ in entries], [c for _, c in entries], bpb)


def read_block(f, header: Header, index: int, expected_hash: bytes, out: np.ndarray) -> None:
    """Read block `index` into `out` (uint8 [bytes_per_block]) or raise CorruptBlock."""
    if index >= len(header.hashes) or header.hashes[index] != expected_hash:
        raise CorruptBlock("block not in file")
    f.seek(header.offset(index))
    if f.readinto(memoryview(out)) != header.bytes_per_block:
        raise CorruptBlock("truncated block")
    if zlib.crc32(out) != header.crcs[index]:
        raise CorruptBlock("block checksum mismatch")


def write_file(path: str, hashes: list[bytes], blocks: np.ndarray) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # unique: two writers of one name never mix
    with open(tmp, "wb") as f:
        f.write(encode_header(hashes, blocks))
        f.write(memoryview(np.ascontiguousarray(blocks)).cast("B"))
    os.replace(tmp, path)


class DiskWriter:
    """Writes and deletes block files on one background thread, in submission order. Until a file is
    on disk its bytes stay in `pending`, where loads find them."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[list[bytes], np.ndarray]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-disk", daemon=True)
        self._thread.start()

    def write(self, path: str, hashes: list[bytes], blocks: np.ndarray) -> None:
        with self._lock:
            self.pending[path] = (hashes, blocks)
        self._queue.put(("write", path))

    def delete(self, path: str) -> None:
        self._queue.put(("delete", path))

    def lookup(self, path: str) -> tuple[list[bytes], np.ndarray] | None:
        with self._lock:
            return self.pending.get(path)

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                kind, path = job
                if kind == "write":
                    with self._lock:
                        entry = self.pending.get(path)
                    if entry is not None:
                        try:
                            write_file(path, *entry)
                        except OSError as e:  # a full disk: loads of this file fail their checks, then recompute
                            self.errors += 1
                            log.warning("KV offload: could not write %s: %s", path, e)
                        with self._lock:
                            self.pending.pop(path, None)
                else:
                    with self._lock:
                        self.pending.pop(path, None)
                    try:
                        os.remove(path)
                    except FileNotFoundError:
                        pass
            finally:
                self._queue.task_done()

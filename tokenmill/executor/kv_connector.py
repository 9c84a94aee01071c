"""The worker side of the KV connector (core/kv_connector.py): writes the blocks a prefill instance computed
and loads them into a decode instance's pool, in the disk tier's checksummed file format."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tokenmill.core.kv_connector import ExportOp, ImportOp, PrefetchOp, block_path
from tokenmill.executor import kv_disk
from tokenmill.executor.kv_transfer import KVTransfer

log = logging.getLogger(__name__)


class ConnectorWorker:
    def __init__(self, caches: list[torch.Tensor], path: str) -> None:
        self.io = KVTransfer(caches, 0, None)  # packed-row views and device copies; no host slots here
        self.path = path
        # Overlapped loading: blocks read (and checked) in the background, waiting for their import.
        self.staged: OrderedDict[bytes, np.ndarray | None] = OrderedDict()  # None: the read failed
        self.max_staged = 1 << 14
        # Rows dropped from `staged` to bound its memory before their import. They still count as read
        # (`finished`), so their request is admitted and reads them from their files in the step instead
        # of waiting for a row that is gone. Hashes only (32 bytes each), bounded too.
        self.dropped: OrderedDict[bytes, None] = OrderedDict()
        self.max_dropped = 1 << 16
        self.from_memory = 0  # imports served by a background read (overlapped) rather than read in the step
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv-prefetch")

    def _read(self, h: bytes) -> np.ndarray | None:
        row = np.empty(self.io.bytes_per_block, dtype=np.uint8)
        path = block_path(self.path, h)
        try:
            with open(path, "rb") as f:
                header = kv_disk.read_header(f, self.io.bytes_per_block)
                kv_disk.read_block(f, header, 0, h, row)
            return row
        except (OSError, kv_disk.CorruptBlock) as e:
            log.warning("KV transfer: %s reading %s: recomputing", e, path)
            return None

    def prefetch(self, op: PrefetchOp) -> None:
        def run() -> None:
            for h in op.hashes:
                row = self._read(h)
                with self._lock:
                    self._stage(h, row)
        self._pool.submit(run)

    def _stage(self, h: bytes, row: np.ndarray | None) -> None:
        self.staged[h] = row
        self.staged.move_to_end(h)
        self.dropped.pop(h, None)
        while len(self.staged) > self.max_staged:
            old, _ = self.staged.popitem(last=False)
            self.dropped[old] = None
            while len(self.dropped) > self.max_dropped:
                self.dropped.popitem(last=False)

    def finished(self, hashes: list[bytes]) -> list[bytes]:
        """Which of these hashes the background reads are done with: staged in memory, failed, or dropped
        again to bound memory (then the import reads the file in its step)."""
        with self._lock:
            return [h for h in hashes if h in self.staged or h in self.dropped]

    def wait_prefetched(self, timeout: float) -> bool:
        """Wait until the prefetches submitted so far have run, at most `timeout` seconds."""
        try:
            self._pool.submit(lambda: None).result(timeout)  # one thread, first in first out
        except TimeoutError:
            return False
        return True

    def export(self, ops: list[ExportOp]) -> None:
        """Write each block to <path>/<hash>.kvb (one file per block, renamed into place when complete)."""
        if not ops:
            return
        io = self.io
        rows = torch.empty((len(ops), io.bytes_per_block), dtype=torch.uint8)
        blocks = torch.tensor([op.block_id for op in ops], device=io.device)
        for cache, view in zip(io.caches, io._views(rows)):
            view.copy_(cache.index_select(0, blocks).cpu())
        data = rows.numpy()
        for i, op in enumerate(ops):
            kv_disk.write_file(block_path(self.path, op.hash), [op.hash], data[i : i + 1])

    def load(self, ops: list[ImportOp]) -> list[ImportOp]:
        """Read and check each block, copy the good ones into their device blocks; returns the failed."""
        if not ops:
            return []
        io = self.io
        staging = np.empty((len(ops), io.bytes_per_block), dtype=np.uint8)
        good, failed = [], []
        for k, op in enumerate(ops):
            with self._lock:
                staged = self.staged.pop(op.hash, False)
                self.dropped.pop(op.hash, None)
            row = self._read(op.hash) if staged is False else staged  # not prefetched: read it now
            self.from_memory += staged is not False
            if row is None:
                failed.append(op)
                continue
            staging[k] = row
            good.append(k)
        if good:
            io._to_device([ops[k].block_id for k in good], io._views(torch.from_numpy(staging[good])), None)
        return failed

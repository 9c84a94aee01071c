"""The worker side of the KV connector (core/kv_connector.py): writes the blocks a prefill instance computed
and loads them into a decode instance's pool, in the disk tier's checksummed file format."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenmill.core.kv_connector import ExportOp, ImportOp, block_path
from tokenmill.executor import kv_disk
from tokenmill.executor.kv_transfer import KVTransfer

log = logging.getLogger(__name__)


class ConnectorWorker:
    def __init__(self, caches: list[torch.Tensor], path: str) -> None:
        self.io = KVTransfer(caches, 0, None)  # packed-row views and device copies; no host slots here
        self.path = path
        self.bytes_moved = 0
        self.seconds = 0.0

    def export(self, ops: list[ExportOp]) -> None:
        """Write each block to <path>/<hash>.kvb (one file per block, renamed into place when complete)."""
        if not ops:
            return
        t0 = time.perf_counter()
        io = self.io
        rows = torch.empty((len(ops), io.bytes_per_block), dtype=torch.uint8)
        blocks = torch.tensor([op.block_id for op in ops], device=io.device)
        for cache, view in zip(io.caches, io._views(rows)):
            view.copy_(cache.index_select(0, blocks).cpu())
        data = rows.numpy()
        for i, op in enumerate(ops):
            kv_disk.write_file(block_path(self.path, op.hash), [op.hash], data[i : i + 1])
        self.bytes_moved += data.nbytes
        self.seconds += time.perf_counter() - t0

    def load(self, ops: list[ImportOp]) -> list[ImportOp]:
        """Read and check each block, copy the good ones into their device blocks; returns the failed."""
        if not ops:
            return []
        t0 = time.perf_counter()
        io = self.io
        staging = np.empty((len(ops), io.bytes_per_block), dtype=np.uint8)
        good, failed = [], []
        for k, op in enumerate(ops):
            path = block_path(self.path, op.hash)
            try:
                with open(path, "rb") as f:
                    header = kv_disk.read_header(f, io.bytes_per_block)
                    kv_disk.read_block(f, header, 0, op.hash, staging[k])
                good.append(k)
            except (OSError, kv_disk.CorruptBlock) as e:
                log.warning("KV transfer: %s reading %s: recomputing", e, path)
                failed.append(op)
        if good:
            io._to_device([ops[k].block_id for k in good], io._views(torch.from_numpy(staging[good])), None)
        self.bytes_moved += len(good) * io.bytes_per_block
        self.seconds += time.perf_counter() - t0
        return failed

"""Runs the KV tier ops (tokenmill/engine/kv_offload.py) with torch copies and file I/O, before the
forward pass of each step, and measures at start-up when a load beats recomputing.

A block's bytes are, layer by layer, its K then its V block ([block_size, Hk, D] each), packed in one
uint8 row. The host tier is a [slots, bytes_per_block] uint8 tensor (pinned on CUDA) with per-layer
strided views, so a run of same-kind ops is one index_select / index_copy_ per layer and tensor.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.config import CacheConfig
from tokenmill.core.kv_offload import (
    DeleteFileOp,
    LoadOp,
    OffloadTiers,
    SaveOp,
    SpillOp,
    TransferCosts,
    TransferOp,
)
from tokenmill.core.batch import NewRequestData, ScheduledBatch
from tokenmill.executor import kv_disk
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class TransferStats:
    ops_s: float = 0.0  # time spent running ops, all steps
    last_ops_s: float = 0.0


class KVTransfer:
    def __init__(self, caches: list[torch.Tensor], num_host_slots: int, disk_dir: str | None) -> None:
        """caches: every device KV tensor ([num_blocks, block_size, Hk, D]), K and V of each layer."""
        self.caches = caches
        self.device = caches[0].device
        sizes = [c[0].numel() * c.element_size() for c in caches]
        self.bytes_per_block = sum(sizes)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        pin = self.device.type == "cuda"
        self.host = torch.empty((num_host_slots, self.bytes_per_block), dtype=torch.uint8, pin_memory=pin)
        self.host_views = self._views(self.host)
        self.stats = TransferStats()
        self.writer: kv_disk.DiskWriter | None = None
        self.dir: str | None = None
        if disk_dir is not None:
            os.makedirs(disk_dir, exist_ok=True)
            # One folder per engine: files are named by file id, which restarts with each engine.
            self.dir = tempfile.mkdtemp(prefix="tokenmill-kv-", dir=disk_dir)
            self.writer = kv_disk.DiskWriter()
            self._finalizer = weakref.finalize(self, _shutdown, self.writer, self.dir)

    def _views(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per-cache views of packed uint8 rows [n, bytes_per_block] -> [n, block_size, Hk, D]."""
        views = []
        for c, off in zip(self.caches, self.offsets):
            nbytes = c[0].numel() * c.element_size()
            views.append(rows[:, off : off + nbytes].view(c.dtype).view(rows.shape[0], *c.shape[1:]))
        return views

    def path(self, file_id: int) -> str:
        return os.path.join(self.dir, f"{file_id:08d}.kvb")

    # ---- running ops -----------------------------------------------------------------------
    def run(self, ops: list[TransferOp]) -> list[LoadOp]:
        """Run ops in order (runs of one kind batched). Returns the loads that failed their checks."""
        t0 = time.perf_counter()
        failed: list[LoadOp] = []
        i = 0
        while i < len(ops):
            j = i + 1
            kind = _kind(ops[i])
            while j < len(ops) and _kind(ops[j]) == kind:
                j += 1
            run = ops[i:j]
            if kind == "save":
                self._save(run)
            elif kind == "load-host":
                self._load_host(run)
            elif kind == "load-disk":
                failed += self._load_disk(run)
            elif kind == "spill":
                for op in run:
                    self._spill(op)
            else:
                for op in run:
                    self.writer.delete(self.path(op.file_id))
            i = j
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.last_ops_s = time.perf_counter() - t0
        self.stats.ops_s += self.stats.last_ops_s
        return failed

    def _save(self, ops: list[SaveOp]) -> None:
        blocks = torch.tensor([op.block_id for op in ops], device=self.device)
        slots = torch.tensor([op.slot for op in ops])
        for cache, view in zip(self.caches, self.host_views):
            view.index_copy_(0, slots, cache.index_select(0, blocks).cpu())

    def _load_host(self, ops: list[LoadOp]) -> None:
        slots = torch.tensor([op.slot for op in ops])
        self._to_device([op.block_id for op in ops], self.host_views, slots)

    def _to_device(self, block_ids: list[int], views: list[torch.Tensor], rows: torch.Tensor | None) -> None:
        blocks = torch.tensor(block_ids, device=self.device)
        for cache, view in zip(self.caches, views):
            src = view if rows is None else view.index_select(0, rows)
            cache.index_copy_(0, blocks, src.to(self.device, non_blocking=True))

    def _spill(self, op: SpillOp) -> None:
        rows = self.host.index_select(0, torch.tensor(op.slots)).numpy()  # a copy: the slots are reused at once
        self.writer.write(self.path(op.file_id), list(op.hashes), rows)

    def _load_disk(self, ops: list[LoadOp]) -> list[LoadOp]:
        staging = np.empty((len(ops), self.bytes_per_block), dtype=np.uint8)
        good: list[int] = []
        failed: list[LoadOp] = []
        by_file: dict[int, list[int]] = {}
        for k, op in enumerate(ops):
            by_file.setdefault(op.file_id, []).append(k)
        for file_id, ks in by_file.items():
            path = self.path(file_id)
            pending = self.writer.lookup(path)
            try:
                if pending is not None:
                    hashes, rows = pending
                    for k in ks:
                        if hashes[ops[k].index] != ops[k].hash:
                            raise kv_disk.CorruptBlock("block not in pending file")
                        staging[k] = rows[ops[k].index]
                        good.append(k)
                    continue
                with open(path, "rb") as f:
                    header = kv_disk.read_header(f, self.bytes_per_block)
                    for k in ks:
                        try:
                            kv_disk.read_block(f, header, ops[k].index, ops[k].hash, staging[k])
                            good.append(k)
                        except kv_disk.CorruptBlock as e:
                            log.warning("KV offload: %s in %s: recomputing", e, path)
                            failed.append(ops[k])
            except (OSError, kv_disk.CorruptBlock) as e:
                log.warning("KV offload: %s reading %s: recomputing", e, path)
                failed += [ops[k] for k in ks if k not in good and ops[k] not in failed]
        if good:
            rows = torch.from_numpy(staging[good])
            self._to_device([ops[k].block_id for k in good], self._views(rows), None)
        return failed

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self._finalizer()


def _kind(op: TransferOp) -> str:
    if isinstance(op, SaveOp):
        return "save"
    if isinstance(op, LoadOp):
        return "load-host" if op.slot is not None else "load-disk"
    if isinstance(op, SpillOp):
        return "spill"
    assert isinstance(op, DeleteFileOp)
    return "delete"


def _shutdown(writer: kv_disk.DiskWriter, directory: str) -> None:
    writer.close()
    shutil.rmtree(directory, ignore_errors=True)


# ---- start-up: build and calibrate ---------------------------------------------------------
def _best_time(fn, repeats: int) -> float:
    # The minimum: other processes only ever add time, so it is the least noisy estimate.
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def calibrate(runner, transfer: KVTransfer, num_blocks: int = 8, repeats: int = 5) -> TransferCosts:
    """Time a forward pass over 1 and N blocks of tokens (the marginal cost of recomputing a block) and
    loads of 1 and N blocks from each tier (fixed + per-block cost). Uses device blocks [0, N) and
    host slots [0, N) before any request exists, so it disturbs nothing. The disk figures are for
    files in the page cache (just written), as recently spilled blocks usually are."""
    bs = runner.block_size
    n = max(2, min(num_blocks, runner.num_blocks, transfer.host.shape[0]))

    def forward(k: int) -> None:
        rid = "calibration"
        new = NewRequestData(rid, [0] * (k * bs), k * bs, list(range(k)), 0, SamplingParams(max_tokens=1), None)
        runner.execute_model(ScheduledBatch([rid], [k * bs], [1], [new], finished_req_ids=[rid]))

    if n > transfer.host.shape[0] or n > runner.num_blocks:
        return TransferCosts(recompute_per_block=0.0)  # too small to measure: never load
    for _ in range(2):  # warm-up of both shapes (first calls of a shape run far slower); writes finite KV
        forward(n)
        forward(1)
    t1, tn = _best_time(lambda: forward(1), repeats), _best_time(lambda: forward(n), repeats)
    # Marginal cost per block; if noise swamps the difference, the average (an upper bound) instead.
    recompute = (tn - t1) / (n - 1) if tn > t1 else tn / n

    def fit(load) -> tuple[float, float]:
        load(n)  # warm-up
        l1, ln = _best_time(lambda: load(1), repeats), _best_time(lambda: load(n), repeats)
        per = max(ln - l1, 0.0) / (n - 1)
        return max(l1 - per, 0.0), per

    transfer.run([SaveOp(b, b, b"") for b in range(n)])
    host_fixed, host_per = fit(lambda k: transfer.run([LoadOp(b, b"", slot=b) for b in range(k)]))
    costs = TransferCosts(recompute, host_fixed, host_per)
    if transfer.writer is not None:
        hashes = [bytes([b]) * 32 for b in range(n)]
        calib_id = -1  # never a real file id
        kv_disk.write_file(transfer.path(calib_id), hashes, transfer.host[:n].numpy())
        try:
            def load_disk(k: int) -> None:
                failed = transfer.run([LoadOp(b, hashes[b], file_id=calib_id, index=b) for b in range(k)])
                assert not failed, "calibration file failed its checks"

            costs.disk_fixed, costs.disk_per_block = fit(load_disk)
        finally:
            os.remove(transfer.path(calib_id))
    transfer.stats = TransferStats()
    runner.execute_model(ScheduledBatch(finished_req_ids=["calibration"]))  # the runner forgets it
    return costs


@dataclass
class OffloadSpec:
    """What the worker's transfer executor can hold; the core builds its OffloadTiers from it."""

    host_slots: int
    disk: bool
    costs: TransferCosts | None


def build_transfer(cache: CacheConfig, runner) -> tuple[KVTransfer, OffloadSpec] | None:
    """The worker side of the lower KV tiers the config asks for (host buffer, disk folder, measured
    costs), or None."""
    if not cache.kv_offload_bytes and cache.kv_offload_dir is None:
        return None
    if not cache.enable_prefix_caching:
        raise ValueError("kv_offload_bytes / kv_offload_dir need prefix caching (enable_prefix_caching=True).")
    bpb = runner.bytes_per_block
    slots = cache.kv_offload_bytes // bpb
    if cache.kv_offload_dir is not None:
        slots = max(slots, cache.kv_offload_group_blocks)  # the host tier stages groups for the disk
    if slots < 1:
        raise ValueError(
            f"kv_offload_bytes={cache.kv_offload_bytes} holds no block of {bpb} bytes; raise it or set kv_offload_dir."
        )
    transfer = KVTransfer(runner.kv_caches(), slots, cache.kv_offload_dir)
    costs = calibrate(runner, transfer) if cache.kv_offload_min_blocks is None else None
    log.info("KV offload: host tier %d blocks (%.1f MiB)%s%s", slots, slots * bpb / 2**20,
             f", disk tier in {transfer.dir}" if transfer.dir else "", f"; measured {costs}" if costs else "")
    return transfer, OffloadSpec(slots, transfer.writer is not None, costs)


def build_tiers(cache: CacheConfig, spec: OffloadSpec | None, bytes_per_block: int) -> OffloadTiers | None:
    """The core side: bookkeeping of the host/disk tiers the worker holds."""
    if spec is None:
        return None
    disk_budget = None if cache.kv_offload_disk_bytes is None else cache.kv_offload_disk_bytes // bytes_per_block
    tiers = OffloadTiers(
        host_slots=spec.host_slots,
        disk=spec.disk,
        group_blocks=cache.kv_offload_group_blocks,
        disk_budget_blocks=disk_budget,
        min_chain_blocks=cache.kv_offload_min_blocks,
        costs=spec.costs,
    )
    log.info("KV offload: break-even chain length %s", tiers.break_even_blocks)
    return tiers

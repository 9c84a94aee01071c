"""The worker's KV transfer calls (the executor runs them by name): lower-tier saves and loads before a step's
forward, a KV connector's background reads and the blocks a producer hands over after it. Mixed into Worker."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner


class TransferRPCs:
    """Mixed into Worker; uses its transfer executor (kv_transfer.py) and KV connector (kv_connector.py)."""

    runner: ModelRunner
    transfer: object | None
    connector: object | None

    def transfer_kv(self, ops: list) -> tuple[list, float]:
        """Run the KV tier ops before the step's forward; returns (failed loads, seconds)."""
        from tokenmill.core.kv_offload import LoadOp

        from tokenmill.core.kv_connector import ImportOp, PrefetchOp

        for op in ops:
            if isinstance(op, PrefetchOp):
                self.connector.prefetch(op)  # background reads: returns at once
        imports = [op for op in ops if isinstance(op, ImportOp)]
        tier_ops = [op for op in ops if not isinstance(op, (ImportOp, PrefetchOp))]
        failed, seconds = [], 0.0
        if tier_ops:
            failed = self.transfer.run(tier_ops)
            seconds = self.transfer.stats.last_ops_s
        if imports:
            t0 = time.perf_counter()
            failed += self.connector.load(imports)
            seconds += time.perf_counter() - t0
        loaded = [op.block_id for op in ops if isinstance(op, (LoadOp, ImportOp))]
        if loaded:  # written outside a forward pass: lazy zeroing must leave them be
            self.runner.mark_initialized(torch.tensor(loaded, dtype=torch.long))
        return failed, seconds

    def kv_prefetched(self, hashes: list[bytes]) -> list[bytes]:
        """Which of these handed-over blocks the background reads have finished (read or failed)."""
        return self.connector.finished(hashes)

    def export_kv(self, ops: list) -> float:
        """A KV producer's blocks computed by the step just run: write them for the decode instances.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        self.connector.export(ops)
        return time.perf_counter() - t0

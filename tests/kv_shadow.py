"""A shadow of the KV transfer executor for the pure-Python property tests: runs the tier ops of
tokenmill/engine/kv_offload.py on "contents" (a name for the KV written in each slot) instead of
tensors, so a test can check that every block, host slot and disk block holds what its hash says."""
from __future__ import annotations

from tokenmill.core.kv_offload import DeleteFileOp, LoadOp, SaveOp, SpillOp


class ShadowTransfer:
    def __init__(self) -> None:
        self.host: dict[int, dict[int, int]] = {}  # host slot -> block content
        self.files: dict[int, list[dict[int, int]]] = {}  # file id -> block contents
        self.corrupt: set[int] = set()  # file ids whose loads fail their checksum
        self.deleted: set[int] = set()

    def run(self, ops, content: dict[int, dict[int, int]]) -> list[LoadOp]:
        """Apply ops in order to `content` (device block -> slot -> key). Returns the failed loads."""
        failed = []
        for op in ops:
            if isinstance(op, SaveOp):
                self.host[op.slot] = dict(content.get(op.block_id, {}))
            elif isinstance(op, SpillOp):
                assert op.file_id not in self.files, "file id reused"
                self.files[op.file_id] = [dict(self.host[s]) for s in op.slots]
            elif isinstance(op, LoadOp):
                if op.slot is not None:
                    content[op.block_id] = dict(self.host[op.slot])
                elif op.file_id in self.corrupt:
                    content[op.block_id] = {}  # garbage: must never be read
                    failed.append(op)
                else:
                    assert op.file_id not in self.deleted, "load from a deleted file"
                    content[op.block_id] = dict(self.files[op.file_id][op.index])
            else:
                assert isinstance(op, DeleteFileOp)
                self.deleted.add(op.file_id)
        return failed

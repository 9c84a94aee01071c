"""Disaggregated prefill/decode: KV blocks handed from a prefill instance to a decode instance (vLLM's
`--kv-transfer-config`). No torch: this side decides what moves; executor/kv_connector.py moves the bytes.

SharedStorageConnector (one node, or any shared file system): a producer writes each full block it computes
to `<shared_storage_path>/<block hash>.kvb` after the step's forward pass (the file format of the disk KV tier:
a header with the hash and a checksum; written under a temporary name, then renamed, so a reader never sees
half a file). A consumer admitting a request looks its prompt's hash chain up there after its own prefix
cache and loads the blocks it finds into fresh device blocks before the forward pass, instead of computing
them. Blocks are named by the same sha256 chain as the prefix cache (core/kv_cache.hash_block), so a
consumer only ever loads KV computed for exactly its prefix. A load that fails its checksum is recomputed.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("SharedStorageConnector",)


@dataclass(frozen=True)
class ExportOp:
    block_id: int
    hash: bytes


@dataclass(frozen=True)
class ImportOp:
    block_id: int
    hash: bytes


@dataclass
class ConnectorStats:
    exported: int = 0  # blocks written for consumers
    imported: int = 0  # blocks loaded instead of computed
    import_failures: int = 0


def block_path(root: str, h: bytes) -> str:
    return os.path.join(root, h.hex() + ".kvb")


@dataclass
class SharedStorageConnector:
    path: str
    role: str
    exports: list[ExportOp] = field(default_factory=list)
    imports: list[ImportOp] = field(default_factory=list)
    stats: ConnectorStats = field(default_factory=ConnectorStats)

    def __post_init__(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        self.produce = self.role in ("kv_producer", "kv_both")
        self.consume = self.role in ("kv_consumer", "kv_both")
        self._written: OrderedDict[bytes, None] = OrderedDict()  # recently exported: do not write again
        self._bad: set[bytes] = set()  # failed their checksum here: recompute, do not look up again

    def lookup(self, hashes: list[bytes]) -> list[bytes]:
        """The leading hashes of a prompt's chain that a producer has written."""
        if not self.consume:
            return []
        found = []
        for h in hashes:
            if h in self._bad or not os.path.exists(block_path(self.path, h)):
                break
            found.append(h)
        return found

    def export(self, block_id: int, h: bytes) -> None:
        """A block named this step: write it after the forward pass has computed it."""
        if not self.produce or h in self._written:
            return
        self._written[h] = None
        if len(self._written) > 1 << 16:
            self._written.popitem(last=False)
        self.exports.append(ExportOp(block_id, h))

    def load(self, h: bytes, block_id: int) -> ImportOp:
        op = ImportOp(block_id, h)
        self.imports.append(op)
        return op

    def take_imports(self) -> list[ImportOp]:
        ops, self.imports = self.imports, []
        self.stats.imported += len(ops)
        return ops

    def take_exports(self) -> list[ExportOp]:
        ops, self.exports = self.exports, []
        self.stats.exported += len(ops)
        return ops

    def import_failed(self, h: bytes) -> None:
        self.stats.import_failures += 1
        self.stats.imported -= 1
        self._bad.add(h)


def make_connector(cfg) -> SharedStorageConnector | None:
    """From config.KVTransferConfig (None: no transfer)."""
    if cfg is None:
        return None
    path = (cfg.kv_connector_extra_config or {}).get("shared_storage_path", "tokenmill-kv-transfer")
    return SharedStorageConnector(os.path.abspath(path), cfg.kv_role)

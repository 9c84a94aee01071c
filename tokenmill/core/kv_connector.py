"""Disaggregated prefill/decode: KV blocks handed from a prefill instance to a decode instance (vLLM's
`--kv-transfer-config`). No torch: this side decides what moves; executor/kv_connector.py moves the bytes.

SharedStorageConnector (one node, or any shared file system): a producer writes each full block it computes
to `<shared_storage_path>/<block hash>.kvb` after the step's forward pass (the file format of the disk KV tier:
a header with the hash and a checksum; written under a temporary name, then renamed, so a reader never sees
half a file). A consumer admitting a request looks its prompt's hash chain up there after its own prefix
cache and loads the blocks it finds into fresh device blocks before the forward pass, instead of computing
them. Blocks are named by the same sha256 chain as the prefix cache (core/kv_cache.hash_block), so a
consumer only ever loads KV computed for exactly its prefix. A load that fails its checksum is recomputed.

TCPConnector (between nodes): the consumer pulls the blocks it lacks from the producers' servers over HTTP
into its own folder first (see the class).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("SharedStorageConnector", "TCPConnector")


@dataclass(frozen=True)
class ExportOp:
    block_id: int
    hash: bytes


@dataclass(frozen=True)
class ImportOp:
    block_id: int
    hash: bytes


@dataclass(frozen=True)
class PrefetchOp:
    """Read these blocks' files into host memory in the background (the worker), so the step that admits
    the request only copies them to the device: the reads overlap with the steps in between."""

    hashes: tuple[bytes, ...]


@dataclass
class ConnectorStats:
    exported: int = 0  # blocks written for consumers
    imported: int = 0  # blocks loaded instead of computed
    import_failures: int = 0
    seconds: float = 0.0  # writing exports, and the steps' transfer phases that imported
    pulled_bytes: int = 0  # TCPConnector: block files fetched from producers


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
        # Overlapped loading: request id -> its remote chain, while the worker reads it into host memory.
        self.prefetches: list[PrefetchOp] = []
        self.pending: dict[str, tuple[bytes, ...]] = {}
        self.ready: set[str] = set()

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

    def take_imports(self) -> list:
        """Prefetches first (they start background reads), then this step's imports."""
        ops, self.imports = self.imports, []
        self.stats.imported += len(ops)
        pre, self.prefetches = self.prefetches, []
        return pre + ops

    # ---- overlapped loading -------------------------------------------------------------------
    def admissible(self, req_id: str, chain: list[bytes]) -> bool:
        """May a request whose remote chain is `chain` be admitted now? The first time, its blocks start
        loading into host memory in the background and it waits (the queue goes on without it); once the
        worker reports them read, it is admitted and its import is a copy from memory."""
        if not chain or req_id in self.ready:
            return True
        if req_id not in self.pending:
            self.pending[req_id] = tuple(chain)
            self.prefetches.append(PrefetchOp(tuple(chain)))
        return False

    def pending_hashes(self) -> list[bytes]:
        return [h for chain in self.pending.values() for h in chain]

    def mark_read(self, done: set[bytes]) -> None:
        """The worker has read (or failed to read) these hashes: their requests may be admitted."""
        for rid, chain in list(self.pending.items()):
            if all(h in done for h in chain):
                del self.pending[rid]
                self.ready.add(rid)

    def admitted(self, req_id: str) -> None:
        self.ready.discard(req_id)
        self.pending.pop(req_id, None)

    def take_exports(self) -> list[ExportOp]:
        ops, self.exports = self.exports, []
        self.stats.exported += len(ops)
        return ops

    def timed(self, ops: list, seconds: float) -> None:
        """A step's transfer phase took `seconds`; it counts as KV transfer when it imported blocks."""
        if any(isinstance(op, ImportOp) for op in ops):
            self.stats.seconds += seconds

    def import_failed(self, h: bytes) -> None:
        self.stats.import_failures += 1
        self.stats.imported -= 1
        self._bad.add(h)


@dataclass
class TCPConnector(SharedStorageConnector):
    """Between nodes: a consumer pulls the blocks it lacks from producer servers over TCP (HTTP POST
    /v1/kv_blocks: the leading blocks of a hash chain that the producer holds, in the same checksummed file
    format) into its local folder, then loads them as SharedStorageConnector does. Producers are ordinary
    kv_producer instances (their blocks in a local folder); their API key, if any, goes in `api_key`."""

    producers: list[str] = field(default_factory=list)
    api_key: str | None = None
    timeout_s: float = 10.0

    def lookup(self, hashes: list[bytes]) -> list[bytes]:
        found = super().lookup(hashes)
        missing = hashes[len(found):]
        if not self.consume or not missing or not self.producers or missing[0] in self._bad:
            return found
        for url in self.producers:
            got = self._pull(url, missing)
            if got:
                return found + got
        return found

    def _pull(self, url: str, hashes: list[bytes]) -> list[bytes]:
        import struct

        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.post(f"{url.rstrip('/')}/v1/kv_blocks", json={"hashes": [h.hex() for h in hashes]},
                           headers=headers, timeout=self.timeout_s)
            if r.status_code != 200:
                return []
        except httpx.HTTPError:
            return []
        data, pos, got = r.content, 0, []
        for h in hashes:  # length-prefixed files, in chain order, stopping at the producer's first miss
            if pos + 4 > len(data):
                break
            (n,) = struct.unpack_from("<I", data, pos)
            blob = data[pos + 4 : pos + 4 + n]
            if len(blob) != n:
                break
            path = block_path(self.path, h)
            tmp = f"{path}.{os.getpid()}.pull"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # checked against its checksum when loaded
            got.append(h)
            pos += 4 + n
        self.stats.pulled_bytes += pos
        return got


def read_blocks(root: str, hashes: list[str], limit: int = 1 << 12) -> bytes:
    """A producer's answer to POST /v1/kv_blocks: the leading blocks of `hashes` it holds, each as a 4-byte
    little-endian length and the block's file."""
    import struct

    out = bytearray()
    for hexh in hashes[:limit]:
        try:
            h = bytes.fromhex(hexh)
            with open(block_path(root, h), "rb") as f:
                blob = f.read()
        except (ValueError, OSError):
            break
        out += struct.pack("<I", len(blob)) + blob
    return bytes(out)


def store_path(cfg) -> str:
    """The folder a config.KVTransferConfig's blocks are written to and read from."""
    return os.path.abspath((cfg.kv_connector_extra_config or {}).get("shared_storage_path", "tokenmill-kv-transfer"))


def make_connector(cfg) -> SharedStorageConnector | None:
    """From config.KVTransferConfig (None: no transfer)."""
    if cfg is None:
        return None
    extra = cfg.kv_connector_extra_config or {}
    path = store_path(cfg)
    if cfg.kv_connector == "TCPConnector":
        producers = extra.get("producers") or []
        if isinstance(producers, str):
            producers = [producers]
        return TCPConnector(path, cfg.kv_role, producers=list(producers), api_key=extra.get("api_key"))
    return SharedStorageConnector(path, cfg.kv_role)

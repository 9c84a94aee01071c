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
into its own folder first, in the background: the scheduler never waits on the network (see the class).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

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
    # A request waits at most this long for its background reads; then it is admitted and its import reads
    # the files in the step (or recomputes what fails): a lost report never holds it forever.
    read_wait_s: float = 60.0

    def __post_init__(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        self.produce = self.role in ("kv_producer", "kv_both")
        self.consume = self.role in ("kv_consumer", "kv_both")
        self._written: OrderedDict[bytes, None] = OrderedDict()  # recently exported: do not write again
        self._bad: set[bytes] = set()  # failed their checksum here: recompute, do not look up again
        # Overlapped loading: request id -> the hashes of its remote chain the worker has not yet reported
        # read into host memory (empty while a TCPConnector lookup for it is still in flight).
        self.prefetches: list[PrefetchOp] = []
        self.pending: dict[str, tuple[bytes, ...]] = {}
        self.ready: set[str] = set()
        self._waiting_since: dict[str, float] = {}  # request id -> when its background reads started

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

    def unexport(self, block_ids: set[int]) -> None:
        """These blocks' step failed before writing them: do not hand them over (a later step may)."""
        keep = []
        for op in self.exports:
            if op.block_id in block_ids:
                self._written.pop(op.hash, None)
            else:
                keep.append(op)
        self.exports = keep

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
        now = time.monotonic()
        if req_id not in self.pending:
            self.pending[req_id] = tuple(chain)
            self._waiting_since[req_id] = now
            self.prefetches.append(PrefetchOp(tuple(chain)))
        elif now - self._waiting_since.get(req_id, now) > self.read_wait_s:
            log.warning("KV transfer: request %s waited %.0f s for its blocks to be read; reading them in the step",
                        req_id, self.read_wait_s)
            self.admitted(req_id)
            return True
        return False

    def pending_hashes(self) -> list[bytes]:
        return [h for chain in self.pending.values() for h in chain]

    def mark_read(self, done: set[bytes]) -> None:
        """The worker has read (or failed to read, or read and dropped again) these hashes: a request whose
        hashes have all been reported may be admitted. Reports accumulate: a hash reported once need not be
        reported again (the worker's staging memory is bounded and may drop it before the rest are read)."""
        for rid, left in list(self.pending.items()):
            if not left:
                continue  # its remote lookup is still in flight (TCPConnector): nothing to read yet
            left = tuple(h for h in left if h not in done)
            if left:
                self.pending[rid] = left
            else:
                del self.pending[rid]
                self.ready.add(rid)

    def admitted(self, req_id: str) -> None:
        """Admitted (or finished): forget its wait."""
        self.ready.discard(req_id)
        self.pending.pop(req_id, None)
        self._waiting_since.pop(req_id, None)

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
    kv_producer instances (their blocks in a local folder); their API key, if any, goes in `api_key`.

    The pulls run on background threads, never in schedule(): a lookup that finds blocks missing starts a
    pull and answers at once with the chain as it may turn out; `admissible` keeps the request waiting in
    the queue (the others go on) until the pull has ended, and the next lookup sees the blocks that came.
    A pull takes at most about `timeout_s`; a producer that fails to answer is skipped for `retry_s`, so a
    dead or slow peer only ever makes requests compute their prompts locally."""

    producers: list[str] = field(default_factory=list)
    api_key: str | None = None
    timeout_s: float = 10.0  # one pull from one producer: connecting, asking and reading the answer
    retry_s: float = 10.0  # a failed producer, or a chain the producers lacked, is not asked again this long
    max_absent: int = 1 << 14  # remembered chains the producers lacked (hashes; bounded memory)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._lock = threading.Condition()
        self._pulling: set[bytes] = set()  # hashes a pull in flight may bring
        self._absent: OrderedDict[bytes, float] = OrderedDict()  # first hash producers lacked -> ask again after
        self._down: dict[str, float] = {}  # producer URL -> when it may be asked again
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenmill-kv-lookup")

    def lookup(self, hashes: list[bytes]) -> list[bytes]:
        """The leading hashes in the local folder; if some are missing, the whole chain while a pull for the
        rest is in flight (started here if none is). Never waits on the network."""
        found = super().lookup(hashes)
        missing = hashes[len(found):]
        if not self.consume or not missing or not self.producers or missing[0] in self._bad:
            return found
        now = time.monotonic()
        with self._lock:
            if missing[0] in self._pulling:
                return list(hashes)  # may still come: `admissible` holds the request until the pull ends
            if self._absent.get(missing[0], 0.0) > now:
                return found  # asked recently: the producers lacked it
            urls = [u for u in self.producers if self._down.get(u, 0.0) <= now]
            if not urls:
                return found  # every producer failed recently: compute locally
            self._pulling.update(missing)
        try:
            self._pool.submit(self._pull_chain, urls, list(missing))
        except RuntimeError:  # shut down (interpreter exit): no pull
            self._pull_ended(list(missing), [])
            return found
        return list(hashes)

    def admissible(self, req_id: str, chain: list[bytes]) -> bool:
        """As SharedStorageConnector's, but first the chain's pull must have ended (its blocks are then on
        disk, or the request computes them)."""
        with self._lock:
            pulling = any(h in self._pulling for h in chain)
        if pulling:
            # Listed as pending (with nothing to read yet), so an idle engine sleeps rather than spins.
            self.pending.setdefault(req_id, ())
            return False
        if self.pending.get(req_id) == ():
            del self.pending[req_id]  # its lookup has ended: from here, an ordinary remote chain
        return super().admissible(req_id, chain)

    def wait_lookups(self, timeout: float) -> bool:
        """Wait until no pull is in flight, at most `timeout` seconds; False if some still is."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pulling, timeout)

    # ---- the background pulls ------------------------------------------------------------------
    def _pull_chain(self, urls: list[str], hashes: list[bytes]) -> None:
        got: list[bytes] = []
        try:
            for url in urls:
                got = self._pull(url, hashes)
                if got:
                    break
        except Exception:  # noqa: BLE001 - a failed pull must still end (the request computes instead)
            log.exception("KV transfer: pulling %d blocks failed", len(hashes))
        finally:
            self._pull_ended(hashes, got)

    def _pull_ended(self, hashes: list[bytes], got: list[bytes]) -> None:
        with self._lock:
            self._pulling.difference_update(hashes)
            if len(got) < len(hashes):  # the rest are not to be had: do not ask again for a while
                self._absent[hashes[len(got)]] = time.monotonic() + self.retry_s
                self._absent.move_to_end(hashes[len(got)])
                while len(self._absent) > self.max_absent:
                    self._absent.popitem(last=False)
            self._lock.notify_all()

    def _pull(self, url: str, hashes: list[bytes]) -> list[bytes]:
        """Fetch the leading blocks of `hashes` that the producer at `url` holds into the local folder;
        returns their hashes. A producer that cannot be reached, or does not answer within the deadline,
        is marked down for `retry_s`."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + self.timeout_s
        data = bytearray()
        try:
            with httpx.stream("POST", f"{url.rstrip('/')}/v1/kv_blocks", json={"hashes": [h.hex() for h in hashes]},
                              headers=headers, timeout=self.timeout_s) as r:
                if r.status_code != 200:
                    return []
                for chunk in r.iter_bytes():  # each read waits at most timeout_s; the whole answer too
                    data += chunk
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the answer took longer than timeout_s")
        except httpx.HTTPError as e:
            log.warning("KV transfer: producer %s failed (%s: %s); computing locally, asking it again in %.0f s",
                        url, type(e).__name__, e, self.retry_s)
            with self._lock:
                self._down[url] = time.monotonic() + self.retry_s
            return []
        return self._store(bytes(data), hashes)

    def _store(self, data: bytes, hashes: list[bytes]) -> list[bytes]:
        """Write the answer's block files (length-prefixed, in chain order, ending at the producer's first
        miss) into the local folder; checked against their checksums when loaded."""
        import struct

        pos, got = 0, []
        for h in hashes:
            if pos + 4 > len(data):
                break
            (n,) = struct.unpack_from("<I", data, pos)
            blob = data[pos + 4 : pos + 4 + n]
            if len(blob) != n:
                break
            path = block_path(self.path, h)
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.pull"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            got.append(h)
            pos += 4 + n
        with self._lock:
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
        timing = {k: float(extra[k]) for k in ("timeout_s", "retry_s") if k in extra}
        return TCPConnector(path, cfg.kv_role, producers=list(producers), api_key=extra.get("api_key"), **timing)
    return SharedStorageConnector(path, cfg.kv_role)

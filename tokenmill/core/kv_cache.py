"""Paged KV-cache block pool: reference-counted blocks, prefix hashes, LRU of free cached blocks. No torch.

A block holds `block_size` consecutive tokens of one sequence. A full block is named by
sha256(parent hash, its token ids, extra keys): equal names mean equal KV, so requests share it.
Free blocks wait in an LRU queue; a free block that still has a hash can be revived by a cache hit
until it is taken for new tokens (eviction).

Why sha256: a name collision would hand a request another prompt's KV, silently. Python's hash() is
64 bits and, for ints, trivially collidable; sha256 over a compact encoding (the parent's 32-byte
digest, the token ids as little-endian int64, then the extra keys) is collision-safe and costs about
a microsecond per block, far below the forward pass that computes the block.

With offloading (`offload`, see kv_offload.py), a named block that is evicted is saved to the host
tier first, and a prefix chain that leaves the device pool continues into the host and disk tiers:
those blocks are loaded into fresh device blocks instead of being recomputed.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.core.kv_events import KVEventLog
from tokenmill.core.kv_offload import LoadOp, OffloadTiers
from tokenmill.core.request import Request


# In a request's block table: a block released because it slid out of every layer's attention window
# (release_out_of_window). The workers keep the id they were sent there; no kernel reads it (the native paged
# kernels start at the window, the masked backends mask it).
RELEASED = -1


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """Name of a full block. `extra_keys` (ints, strings, bytes: e.g. an adapter name, an image hash)
    separate equal token ids whose KV differs. Token bytes have a fixed length per block, so the
    fields cannot run into each other."""
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found
    evictions: int = 0  # cached blocks reused for other content

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, offload: OffloadTiers | None = None,
        connector=None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        if offload is not None and not enable_prefix_caching:
            raise ValueError("KV offloading needs prefix caching: blocks are found again by their prefix hash.")
        self.offload = offload
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()
        self.events = KVEventLog()  # blocks named and dropped, for a cache-aware router
        self.connector = connector  # core/kv_connector.py: prefill/decode hand-over of named blocks
        # Blocks named this step whose KV the step's forward pass has not written yet. The engine confirms
        # them once the forward ran (`names_written`) or drops their names on every failure path
        # (`drop_unwritten_names`): a name in the cache always stands for KV that is there.
        self.unwritten: set[int] = set()
        self.num_released = 0  # blocks released out of the attention window (release_out_of_window), in total

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing -------------------------------------------------------------------------
    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes over the full blocks within its first `num_tokens` tokens."""
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], req.extra_keys))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest chain of cached blocks for req's tokens. At least the last token is always left to
        compute (its logits are needed), so a full hit never covers the final token."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        hit: list[int] = []
        # block_hashes may already name a block holding the last token (named when it was allocated).
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def get_offloaded_chain(self, req: Request, num_device_blocks: int) -> list[bytes]:
        """Hashes that continue req's device hit (`num_device_blocks` long) in the host/disk tiers, cut
        to the prefix whose load beats recomputing it. Like a device hit, never covers the last token."""
        if self.offload is None or not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        chain: list[bytes] = []
        tiers: list[str] = []
        for h in req.block_hashes[num_device_blocks : (req.num_tokens - 1) // self.block_size]:
            tier = None if h in self.cached else self.offload.tier_of(h)
            if tier is None:
                break
            chain.append(h)
            tiers.append(tier)
        return chain[: self.offload.blocks_worth_loading(tiers)] if chain else []

    def get_remote_chain(self, req: Request, num_local_blocks: int) -> list[bytes]:
        """Hashes that continue req's local hit (device + lower tiers, `num_local_blocks` long) in the KV
        connector's store (a prefill instance's blocks). Like a device hit, never covers the last token."""
        if self.connector is None or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req, req.num_tokens - 1)
        found = []
        for h in self.connector.lookup(req.block_hashes[num_local_blocks : (req.num_tokens - 1) // self.block_size]):
            if h in self.cached:
                break
            found.append(h)
        return found

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        offloaded: list[bytes] | None = None,
        num_lookahead_tokens: int = 0,
        remote: list[bytes] | None = None,
    ) -> bool:
        """Make req's block table cover num_computed(+cached) + num_new_tokens tokens. `computed_blocks`
        (device hits) are shared; `offloaded` hashes (from get_offloaded_chain) get fresh blocks that
        the transfer executor fills before the forward pass. `num_lookahead_tokens` more slots are
        reserved for speculative drafts. Returns False and changes nothing when the pool cannot supply
        the blocks."""
        computed_blocks = computed_blocks or []
        offloaded = offloaded or []
        remote = remote or []
        num_computed = req.num_computed_tokens + (len(computed_blocks) + len(offloaded) + len(remote)) * self.block_size
        need = (self.blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
                - len(req.block_ids) - len(computed_blocks))
        # Reviving a free cached block takes it out of the free queue too.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if need + revived > len(self.free_queue):
            return False
        for b in computed_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free_queue[b]
            block.ref_count += 1
        req.block_ids.extend(computed_blocks)
        req.num_computed_tokens = num_computed
        if offloaded:
            # Pinned first: the evictions below save blocks to the host tier and must not spill these.
            self.offload.pin(offloaded)
            for h in offloaded:
                block_id = self._take_free_block()
                # Named now, like blocks computed this step: its content lands before any attention reads it.
                self.blocks[block_id].hash = h
                self.cached[h] = block_id
                self.events.stored(h)
                self.offload.load(h, block_id)
                req.block_ids.append(block_id)
        for h in remote:  # a prefill instance's blocks: loaded by the connector before the forward pass
            block_id = self._take_free_block()
            self.blocks[block_id].hash = h
            self.cached[h] = block_id
            self.events.stored(h)
            self.connector.load(h, block_id)
            req.block_ids.append(block_id)
        for _ in range(max(need - len(offloaded) - len(remote), 0)):
            req.block_ids.append(self._take_free_block())
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, num_computed + num_new_tokens)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                self.events.removed(block.hash)
                if self.offload is not None:
                    self.offload.save(block_id, block.hash)  # runs before this step's forward overwrites it
            block.hash = None
            self.stats.evictions += 1
        block.ref_count = 1
        return block_id

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Name the blocks that will be full once this step has run. Their KV is written in the same
        forward pass, before any attention reads it, so a request admitted in this step may share them.
        Until the engine confirms the write (`names_written`) they are listed in `unwritten`."""
        num_tokens = min(num_tokens, req.num_tokens)
        self._update_hashes(req, num_tokens)
        for i in range(num_tokens // self.block_size):
            if req.block_ids[i] == RELEASED:
                continue  # slid out of the window: named when it was full, or left unnamed
            block = self.blocks[req.block_ids[i]]
            if block.hash is not None:
                continue
            h = req.block_hashes[i]
            if h in self.cached:
                continue  # same content already cached in another block; this copy stays private
            block.hash = h
            self.cached[h] = block.block_id
            self.unwritten.add(block.block_id)
            self.events.stored(h)
            if self.connector is not None:
                self.connector.export(block.block_id, h)

    def names_written(self, block_ids: list[int] | None = None) -> None:
        """The forward pass wrote these blocks (None: every block named this step)."""
        if block_ids is None:
            self.unwritten.clear()
        else:
            self.unwritten.difference_update(block_ids)

    def drop_unwritten_names(self) -> None:
        """A step failed before writing its blocks: forget the names given to them this step."""
        self._unname(set(self.unwritten))

    def free(self, req: Request) -> None:
        """Release req's blocks. Tail blocks go to the LRU first so they are evicted before the
        shared prefix they extend."""
        for block_id in reversed(req.block_ids):
            if block_id != RELEASED:
                self._unref(block_id)
        req.block_ids = []
        req.num_released_blocks = 0
        req.num_computed_tokens = 0

    def _unref(self, block_id: int) -> None:
        """One holder fewer; at none the block is free (named: revivable by a prefix hit until evicted)."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None and not self.enable_prefix_caching:
                self.cached.pop(block.hash, None)
                block.hash = None
            self.free_queue[block_id] = None

    def release_out_of_window(self, req: Request, window: int) -> int:
        """Release req's blocks that no later query reads: with every attention layer's window `window`, the
        next query (position num_computed_tokens) and all after it see keys from num_computed_tokens - window + 1
        on. The released entries become RELEASED; a named block stays in the prefix cache until evicted.
        Returns how many blocks were released."""
        first_read = req.num_computed_tokens - window + 1
        released = 0
        for i in range(req.num_released_blocks, max(first_read, 0) // self.block_size):
            self._unref(req.block_ids[i])
            req.block_ids[i] = RELEASED
            released += 1
        req.num_released_blocks += released
        self.num_released += released
        return released

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free req's tail blocks beyond those `num_tokens` tokens need: slots written by rejected
        speculative drafts. Such blocks hold no accepted token, so they were never named."""
        keep = self.blocks_needed(num_tokens)
        while len(req.block_ids) > keep:
            block = self.blocks[req.block_ids.pop()]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    def unrecord_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Take back a query whose hit turned out not to be one (a failed load): it is asked again."""
        self.stats.queries -= num_prompt_tokens
        self.stats.hits -= num_hit_tokens

    # ---- offloading ----------------------------------------------------------------------
    def take_transfer_ops(self) -> list:
        """This step's saves/spills/loads, in the order they must run (before the forward pass); the KV
        connector's imports last (their blocks are fresh, no tier op touches them)."""
        ops = self.offload.take_ops() if self.offload is not None else []
        if self.connector is not None:
            ops += self.connector.take_imports()
        return ops

    def take_export_ops(self) -> list:
        """Blocks this step computed that a KV producer hands over (run after the forward pass)."""
        return self.connector.take_exports() if self.connector is not None else []

    def loads_failed(self, ops: list[LoadOp]) -> set[int]:
        """These loads came back corrupt: forget the hashes everywhere. Returns the device blocks that
        hold no valid KV; every request holding one must be recomputed from there (see the scheduler)."""
        bad = set()
        for op in ops:
            block = self.blocks[op.block_id]
            if block.hash == op.hash:
                if self.cached.get(op.hash) == op.block_id:
                    del self.cached[op.hash]
                block.hash = None
            if self.offload is not None and isinstance(op, LoadOp):
                self.offload.load_failed(op.hash)
            elif self.connector is not None:
                self.connector.import_failed(op.hash)
            bad.add(op.block_id)
        return bad

    def unname_from(self, req: Request, index: int) -> None:
        """Drop the names of req's blocks from `index` on (content not written, or not trusted)."""
        self._unname(set(req.block_ids[index:]))

    def _unname(self, block_ids: set[int]) -> None:
        """These blocks hold no KV their names could stand for: forget the names, and hand none of them to
        decode instances."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                self.events.removed(block.hash)
            block.hash = None
        self.unwritten -= block_ids
        if self.connector is not None and block_ids:
            self.connector.unexport(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop all hashes of free blocks. Returns False if blocks are in use (their hashes stay)."""
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.cached.pop(block.hash, None) is not None:
                    self.events.removed(block.hash)
                block.hash = None
        if self.offload is not None:
            self.offload.clear()
        return len(self.free_queue) == self.num_blocks

    def check_invariants(self) -> None:
        """For tests: ref counts and the free queue agree."""
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), block
        for h, b in self.cached.items():
            assert self.blocks[b].hash == h
        if self.offload is not None:
            self.offload.check_invariants()

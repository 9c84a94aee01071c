"""Paged KV-cache block pool: reference-counted blocks, prefix hashes, LRU of free cached blocks. No torch.

A block holds `block_size` consecutive tokens of one sequence. A full block is named by
sha256(parent hash, its token ids, extra keys): equal names mean equal KV, so requests share it.
Free blocks wait in an LRU queue; a free block that still has a hash can be revived by a cache hit
until it is taken for new tokens (eviction). The names and the pool's records are kv_blocks.py (why sha256
there); the prefix lookups, device, lower tiers and connector, prefix_lookup.py.

KV cache groups (vLLM V1's hybrid manager). A model whose layers differ in attention window (Gemma 3: five
sliding-window layers per full one) has one group per window type (`group_windows`), each group the same
number of layers, and every group its own block table per request over one shared pool: block b is the K/V
of block_size tokens for G layers, and a group's layer i keeps it in the pool's i-th tensor (the model
runner shares those tensors between the groups). A windowed group releases a request's blocks once they
slide out of its window (`release_out_of_window`) while the full group keeps them, so a long request holds
its whole context in the full group and about a window in the others. A group's full blocks are named by
the same hash chain with the group mixed in; a prefix hit is as long as the full group's chain and the
windowed groups hold the blocks a window before its end (`get_computed_blocks`). One group with a window
(every layer the same window: Mistral) releases the same way.

With offloading (`offload`, see kv_offload.py), a named block that is evicted is saved to the host
tier first, and a prefix chain that leaves the device pool continues into the host and disk tiers:
those blocks are loaded into fresh device blocks instead of being recomputed.
"""
from __future__ import annotations

from collections import OrderedDict

from tokenmill.core.kv_blocks import (RELEASED, Block, PrefixCacheStats, PrefixHit, blocks_for_tokens, group_key,
                                      hash_block)  # noqa: F401  (hash_block re-exported: tests, router import it here)
from tokenmill.core.kv_events import KVEventLog
from tokenmill.core.kv_offload import LoadOp, OffloadTiers
from tokenmill.core.prefix_lookup import PrefixLookup
from tokenmill.core.request import Request


class KVCacheManager(PrefixLookup):
    """The block pool of one engine: its requests' block tables per KV cache group, the prefix cache over them,
    and the transfers to and from the lower tiers. Prefix lookups: prefix_lookup.PrefixLookup."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, offload: OffloadTiers | None = None,
        connector=None, group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        if connector is not None and any(w is not None for w in group_windows):
            raise ValueError("a KV connector hands over whole prefixes: blocks released out of a window cannot "
                             "follow; run with --disable-hybrid-kv-cache-manager.")
        # Each group's attention window (None: full attention), in the workers' group order (kv_groups.py).
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.has_windows = any(w is not None for w in self.group_windows)
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

    def capacity_tokens(self, chunk: int) -> int:
        """The longest sequence (in whole blocks) one request can hold in the whole pool, computed in chunks of
        at most `chunk` tokens (blocks_for_tokens). With only windowed groups nothing bounds it: a large number."""
        bs, lo, hi = self.block_size, 0, 2**31  # in blocks: blocks_for_tokens(lo * bs) fits, hi * bs does not
        if blocks_for_tokens(hi * bs, self.group_windows, bs, chunk) <= self.num_blocks:
            return hi * bs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if blocks_for_tokens(mid * bs, self.group_windows, bs, chunk) <= self.num_blocks:
                lo = mid
            else:
                hi = mid
        return lo * bs

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
        if len(req.tables) != self.num_groups:  # a request's first allocation: a table per group
            req.tables = [[] for _ in range(self.num_groups)]
            req.num_released = [0] * self.num_groups
        # (a windowed pool's device hit is a PrefixHit, with the other groups' entries; a plain one a list)
        hits = [computed_blocks, *(computed_blocks.others if isinstance(computed_blocks, PrefixHit) else ())]
        if len(hits) != self.num_groups:
            if computed_blocks:
                raise ValueError(f"a prefix hit for {len(hits)} KV cache group(s), this pool has {self.num_groups}")
            hits = [[] for _ in range(self.num_groups)]
        num_computed = req.num_computed_tokens + (len(computed_blocks) + len(offloaded) + len(remote)) * self.block_size
        total = self.blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
        # A windowed group holds nothing before its window's reach from the first uncomputed token: such hit
        # entries stay RELEASED, and the host tier's blocks there are not loaded.
        reach = [0 if w is None else max(num_computed - w + 1, 0) // self.block_size for w in self.group_windows]
        hits = [[RELEASED if i < reach[g] else b for i, b in enumerate(hit)] for g, hit in enumerate(hits)]
        # The lower tiers' chain, per group: RELEASED, a block still on the device (another group may have cut the
        # device hit short of it), or the key to load into a fresh block.
        loads = [[RELEASED if i < reach[g] else self.cached.get(group_key(g, h), group_key(g, h))
                  for i, h in enumerate(offloaded, len(computed_blocks))] for g in range(self.num_groups)]
        keys = [e for entries in loads for e in entries if isinstance(e, bytes)]
        need = [max(total - len(table) - len(hit) - len(offloaded) - (len(remote) if g == 0 else 0), 0)
                for g, (table, hit) in enumerate(zip(req.tables, hits))]
        # Reviving a free cached block takes it out of the free queue too.
        revived = sum(1 for entries in hits + loads for b in entries
                      if isinstance(b, int) and b != RELEASED and self.blocks[b].ref_count == 0)
        if sum(need) + len(keys) + len(remote) + revived > len(self.free_queue):
            return False
        if keys:  # pinned first: the evictions below save blocks to the host tier and must not spill these
            self.offload.pin(keys)
        for entries in hits + loads:  # every block still on the device first: a fresh block taken below may evict
            for b in entries:  # a free one
                if isinstance(b, int) and b != RELEASED:
                    block = self.blocks[b]
                    if block.ref_count == 0:
                        del self.free_queue[b]
                    block.ref_count += 1
        for g in range(self.num_groups):
            for b in hits[g] + loads[g]:
                if b == RELEASED:  # before the group's window: never read
                    req.num_released[g] += 1
                elif isinstance(b, bytes):  # a lower tier's: named now, like blocks computed this step (loaded
                    key, b = b, self._take_free_block()  # before any attention reads it)
                    self._name(b, key, g)
                    self.offload.load(key, b)
                req.tables[g].append(b)
        req.num_computed_tokens = num_computed
        for h in remote:  # a prefill instance's blocks: loaded by the connector before the forward pass
            block_id = self._take_free_block()
            self._name(block_id, h, 0)
            self.connector.load(h, block_id)
            req.block_ids.append(block_id)
        for g in range(self.num_groups):
            req.tables[g].extend(self._take_free_block() for _ in range(need[g]))
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, num_computed + num_new_tokens)
        return True

    def _name(self, block_id: int, key: bytes, group: int) -> None:
        block = self.blocks[block_id]
        block.hash, block.group = key, group
        self.cached[key] = block_id
        if group == 0:
            self.events.stored(key)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if block.group == 0:
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
        self.update_hashes(req, num_tokens)
        for g, table in enumerate(req.tables):
            for i in range(req.num_released[g], num_tokens // self.block_size):
                block = self.blocks[table[i]]  # (entries before num_released slid out of the window)
                if block.hash is not None:
                    continue
                h = group_key(g, req.block_hashes[i])
                if h in self.cached:
                    continue  # same content already cached in another block; this copy stays private
                block.hash, block.group = h, g
                self.cached[h] = block.block_id
                self.unwritten.add(block.block_id)
                if g == 0:
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
        for table, released in zip(req.tables, req.num_released):
            for block_id in reversed(table[released:]):
                self._unref(block_id)
        req.tables = [[] for _ in range(self.num_groups)]
        req.num_released = [0] * self.num_groups
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

    def release_out_of_window(self, req: Request) -> int:
        """Release req's blocks that no later query reads: in a group with window W the next query (position
        num_computed_tokens) and all after it see keys from num_computed_tokens - W + 1 on. The released entries
        become RELEASED; a named block stays in the prefix cache until evicted. Returns how many were released."""
        released = 0
        for g, window in enumerate(self.group_windows):
            if window is None or len(req.tables) <= g:
                continue
            table = req.tables[g]
            first_read = max(req.num_computed_tokens - window + 1, 0) // self.block_size
            for i in range(req.num_released[g], min(first_read, len(table))):
                self._unref(table[i])
                table[i] = RELEASED
                released += 1
            req.num_released[g] = max(req.num_released[g], min(first_read, len(table)))
        self.num_released += released
        return released

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free req's tail blocks beyond those `num_tokens` tokens need: slots written by rejected
        speculative drafts. Such blocks hold no accepted token, so they were never named."""
        keep = self.blocks_needed(num_tokens)
        for table in req.tables:
            while len(table) > keep:
                self._unref(table.pop())

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
        """Drop the names of req's blocks from `index` on, in every group (content not written, or not trusted)."""
        self._unname({b for table in req.tables for b in table[index:] if b != RELEASED})

    def _unname(self, block_ids: set[int]) -> None:
        """These blocks hold no KV their names could stand for: forget the names, and hand none of them to
        decode instances."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if block.group == 0:
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
                if self.cached.pop(block.hash, None) is not None and block.group == 0:
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

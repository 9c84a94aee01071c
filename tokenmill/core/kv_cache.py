"""Paged KV-cache block pool: reference-counted blocks, prefix hashes, LRU of free cached blocks. No torch.

A block holds `block_size` consecutive tokens of one sequence. A full block is named by
sha256(parent hash, its token ids, extra keys): equal names mean equal KV, so requests share it.
Free blocks wait in an LRU queue; a free block that still has a hash can be revived by a cache hit
until it is taken for new tokens (eviction).

Why sha256: a name collision would hand a request another prompt's KV, silently. Python's hash() is
64 bits and, for ints, trivially collidable; sha256 over a compact encoding (the parent's 32-byte
digest, the token ids as little-endian int64, then the extra keys) is collision-safe and costs about
a microsecond per block, far below the forward pass that computes the block.

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


def group_key(group: int, h: bytes) -> bytes:
    """The prefix cache's key for group `group`'s copy of the block named `h` (group 0's is the hash itself)."""
    return h if group == 0 else h + group.to_bytes(2, "little")


def blocks_for_tokens(num_tokens: int, group_windows: tuple[int | None, ...], block_size: int, chunk: int) -> int:
    """The most blocks one request of `num_tokens` tokens holds at once over all groups, computed in chunks of
    at most `chunk` tokens: its whole context in a full group; in a windowed one the window before its chunk
    and the chunk (keys num_computed - W + 1 .. num_computed + chunk - 1: at most ceil((W - 1 + chunk) / B) + 1
    blocks)."""
    n = -(-num_tokens // block_size)
    return sum(n if w is None else min(n, -(-(w - 1 + chunk) // block_size) + 1) for w in group_windows)


class PrefixHit(list):
    """A device prefix hit: the first group's blocks (the list itself) and, in `others`, every other group's
    table entries for the same tokens (RELEASED before the group's window reaches back)."""

    def __init__(self, blocks: list[int] = (), others: list[list[int]] = ()) -> None:
        super().__init__(blocks)
        self.others = list(others)


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
    hash: bytes | None = None  # its prefix-cache key (group_key), None: unnamed
    group: int = 0  # the KV cache group whose copy it holds while named


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

    # ---- hashing -------------------------------------------------------------------------
    def update_hashes(self, req: Request, num_tokens: int) -> None:
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
        self.update_hashes(req, req.num_tokens - 1)
        # block_hashes may already name a block holding the last token (named when it was allocated).
        hashes = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        if self.has_windows:
            return self._window_hit(hashes)
        hit: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def _window_hit(self, hashes: list[bytes]) -> PrefixHit:
        """The longest prefix every group can continue from: a full group needs all its blocks, a windowed one
        only those its window reaches back to from the first uncomputed token (the entries before are RELEASED)."""
        bs = self.block_size
        limit = len(hashes)
        for g, w in enumerate(self.group_windows):
            if w is None:  # a full group's hit is its chain
                limit = next((i for i, h in enumerate(hashes[:limit]) if group_key(g, h) not in self.cached), limit)
        groups = []  # (window, run of cached blocks ending at each index, blocks)
        for g, w in enumerate(self.group_windows):
            blocks = [self.cached.get(group_key(g, h)) for h in hashes[:limit]]
            run, r = [], 0
            for b in blocks:
                r = r + 1 if b is not None else 0
                run.append(r)
            groups.append((w, run, blocks))

        def first_read(w: int | None, m: int) -> int:
            return 0 if w is None else max(m * bs - w + 1, 0) // bs

        m = limit
        while m and not all(run[m - 1] >= m - first_read(w, m) for w, run, _ in groups):
            m -= 1
        tables = [[RELEASED] * first_read(w, m) + blocks[first_read(w, m) : m] for w, _, blocks in groups]
        return PrefixHit(tables[0], tables[1:])

    def get_offloaded_chain(self, req: Request, num_device_blocks: int) -> list[bytes]:
        """Hashes that continue req's device hit (`num_device_blocks` long) in the host/disk tiers, cut
        to the prefix whose load beats recomputing it. Like a device hit, never covers the last token."""
        if self.offload is None or not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        self.update_hashes(req, req.num_tokens - 1)
        if self.num_groups > 1:
            return self._group_offloaded_chain(req.block_hashes[: (req.num_tokens - 1) // self.block_size],
                                               num_device_blocks)
        chain: list[bytes] = []
        tiers: list[str] = []
        for h in req.block_hashes[num_device_blocks : (req.num_tokens - 1) // self.block_size]:
            tier = None if h in self.cached else self.offload.tier_of(h)
            if tier is None:
                break
            chain.append(h)
            tiers.append(tier)
        return chain[: self.offload.blocks_worth_loading(tiers)] if chain else []

    def _group_offloaded_chain(self, hashes: list[bytes], start: int) -> list[bytes]:
        """KV cache groups: the longest continuation of a device hit of `start` blocks for which every group has
        what it needs, on the device or in a lower tier (the full groups every block, a windowed one its window's
        end), cut to what is worth loading."""
        def tier(g: int, h: bytes) -> str | None:
            key = group_key(g, h)
            return "device" if key in self.cached else self.offload.tier_of(key)

        end = start
        while end < len(hashes) and all(tier(g, hashes[end]) for g, w in enumerate(self.group_windows) if w is None):
            end += 1
        bs = self.block_size
        for m in range(end, start, -1):
            needed = [tier(g, hashes[i]) for g, w in enumerate(self.group_windows)
                      for i in range(max(start, 0 if w is None else max(m * bs - w + 1, 0) // bs), m)]
            if None in needed:
                continue
            lower = [t for t in needed if t != "device"]
            if self.offload.blocks_worth_loading(lower) == len(lower):
                return hashes[start:m]
        return []

    def get_remote_chain(self, req: Request, num_local_blocks: int) -> list[bytes]:
        """Hashes that continue req's local hit (device + lower tiers, `num_local_blocks` long) in the KV
        connector's store (a prefill instance's blocks). Like a device hit, never covers the last token."""
        if self.connector is None or req.params.prompt_logprobs is not None:
            return []
        self.update_hashes(req, req.num_tokens - 1)
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
        if len(req.tables) != self.num_groups:  # a request's first allocation: a table per group
            req.tables = [[] for _ in range(self.num_groups)]
            req.num_released = [0] * self.num_groups
        hits = [computed_blocks, *getattr(computed_blocks, "others", ())]
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

"""The KV manager's prefix lookups: a request's block hashes, and how far its prompt is found on the device
(per KV cache group), in the host and disk tiers, and in a KV connector's store. Mixed into KVCacheManager.
No torch here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.kv_blocks import RELEASED, PrefixHit, group_key, hash_block
from tokenmill.core.request import Request

if TYPE_CHECKING:
    from tokenmill.core.kv_offload import OffloadTiers


class PrefixLookup:
    """Mixed into KVCacheManager; reads its prefix cache (`cached`: key -> block), groups and lower tiers."""

    block_size: int
    enable_prefix_caching: bool
    group_windows: tuple[int | None, ...]
    num_groups: int
    has_windows: bool
    cached: dict[bytes, int]
    offload: OffloadTiers | None
    connector: object | None  # core/kv_connector.py's KVConnector

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
        if not self.enable_prefix_caching or not req.reads_prefix_cache:
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
        if self.offload is None or not self.enable_prefix_caching or not req.reads_prefix_cache:
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
        if self.connector is None or not req.reads_prefix_cache:
            return []
        self.update_hashes(req, req.num_tokens - 1)
        found = []
        for h in self.connector.lookup(req.block_hashes[num_local_blocks : (req.num_tokens - 1) // self.block_size]):
            if h in self.cached:
                break
            found.append(h)
        return found

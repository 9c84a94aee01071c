"""Lower KV tiers (host memory, then disk): where each evicted block lives, LRU order, budgets. No torch.

The KVCacheManager calls `save(block, hash)` when it evicts a named block from the device pool and
`load(hash, block)` when a prompt's prefix chain continues into these tiers. Both only record ops;
the transfer executor (tokenmill/executor/kv_transfer.py) runs them, in order, before the next
forward pass. Running them in emission order is what makes the bookkeeping safe: a save of block b
precedes a load into b, a spill reads a host slot before a later save overwrites it. Hashes read by
ops not yet run are pinned, so no later op of the same step frees their slot or file.

Tiers are inclusive: loading a block back keeps its host/disk copy, so evicting it again is free.
Host slots that must be reused go to disk in groups of the `group_blocks` least recently used
(one file per group). A load is used only when the measured cost model says it beats recompute.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

HOST = "host"
DISK = "disk"


# ---- ops (executed by the transfer executor, in order) --------------------------------------
@dataclass(frozen=True)
class SaveOp:
    """Copy device block `block_id` into host slot `slot` (it holds `hash`)."""

    block_id: int
    slot: int
    hash: bytes


@dataclass(frozen=True)
class SpillOp:
    """Copy host `slots` (holding `hashes`) into one new disk file `file_id`, written in the background."""

    file_id: int
    slots: tuple[int, ...]
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class LoadOp:
    """Copy `hash` into device block `block_id`, from host slot `slot` or block `index` of file `file_id`."""

    block_id: int
    hash: bytes
    slot: int | None = None
    file_id: int | None = None
    index: int = 0

    @property
    def tier(self) -> str:
        return HOST if self.slot is not None else DISK


@dataclass(frozen=True)
class DeleteFileOp:
    file_id: int


TransferOp = SaveOp | SpillOp | LoadOp | DeleteFileOp


# ---- when a load pays ----------------------------------------------------------------------
@dataclass
class TransferCosts:
    """Seconds, measured at start-up: marginal forward time per block of tokens, and the fixed and
    per-block time of loading from each tier."""

    recompute_per_block: float
    host_fixed: float = 0.0
    host_per_block: float = float("inf")
    disk_fixed: float = 0.0
    disk_per_block: float = float("inf")

    def _load_cost(self, tier: str) -> tuple[float, float]:
        return (self.host_fixed, self.host_per_block) if tier == HOST else (self.disk_fixed, self.disk_per_block)

    def break_even(self, tier: str, cap: int = 1 << 16) -> int | None:
        """Fewest blocks from `tier` whose load beats recomputing them; None if it never does."""
        fixed, per = self._load_cost(tier)
        gain = self.recompute_per_block - per
        if gain <= 0:
            return None
        k = int(max(fixed, 0.0) // gain) + 1  # smallest k with fixed < k * gain
        return k if k <= cap else None

    def blocks_worth_loading(self, tiers: list[str]) -> int:
        """The prefix of a lower-tier chain (tier per block) whose load saves the most time; 0 if none."""
        best, best_gain, gain = 0, 0.0, 0.0
        fixed_paid: set[str] = set()
        for j, tier in enumerate(tiers, 1):
            fixed, per = self._load_cost(tier)
            gain += self.recompute_per_block - per
            if tier not in fixed_paid:
                fixed_paid.add(tier)
                gain -= fixed
            if gain > best_gain:
                best, best_gain = j, gain
        return best


@dataclass
class OffloadStats:
    saves: int = 0  # blocks copied device -> host
    spills: int = 0  # blocks written host -> disk
    files_written: int = 0
    host_loads: int = 0  # blocks loaded back from host
    disk_loads: int = 0  # blocks loaded back from disk
    load_failures: int = 0  # disk blocks that failed their checksum, were truncated or missing: recomputed
    dropped: int = 0  # evicted blocks not saved (host full of blocks pinned by this step's loads)
    host_evictions: int = 0  # host blocks dropped without a disk copy
    disk_evictions: int = 0  # disk blocks dropped over the disk budget


@dataclass
class DiskFile:
    hashes: tuple[bytes, ...]
    live: int  # entries still indexed (the rest were dropped)


@dataclass
class OffloadTiers:
    host_slots: int
    disk: bool = False
    group_blocks: int = 8
    disk_budget_blocks: int | None = None  # None: unbounded
    min_chain_blocks: int | None = None  # fixed break-even (tests, operators); None: use `costs`
    costs: TransferCosts | None = None
    host: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # hash -> slot, least recent first
    disk_index: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # hash -> (file, index)
    files: OrderedDict[int, DiskFile] = field(default_factory=OrderedDict)  # least recent first
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self) -> None:
        if self.host_slots < 1:
            raise ValueError("the host tier needs at least one slot (it also stages blocks for the disk tier).")
        if self.group_blocks < 1:
            raise ValueError(f"group_blocks must be at least 1, got {self.group_blocks}.")
        self.free_slots: list[int] = list(range(self.host_slots - 1, -1, -1))
        self.pinned: set[bytes] = set()
        self.ops: list[TransferOp] = []
        self._file_ids = itertools.count()
        self.disk_blocks = 0  # blocks in files on disk, live or not, until the file is deleted

    # ---- policy ------------------------------------------------------------------------
    @property
    def break_even_blocks(self) -> dict[str, int | None]:
        """Shortest chain from each tier worth loading instead of recomputing (None: never)."""
        if self.min_chain_blocks is not None:
            return {HOST: self.min_chain_blocks, DISK: self.min_chain_blocks if self.disk else None}
        if self.costs is None:
            return {HOST: 1, DISK: 1 if self.disk else None}
        return {HOST: self.costs.break_even(HOST), DISK: self.costs.break_even(DISK) if self.disk else None}

    @property
    def use_host(self) -> bool:
        return self.break_even_blocks[HOST] is not None

    @property
    def use_disk(self) -> bool:
        return self.break_even_blocks[DISK] is not None

    def blocks_worth_loading(self, tiers: list[str]) -> int:
        if self.min_chain_blocks is not None:
            return len(tiers) if len(tiers) >= self.min_chain_blocks else 0
        if self.costs is None:
            return len(tiers)
        return self.costs.blocks_worth_loading(tiers)

    # ---- lookups -------------------------------------------------------------------------
    def tier_of(self, h: bytes) -> str | None:
        if h in self.host:
            return HOST
        if h in self.disk_index:
            return DISK
        return None

    def __contains__(self, h: bytes) -> bool:
        return h in self.host or h in self.disk_index

    # ---- ops -----------------------------------------------------------------------------
    def save(self, block_id: int, h: bytes) -> None:
        """Device block `block_id` holding `h` is about to be reused: keep a host copy."""
        if not (self.use_host or self.use_disk):
            return
        if h in self.host:
            self.host.move_to_end(h)
            return
        slot = self._take_slot()
        if slot is None:
            self.stats.dropped += 1
            return
        self.host[h] = slot
        self.ops.append(SaveOp(block_id, slot, h))
        self.stats.saves += 1

    def pin(self, hashes: list[bytes]) -> None:
        """Keep these where they are until the queued ops have run (they are about to be loaded)."""
        for h in hashes:
            self.pinned.add(h)
            if h in self.host:
                self.host.move_to_end(h)
            elif h in self.disk_index:
                self.files.move_to_end(self.disk_index[h][0])

    def load(self, h: bytes, block_id: int) -> LoadOp:
        self.pin([h])
        if h in self.host:
            op = LoadOp(block_id, h, slot=self.host[h])
            self.stats.host_loads += 1
        else:
            file_id, index = self.disk_index[h]
            op = LoadOp(block_id, h, file_id=file_id, index=index)
            self.stats.disk_loads += 1
        self.ops.append(op)
        return op

    def take_ops(self) -> list[TransferOp]:
        ops, self.ops = self.ops, []
        self.pinned.clear()
        return ops

    def load_failed(self, h: bytes) -> None:
        """A load of `h` came back corrupt or short: forget every copy, so it is recomputed."""
        self.stats.load_failures += 1
        self.forget(h)

    def forget(self, h: bytes) -> None:
        slot = self.host.pop(h, None)
        if slot is not None:
            self.free_slots.append(slot)
        loc = self.disk_index.pop(h, None)
        if loc is not None:
            f = self.files[loc[0]]
            f.live -= 1
            if f.live == 0:
                self._delete_file(loc[0])

    def clear(self) -> None:
        for h in list(self.host):
            self.forget(h)
        for file_id in list(self.files):
            self._delete_file(file_id, count=False)

    # ---- internals -----------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if not self.free_slots:
            self._evict_host_group()
        return self.free_slots.pop() if self.free_slots else None

    def _evict_host_group(self) -> None:
        victims = list(itertools.islice((h for h in self.host if h not in self.pinned), self.group_blocks))
        if not victims:
            return
        spill = [h for h in victims if h not in self.disk_index] if self.use_disk else []
        if spill:
            file_id = next(self._file_ids)
            self.ops.append(SpillOp(file_id, tuple(self.host[h] for h in spill), tuple(spill)))
            self.files[file_id] = DiskFile(tuple(spill), len(spill))
            for i, h in enumerate(spill):
                self.disk_index[h] = (file_id, i)
            self.disk_blocks += len(spill)
            self.stats.spills += len(spill)
            self.stats.files_written += 1
            self._enforce_disk_budget(keep=file_id)
        else:
            self.stats.host_evictions += sum(1 for h in victims if h not in self.disk_index)
        for h in victims:
            self.free_slots.append(self.host.pop(h))

    def _enforce_disk_budget(self, keep: int) -> None:
        if self.disk_budget_blocks is None:
            return
        for file_id in list(self.files):
            if self.disk_blocks <= self.disk_budget_blocks:
                break
            f = self.files[file_id]
            if file_id == keep or any(h in self.pinned for h in f.hashes if self.disk_index.get(h, (None,))[0] == file_id):
                continue
            self._delete_file(file_id)

    def _delete_file(self, file_id: int, count: bool = True) -> None:
        f = self.files.pop(file_id)
        for h in f.hashes:
            if self.disk_index.get(h, (None,))[0] == file_id:
                del self.disk_index[h]
                if count:
                    self.stats.disk_evictions += 1
        self.disk_blocks -= len(f.hashes)
        self.ops.append(DeleteFileOp(file_id))

    def check_invariants(self) -> None:
        """For tests: slots and files agree."""
        used = list(self.host.values())
        assert len(used) == len(set(used)), "host slot used twice"
        assert sorted(used + self.free_slots) == list(range(self.host_slots)), "host slots lost"
        assert self.disk or not self.files
        for h, (file_id, i) in self.disk_index.items():
            assert self.files[file_id].hashes[i] == h
        for file_id, f in self.files.items():
            assert f.live == sum(1 for i, h in enumerate(f.hashes) if self.disk_index.get(h) == (file_id, i)) > 0
        assert self.disk_blocks == sum(len(f.hashes) for f in self.files.values())

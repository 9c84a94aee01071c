"""The KV pool's vocabulary: block names (prefix hashes), the RELEASED table entry, how many blocks a request
holds, and the block and hit-rate records. No torch here.

Why sha256: a name collision would hand a request another prompt's KV, silently. Python's hash() is
64 bits and, for ints, trivially collidable; sha256 over a compact encoding (the parent's 32-byte
digest, the token ids as little-endian int64, then the extra keys) is collision-safe and costs about
a microsecond per block, far below the forward pass that computes the block.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

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

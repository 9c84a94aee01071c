"""What each backend's prefix cache holds, mirrored from its GET /v1/kv_events, so the router can ask
"how many leading blocks of this prompt does backend B already have?" without asking B.

The mirror is eventually consistent (polled about every 100 ms): a wrong guess costs only a cache miss.
Backends without the endpoint (not tokenmill) simply have no entry and never match."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import httpx

from tokenmill.core.kv_cache import hash_block

log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16


def prompt_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """hash_block's chain over the prompt's full blocks, as the backends name them (a salted request's blocks
    with its salt mixed in, as core/request.EngineCoreRequest.cache_keys does for the base model)."""
    hashes: list[bytes] = []
    parent = None
    extra = (("salt", cache_salt),) if cache_salt else ()
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, list(token_ids[i * block_size:(i + 1) * block_size]), extra)
        hashes.append(parent)
    return hashes


@dataclass
class BackendCache:
    blocks: set[bytes] = field(default_factory=set)
    last_seq: int = 0
    block_size: int | None = None
    supported: bool = True  # False once the backend answered 404: stop asking


class CacheIndex:
    def __init__(self, backends: Iterable[str], headers: dict[str, str] | None = None) -> None:
        self.caches = {b: BackendCache() for b in backends}
        self.headers = headers or {}  # the router's backend key: /v1/kv_events is for internal callers

    def apply(self, backend: str, payload: dict) -> None:
        """Fold one /v1/kv_events answer in: `reset` replaces the set, events add and remove."""
        c = self.caches[backend]
        if payload.get("block_size"):
            c.block_size = int(payload["block_size"])
        if payload.get("reset"):
            c.blocks = {bytes.fromhex(h) for h in payload.get("stored", [])}
        for _, kind, h in payload.get("events", []):
            if kind == "stored":
                c.blocks.add(bytes.fromhex(h))
            elif kind == "removed":
                c.blocks.discard(bytes.fromhex(h))
        c.last_seq = int(payload.get("last_seq", c.last_seq))

    def forget(self, backend: str) -> None:
        """A backend that went away may come back restarted: its old blocks are no longer trusted."""
        self.caches[backend] = BackendCache()

    @property
    def block_size(self) -> int:
        """The backends' block size (the first one reported), or the default."""
        return next((c.block_size for c in self.caches.values() if c.block_size), DEFAULT_BLOCK_SIZE)

    def matched(self, backend: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` that `backend` caches."""
        blocks = self.caches[backend].blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    async def poll_once(self, client: httpx.AsyncClient, backend: str) -> None:
        c = self.caches[backend]
        if not c.supported:
            return
        try:
            r = await client.get(f"{backend}/v1/kv_events", params={"since": c.last_seq}, headers=self.headers,
                                 timeout=2.0)
        except httpx.HTTPError:
            return
        if r.status_code in (404, 405):
            c.supported = False
            return
        if r.status_code == 200:
            self.apply(backend, r.json())

    async def poll_forever(self, client: httpx.AsyncClient, interval_s: float = 0.1) -> None:
        """One loop per backend, so a slow one does not delay the others."""
        async def loop(backend: str) -> None:
            while True:
                try:
                    await self.poll_once(client, backend)
                except Exception:  # a malformed answer: keep the old view, try again
                    log.exception("kv_events from %s", backend)
                await asyncio.sleep(interval_s)

        await asyncio.gather(*(loop(b) for b in list(self.caches)))

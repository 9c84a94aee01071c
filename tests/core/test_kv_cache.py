"""Tests for the paged KV-cache block pool (tokenmill/engine/kv_cache.py). Pure Python, no torch.

Unit tests pin the documented behaviour (allocation, prefix hits, LRU eviction, stats); a hypothesis
state machine drives random add / step / preempt / abort sequences and checks, after every operation,
the ref counts, the free pool and - through a shadow "KV content" model - that a prefix hit never
hands a request a block whose content belongs to other tokens. With offloading on, the same machine
runs the host/disk tier ops on shadow contents (tests/kv_shadow.py), corrupts disk files, and checks
that every host slot and disk block holds what its hash names and that loads only ever fill a block
with the request's own tokens' KV.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kv_shadow import ShadowTransfer
from tokenmill.core.kv_cache import RELEASED, KVCacheManager, blocks_for_tokens, group_key, hash_block
from tokenmill.core.kv_offload import OffloadTiers
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_req(tokens, params: SamplingParams | None = None, rid: str | None = None) -> Request:
    return Request(rid or f"r{next(_ids)}", list(tokens), params or SamplingParams(), max_tokens=16)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """Prefix lookup + allocation for the whole prompt, then mark it computed (the forward ran)."""
    hit = kv.get_computed_blocks(req)
    n = req.num_tokens - len(hit) * kv.block_size
    assert kv.allocate_slots(req, n, hit)
    req.num_computed_tokens += n
    return hit


def refcounts(kv: KVCacheManager) -> list[int]:
    return [b.ref_count for b in kv.blocks]


def snapshot(kv: KVCacheManager, *reqs: Request):
    off = kv.offload
    tiers = None if off is None else (dict(off.host), dict(off.disk_index), list(off.ops), set(off.pinned), repr(off.stats))
    return (
        tiers,
        refcounts(kv),
        [b.hash for b in kv.blocks],
        list(kv.free_queue),
        dict(kv.cached),
        [(list(r.block_ids), r.num_computed_tokens) for r in reqs],
        (kv.stats.queries, kv.stats.hits, kv.stats.evictions),
    )


def chain_hashes(tokens, bs):
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, list(tokens[i * bs : (i + 1) * bs]))
        out.append(parent)
    return out


# ---- allocation ----------------------------------------------------------------------------


def test_allocate_free_round_trip():
    kv = KVCacheManager(8, BS)
    req = make_req(range(10))
    assert kv.allocate_slots(req, 10)
    assert len(req.block_ids) == 3 == len(set(req.block_ids))
    assert req.block_ids == [0, 1, 2]  # taken in pool order
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    assert [kv.blocks[b].ref_count for b in req.block_ids] == [1, 1, 1]
    # The caller advances num_computed_tokens; allocation alone does not.
    assert req.num_computed_tokens == 0
    req.num_computed_tokens = 10
    # Growing into the partial last block needs no new block; crossing the boundary needs one.
    assert kv.allocate_slots(req, 2) and len(req.block_ids) == 3
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) and len(req.block_ids) == 4
    req.num_computed_tokens = 13
    kv.check_invariants()
    kv.free(req)
    assert req.block_ids == [] and req.num_computed_tokens == 0
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    assert refcounts(kv) == [0] * 8
    kv.check_invariants()


def test_blocks_needed():
    kv = KVCacheManager(4, BS)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        KVCacheManager(0, BS)


def test_allocate_slots_short_pool_changes_nothing():
    kv = KVCacheManager(4, BS)
    a = make_req(range(8))
    assert kv.allocate_slots(a, 8)  # 2 blocks
    a.num_computed_tokens = 8
    b = make_req(range(100, 113))  # 13 tokens: 4 blocks, only 2 free
    before = snapshot(kv, a, b)
    assert not kv.allocate_slots(b, 13)
    assert snapshot(kv, a, b) == before
    # Exactly enough succeeds.
    c = make_req(range(200, 208))
    assert kv.allocate_slots(c, 8) and kv.num_free_blocks == 0
    assert not kv.allocate_slots(a, 1)  # a's 9th token needs a third block
    assert a.block_ids == [0, 1] and a.num_computed_tokens == 8
    kv.check_invariants()


def test_short_pool_with_free_cached_hit_revives_nothing():
    """Reviving free cached blocks also takes them out of the pool: a failing allocation must not revive."""
    kv = KVCacheManager(3, BS)
    a = make_req(range(9))
    admit(kv, a)  # blocks 0, 1 full (hashed), 2 partial
    kv.free(a)
    b = make_req(list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens: hits 2 free blocks, needs 2 more
    hit = kv.get_computed_blocks(b)
    assert hit == [0, 1]
    before = snapshot(kv, b)
    assert not kv.allocate_slots(b, 13 - 8, hit)
    assert snapshot(kv, b) == before
    assert refcounts(kv) == [0, 0, 0] and kv.num_free_blocks == 3
    kv.check_invariants()


# ---- prefix hits ---------------------------------------------------------------------------


def test_prefix_hit_shares_full_blocks_and_ref_counts():
    kv = KVCacheManager(10, BS)
    a = make_req(list(range(12)) + [7])  # 3 full blocks + 1 token
    assert admit(kv, a) == []
    b = make_req(list(range(8)) + [90, 91, 92])  # same first 2 blocks, then differs
    hit = kv.get_computed_blocks(b)
    assert hit == a.block_ids[:2]
    assert kv.allocate_slots(b, b.num_tokens - 8, hit)
    assert b.num_computed_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] not in a.block_ids
    assert [kv.blocks[x].ref_count for x in a.block_ids] == [2, 2, 1, 1]
    assert kv.num_free_blocks == 10 - 5
    kv.check_invariants()
    kv.free(a)
    assert [kv.blocks[x].ref_count for x in b.block_ids] == [1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 10 and refcounts(kv) == [0] * 10
    kv.check_invariants()


def test_hit_never_covers_last_token():
    kv = KVCacheManager(10, BS)
    a = make_req(range(8))  # exactly 2 full blocks
    admit(kv, a)
    assert kv.get_computed_blocks(make_req(range(8))) == a.block_ids[:1]  # only 1 block
    assert kv.get_computed_blocks(make_req(range(9))) == a.block_ids[:2]  # one more token: both
    assert kv.get_computed_blocks(make_req(range(4))) == []  # a single full block: no hit at all
    assert kv.get_computed_blocks(make_req(range(5))) == a.block_ids[:1]


def test_hit_never_covers_last_token_after_readmission():
    """A request whose hashes were extended over all its tokens (allocation for every token, then
    preempted before appending a new one) must still leave its last token to compute on re-admission."""
    kv = KVCacheManager(10, BS)
    a = make_req(range(8))
    admit(kv, a)
    assert len(a.block_hashes) == 2  # allocation named both full blocks
    kv.free(a)
    hit = kv.get_computed_blocks(a)
    assert hit == [0]
    assert len(hit) * BS < a.num_tokens
    assert kv.allocate_slots(a, a.num_tokens - len(hit) * BS, hit)
    assert a.num_computed_tokens == 4
    kv.check_invariants()


def test_prompt_logprobs_bypass_cache():
    kv = KVCacheManager(10, BS)
    a = make_req(range(13))
    admit(kv, a)
    b = make_req(range(13), SamplingParams(prompt_logprobs=1))
    assert kv.get_computed_blocks(b) == []
    assert kv.get_computed_blocks(make_req(range(13), SamplingParams(prompt_logprobs=0))) == []
    assert kv.get_computed_blocks(make_req(range(13))) == a.block_ids[:3]


def test_prefix_caching_disabled_never_shares():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    a = make_req(range(13))
    assert admit(kv, a) == []
    b = make_req(range(13))
    assert admit(kv, b) == []
    assert not set(a.block_ids) & set(b.block_ids)
    assert kv.cached == {} and all(blk.hash is None for blk in kv.blocks)
    kv.free(a)
    c = make_req(range(13))
    assert kv.get_computed_blocks(c) == []
    assert kv.cached == {}
    kv.check_invariants()


def test_same_block_tokens_under_different_prefix_do_not_hit():
    kv = KVCacheManager(12, BS)
    a = make_req([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 9])
    admit(kv, a)
    # Second and third blocks equal a's, the first differs: nothing may hit.
    b = make_req([5, 5, 5, 5, 2, 2, 2, 2, 3, 3, 3, 3, 9])
    assert kv.get_computed_blocks(b) == []
    # a's second block tokens at the start of a sequence (no parent) must not hit either.
    c = make_req([2, 2, 2, 2, 3, 3, 3, 3, 9])
    assert kv.get_computed_blocks(c) == []
    admit(kv, b)
    assert not set(a.block_ids) & set(b.block_ids)
    # Both names are cached, in distinct blocks.
    assert a.block_hashes[1] != b.block_hashes[1]
    assert kv.cached[a.block_hashes[1]] == a.block_ids[1]
    assert kv.cached[b.block_hashes[1]] == b.block_ids[1]
    # Block hashes are the documented sha256 chain.
    assert a.block_hashes == chain_hashes(a.token_ids, BS)
    kv.check_invariants()


def test_duplicate_content_without_lookup_stays_private():
    """Two requests that computed the same prefix without a lookup: the second copy is not named."""
    kv = KVCacheManager(10, BS)
    a, b = make_req(range(9)), make_req(range(9))
    assert kv.allocate_slots(a, 9) and kv.allocate_slots(b, 9)
    assert [kv.blocks[x].hash is not None for x in a.block_ids] == [True, True, False]
    assert [kv.blocks[x].hash for x in b.block_ids] == [None, None, None]
    kv.check_invariants()


# ---- LRU eviction --------------------------------------------------------------------------


def test_lru_eviction_order_and_tail_first():
    kv = KVCacheManager(6, BS)
    a = make_req([1] * 9)  # blocks 0, 1 (hashed), 2 (partial)
    b = make_req([2] * 9)  # blocks 3, 4 (hashed), 5 (partial)
    admit(kv, a)
    admit(kv, b)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5])
    kv.free(a)  # tail first: 2, 1, 0
    kv.free(b)  # then 5, 4, 3
    assert list(kv.free_queue) == [2, 1, 0, 5, 4, 3]
    assert len(kv.cached) == 4
    taken = []
    for i in range(6):
        r = make_req([100 + i] * 3)  # fresh content: one block each, no hit
        assert kv.get_computed_blocks(r) == []
        assert kv.allocate_slots(r, 3)
        taken += r.block_ids
    assert taken == [2, 1, 0, 5, 4, 3]
    assert kv.stats.evictions == 4  # the partial blocks 2 and 5 held no name
    assert kv.cached == {}


def test_eviction_removes_hash_so_lookup_misses():
    kv = KVCacheManager(4, BS)
    a = make_req([1] * 4 + [2] * 4 + [3])  # 0, 1 hashed, 2 partial
    admit(kv, a)
    kv.free(a)  # queue: 3, 2, 1, 0
    probe = [1] * 4 + [2] * 4 + [7]
    assert kv.get_computed_blocks(make_req(probe)) == [0, 1]
    # Two new single-block requests take block 3 (never used) then 2 (a's partial tail): no eviction.
    for t in (8, 9):
        r = make_req([t] * 2)
        assert kv.allocate_slots(r, 2)
    assert kv.stats.evictions == 0
    r = make_req([10] * 2)
    assert kv.allocate_slots(r, 2) and r.block_ids == [1]  # a's second (tail) full block goes first
    assert kv.stats.evictions == 1
    assert a.block_hashes[1] not in kv.cached and kv.blocks[1].hash is None
    assert kv.get_computed_blocks(make_req(probe)) == [0]  # the prefix block survives
    r = make_req([11] * 2)
    assert kv.allocate_slots(r, 2) and r.block_ids == [0]
    assert kv.stats.evictions == 2
    assert kv.get_computed_blocks(make_req(probe)) == []
    assert kv.cached == {}
    kv.check_invariants()


def test_revived_block_moves_to_back_of_lru():
    kv = KVCacheManager(4, BS)
    a = make_req([1] * 4 + [2])  # block 0 hashed, 1 partial
    admit(kv, a)
    kv.free(a)  # queue: 2, 3, 1, 0
    assert list(kv.free_queue) == [2, 3, 1, 0]
    b = make_req([1] * 4 + [5])
    hit = admit(kv, b)  # revives block 0, takes block 2 for its tail
    assert hit == [0] and b.block_ids == [0, 2]
    assert list(kv.free_queue) == [3, 1]
    kv.free(b)
    assert list(kv.free_queue) == [3, 1, 2, 0]
    assert kv.stats.evictions == 0
    kv.check_invariants()


def test_cached_blocks_revived_from_free_pool_count_against_it():
    kv = KVCacheManager(3, BS)
    a = make_req([1] * 8 + [2])  # 3 blocks, 2 hashed
    admit(kv, a)
    kv.free(a)
    b = make_req([1] * 8 + [3])  # hits 2 free cached blocks, needs 1 more: exactly the pool
    hit = kv.get_computed_blocks(b)
    assert hit == [0, 1]
    assert kv.allocate_slots(b, 1, hit)
    assert b.block_ids == [0, 1, 2] and kv.num_free_blocks == 0
    assert refcounts(kv) == [1, 1, 1]
    kv.check_invariants()


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS)
    a = make_req(range(9))
    admit(kv, a)
    b = make_req(range(100, 109))
    admit(kv, b)
    a_blocks = list(a.block_ids)
    kv.free(a)
    # b still holds blocks: returns False, but the free blocks lose their names.
    assert kv.reset_prefix_cache() is False
    assert all(kv.blocks[x].hash is None for x in a_blocks)
    assert all(kv.blocks[x].hash is not None for x in b.block_ids[:2])
    assert kv.get_computed_blocks(make_req(range(9))) == []
    assert kv.get_computed_blocks(make_req(range(100, 109))) == b.block_ids[:2]  # in use: kept
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert kv.cached == {} and all(blk.hash is None for blk in kv.blocks)
    assert kv.get_computed_blocks(make_req(range(100, 109))) == []
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_stats():
    kv = KVCacheManager(8, BS)
    assert kv.stats.hit_rate == 0.0
    kv.record_query(10, 0)
    kv.record_query(10, 8)
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    assert kv.stats.hit_rate == pytest.approx(0.4)
    a = make_req([3] * 8)
    admit(kv, a)
    kv.free(a)
    for t in range(8):  # cycles through the pool: both named blocks get evicted exactly once
        r = make_req([10 + t])
        assert kv.allocate_slots(r, 1)
        kv.free(r)
    assert kv.stats.evictions == 2


def test_double_free_raises():
    kv = KVCacheManager(4, BS)
    a = make_req(range(6))
    assert kv.allocate_slots(a, 6)
    table = list(a.block_ids)
    kv.free(a)
    kv.free(a)  # the table was cleared: freeing the same request again is a no-op
    assert kv.num_free_blocks == 4
    stale = make_req(range(6))
    stale.block_ids = table  # a stale copy of a freed table
    with pytest.raises(RuntimeError, match="double free"):
        kv.free(stale)
    # Two requests that (wrongly) alias one block: the second release raises.
    b = make_req(range(3))
    assert kv.allocate_slots(b, 3)
    alias = make_req(range(3))
    alias.block_ids = list(b.block_ids)
    kv.free(b)
    with pytest.raises(RuntimeError):
        kv.free(alias)


# ---- property test -------------------------------------------------------------------------

# Prompts are built from a few shared stems over a 3-letter alphabet so prefixes collide often.
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 0]]
prompts = st.builds(
    lambda stem, cut, tail: (stem[:cut] + tail) or [0],
    st.sampled_from(STEMS),
    st.integers(0, 8),
    st.lists(st.integers(0, 2), max_size=7),
)


def prefix_keys(tokens) -> list[int]:
    """Shadow 'KV content' of each position: a name for the whole prefix ending there."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class KVMachine(RuleBasedStateMachine):
    """Requests are 'live' (hold blocks) or 'waiting' (preempted / not admitted: hold nothing).
    A live request's computed tokens all have their KV written into its blocks (the shadow
    `content`); every check reads them back through the block table."""

    @initialize(
        num_blocks=st.integers(3, 16),
        block_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, True, False]),  # mostly on
        offload=st.one_of(
            st.none(),
            st.fixed_dictionaries(dict(
                host_slots=st.integers(1, 5),
                disk=st.booleans(),
                group_blocks=st.integers(1, 3),
                disk_budget_blocks=st.sampled_from([None, None, 2, 5]),
                min_chain_blocks=st.sampled_from([1, 1, 2]),
            )),
        ),
    )
    def setup(self, num_blocks, block_size, caching, offload):
        tiers = OffloadTiers(**offload) if offload and caching else None
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, offload=tiers)
        self.transfer = ShadowTransfer()
        self.seen: list[Request] = []  # every request, for the hash -> token chain map
        self.live: list[Request] = []
        self.waiting: list[Request] = []
        self.content: dict[int, dict[int, int]] = {}  # block id -> slot -> prefix key written there
        self.shadow: dict[int, tuple[bytes, tuple]] = {}  # block id -> (hash, token chain it names)
        self.tok = 0

    # -- helpers --
    def _write(self, req: Request, start: int, stop: int) -> None:
        keys = prefix_keys(req.token_ids[:stop])
        bs = self.kv.block_size
        for p in range(start, stop):
            self.content.setdefault(req.block_ids[p // bs], {})[p % bs] = keys[p]

    def _run_ops(self):
        return self.transfer.run(self.kv.take_transfer_ops(), self.content)

    def _try_admit(self, req: Request, chunk: int) -> bool:
        kv = self.kv
        assert req.block_ids == [] and req.num_computed_tokens == 0
        if req not in self.seen:
            self.seen.append(req)
        hit = kv.get_computed_blocks(req)
        loads = kv.get_offloaded_chain(req, len(hit))
        assert (len(hit) + len(loads)) * kv.block_size < req.num_tokens, "a hit must leave the last token to compute"
        assert len(hit) == len(set(hit))
        if not kv.enable_prefix_caching or req.params.prompt_logprobs is not None or kv.offload is None:
            assert loads == []
        if not kv.enable_prefix_caching or req.params.prompt_logprobs is not None:
            assert hit == []
        # The offloaded chain continues the device hit, block by block, and is not on the device.
        assert loads == req.block_hashes[len(hit) : len(hit) + len(loads)]
        for h in loads:
            assert h in kv.offload and h not in kv.cached
        # Every hit block already holds the KV of exactly this request's tokens.
        keys = prefix_keys(req.token_ids)
        for i, b in enumerate(hit):
            for s in range(kv.block_size):
                assert self.content.get(b, {}).get(s) == keys[i * kv.block_size + s], "wrong block hit"
        cached = (len(hit) + len(loads)) * kv.block_size
        n = min(req.num_tokens - cached, chunk)
        before = snapshot(kv, req, *self.live)
        if not kv.allocate_slots(req, n, hit, loads):
            assert snapshot(kv, req, *self.live) == before
            return False
        assert req.num_computed_tokens == cached
        assert req.block_ids[: len(hit)] == hit
        failed = self._run_ops()
        if failed:
            # A corrupt disk block: drop it everywhere, take the request back; it recomputes next time.
            bad = kv.loads_failed(failed)
            first_bad = min(req.block_ids.index(b) for b in bad)
            assert len(hit) <= first_bad < len(hit) + len(loads)
            for h in (op.hash for op in failed):
                assert h not in kv.cached and h not in kv.offload
            kv.unname_from(req, first_bad)
            kv.free(req)
            assert self._run_ops() == []  # deletes of files with nothing left in them
            return False
        for i in range(len(hit), len(hit) + len(loads)):  # loaded blocks hold this request's KV
            for s in range(kv.block_size):
                assert self.content[req.block_ids[i]][s] == keys[i * kv.block_size + s], "wrong block loaded"
        self._write(req, cached, cached + n)
        req.num_computed_tokens += n
        return True

    # -- rules --
    @rule(tokens=prompts, chunk=st.integers(1, 24), logprobs=st.integers(0, 9))
    def add(self, tokens, chunk, logprobs):
        params = SamplingParams(prompt_logprobs=0) if logprobs == 0 else SamplingParams()
        req = make_req(tokens, params)
        if self._try_admit(req, chunk):
            self.live.append(req)
        else:
            self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def readmit(self, data, chunk):
        req = data.draw(st.sampled_from(self.waiting))
        if self._try_admit(req, chunk):
            self.waiting.remove(req)
            self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 24), token=st.integers(0, 2))
    def step(self, data, chunk, token):
        """Continue a chunked prompt, or decode: append a token, then allocate one slot."""
        req = data.draw(st.sampled_from(self.live))
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token)
        n = min(req.num_uncomputed_tokens, chunk)
        start = req.num_computed_tokens
        before = snapshot(self.kv, *self.live)
        if self.kv.allocate_slots(req, n):
            assert req.num_computed_tokens == start
            assert self._run_ops() == []  # saves only: evicted blocks are copied before being overwritten
            self._write(req, start, start + n)
            req.num_computed_tokens += n
        else:
            assert snapshot(self.kv, *self.live) == before
            assert self.kv.num_free_blocks < self.kv.blocks_needed(start + n) - len(req.block_ids)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def preempt(self, data, chunk):
        """Free (recompute preemption), then try to re-admit through the prefix cache at once."""
        req = data.draw(st.sampled_from(self.live))
        released = sum(1 for b in req.block_ids if self.kv.blocks[b].ref_count == 1)
        free_before = self.kv.num_free_blocks
        tokens = list(req.token_ids)
        self.kv.free(req)
        self.live.remove(req)
        assert req.block_ids == [] and req.num_computed_tokens == 0 and req.token_ids == tokens
        assert self.kv.num_free_blocks == free_before + released
        if self._try_admit(req, chunk):
            self.live.append(req)
        else:
            self.waiting.append(req)

    @precondition(lambda self: self.live or self.waiting)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.live + self.waiting))
        if req in self.live:
            self.live.remove(req)
            self.kv.free(req)
        else:
            self.waiting.remove(req)
            self.kv.free(req)  # holds nothing: a no-op
        assert req.block_ids == []

    @rule()
    def reset_cache(self):
        all_free = not any(r.block_ids for r in self.live)
        assert self.kv.reset_prefix_cache() is all_free
        for b in self.kv.free_queue:
            assert self.kv.blocks[b].hash is None
        self._run_ops()
        if self.kv.offload is not None:
            assert not self.kv.offload.host and not self.kv.offload.files

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), chunk=st.integers(1, 24), cut=st.integers(0, 3))
    def repeat(self, data, chunk, cut):
        """A new request with the tokens of an earlier one (a resent conversation), maybe shortened."""
        gone = [r for r in self.seen if r not in self.live]  # evicted ones come back through the lower tiers
        old = data.draw(st.sampled_from(gone or self.seen))
        tokens = old.token_ids[: max(1, old.num_tokens - cut)]
        req = make_req(tokens)
        if self._try_admit(req, chunk):
            self.live.append(req)
        else:
            self.waiting.append(req)

    @rule(size=st.integers(1, 64))
    def churn(self, size):
        """Unrelated content passes through the pool: cached blocks are evicted (and saved, with offloading)."""
        self.tok += 1
        req = make_req([100 + self.tok] * max(1, min(size, self.kv.num_blocks * self.kv.block_size)))
        if self._try_admit(req, size):
            self.kv.unname_from(req, 0)  # so that it does not crowd the lower tiers when evicted in turn
            self.kv.free(req)
        self.seen.remove(req)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), chunk=st.integers(1, 24), finish=st.booleans(), cut=st.integers(0, 3),
          corrupt=st.integers(0, 3))
    def churn_then_repeat(self, data, chunk, finish, cut, corrupt):
        """(Finish a live request,) evict every free block, (corrupt every disk file,) then resend an
        earlier sequence: its prefix comes back from the lower tiers, or is recomputed."""
        if finish and self.live:
            req = data.draw(st.sampled_from(self.live))
            self.live.remove(req)
            self.kv.free(req)
        self.churn(self.kv.num_free_blocks * self.kv.block_size)
        if corrupt == 0 and self.kv.offload is not None:
            self.transfer.corrupt.update(self.kv.offload.files)
        self.repeat(data, chunk, cut)

    @precondition(lambda self: self.kv.offload is not None and self.kv.offload.files)
    @rule(data=st.data())
    def corrupt_file(self, data):
        """Flip bytes in a disk file: its loads fail their checksum from now on."""
        self.transfer.corrupt.add(data.draw(st.sampled_from(sorted(self.kv.offload.files))))

    # -- invariants (checked after every rule) --
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        kv.check_invariants()
        bs = kv.block_size
        owners = [0] * kv.num_blocks
        for r in self.live:
            assert len(r.block_ids) == len(set(r.block_ids)), "block twice in one table"
            assert len(r.block_ids) == kv.blocks_needed(r.num_computed_tokens)
            for b in r.block_ids:
                owners[b] += 1
        for r in self.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
        assert refcounts(kv) == owners
        held = sum(1 for o in owners if o)
        assert kv.num_free_blocks + held == kv.num_blocks
        assert set(kv.free_queue) == {b for b, o in enumerate(owners) if not o}
        # Every computed position reads back its own KV through the block table.
        for r in self.live:
            keys = prefix_keys(r.token_ids[: r.num_computed_tokens])
            for p, k in enumerate(keys):
                assert self.content[r.block_ids[p // bs]][p % bs] == k
            # Blocks past the computed full ones carry no name yet.
            for b in r.block_ids[r.num_computed_tokens // bs :]:
                assert kv.blocks[b].hash is None
            # Named blocks carry the name of exactly these tokens.
            for i in range(r.num_computed_tokens // bs):
                blk = kv.blocks[r.block_ids[i]]
                if blk.hash is None:
                    continue
                chain = tuple(r.token_ids[: (i + 1) * bs])
                assert blk.hash == r.block_hashes[i] == chain_hashes(chain, bs)[-1]
                prev = self.shadow.get(blk.block_id)
                if prev is not None and prev[0] == blk.hash:
                    assert prev[1] == chain, "two token chains share one block"
                self.shadow[blk.block_id] = (blk.hash, chain)
        if not kv.enable_prefix_caching:
            assert kv.cached == {} and all(b.hash is None for b in kv.blocks)
        # Every named block (held or free) was named for one chain, and its content still matches it.
        chain_of = {h: tuple(r.token_ids[: (i + 1) * bs]) for r in self.seen for i, h in enumerate(r.block_hashes)}
        for h, b in kv.cached.items():
            chain = self.shadow[b][1] if self.shadow.get(b, (None,))[0] == h else chain_of[h]
            keys = prefix_keys(chain)
            for s in range(bs):
                assert self.content[b][s] == keys[len(chain) - bs + s]
        # Every host slot and every (uncorrupted) disk block holds the KV its hash names.
        off = kv.offload
        if off is not None:
            assert not off.ops and not off.pinned, "ops left unrun"
            for h, slot in off.host.items():
                keys = prefix_keys(chain_of[h])
                assert self.transfer.host[slot] == {s: keys[len(keys) - bs + s] for s in range(bs)}
            for h, (file_id, i) in off.disk_index.items():
                assert file_id not in self.transfer.deleted
                if file_id not in self.transfer.corrupt:
                    keys = prefix_keys(chain_of[h])
                    assert self.transfer.files[file_id][i] == {s: keys[len(keys) - bs + s] for s in range(bs)}

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for r in self.live:
            self.kv.free(r)
        for r in self.live + self.waiting:
            assert r.block_ids == []
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert refcounts(self.kv) == [0] * self.kv.num_blocks
        self.kv.check_invariants()
        assert self.kv.reset_prefix_cache() is True
        assert self.kv.cached == {}
        self._run_ops()
        if self.kv.offload is not None:
            assert not self.kv.offload.host and not self.kv.offload.files and self.kv.offload.disk_blocks == 0
            self.kv.offload.check_invariants()


KVMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMachine = KVMachine.TestCase


class KVOffloadMachine(KVMachine):
    """The same machine, always with a small host tier spilling to disk: long chains cross both tiers."""

    @initialize(
        num_blocks=st.integers(6, 16),
        block_size=st.integers(1, 2),
        offload=st.fixed_dictionaries(dict(
            host_slots=st.integers(1, 4),
            disk=st.just(True),
            group_blocks=st.integers(1, 3),
            disk_budget_blocks=st.sampled_from([None, None, 3, 8]),
            min_chain_blocks=st.sampled_from([1, 1, 2]),
        )),
    )
    def setup(self, num_blocks, block_size, offload):
        KVMachine.setup.hypothesis_stateful_initialize_rule.function(self, num_blocks, block_size, True, offload)


KVOffloadMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVOffloadMachine = KVOffloadMachine.TestCase


# ---- KV cache groups (a full group and windowed ones over one pool) -------------------------------------------
def test_groups_allocate_a_table_each_and_windowed_ones_release():
    kv = KVCacheManager(64, BS, group_windows=(None, 6, 6))
    req = make_req(range(20))  # 5 blocks
    admit(kv, req)
    assert [len(t) for t in req.tables] == [5, 5, 5] and kv.num_free_blocks == 64 - 15
    assert kv.release_out_of_window(req) == 2 * 3  # keys 15..19 are read next: blocks 0-2 are out of the window
    assert req.tables[0][:3] != [RELEASED] * 3 and req.tables[1][:3] == req.tables[2][:3] == [RELEASED] * 3
    assert req.num_released == [0, 3, 3] and req.num_held_blocks == 5 + 2 + 2
    assert kv.num_free_blocks == 64 - 9
    kv.free(req)
    assert kv.num_free_blocks == 64 and req.tables == [[], [], []]
    kv.check_invariants()


def test_a_prefix_hit_needs_the_full_chain_and_the_windows_end():
    """A hit of m blocks is usable when the full group holds blocks 0..m-1 and each windowed group the blocks its
    window reaches back to from token m*BS; entries before that reach are RELEASED in the hit."""
    kv = KVCacheManager(64, BS, group_windows=(None, 6))
    a = make_req(range(21))
    admit(kv, a)
    kv.release_out_of_window(a)  # keys 15.. are read next: the windowed copies of blocks 0-2 are free, still named
    window_copies = [kv.cached[group_key(1, h)] for h in a.block_hashes]
    b = make_req(range(21))  # its hit may cover 5 blocks (token 20 is left to compute): keys 15..19, blocks 3-4
    hit = kv.get_computed_blocks(b)
    assert list(hit) == a.tables[0][:5] and hit.others == [[RELEASED] * 3 + window_copies[3:]]
    kv.free(a)
    kv._unname({window_copies[3]})  # evicted: a hit of 5 or 4 blocks would read it (keys 15.. / 11..)
    hit = kv.get_computed_blocks(b)
    assert len(hit) == 3 and hit.others == [[RELEASED] + window_copies[1:3]]  # 3 blocks: keys 7..11, blocks 1-2
    assert kv.allocate_slots(b, b.num_tokens - 3 * BS, hit)
    assert b.num_released == [0, 1] and len(b.tables[1]) == len(b.tables[0]) == 6
    kv.free(b)
    assert kv.num_free_blocks == 64
    kv.check_invariants()


def test_a_hit_is_refused_when_a_group_cannot_supply_it():
    kv = KVCacheManager(64, BS, group_windows=(None, 6))
    with pytest.raises(ValueError, match="group"):
        kv.allocate_slots(make_req(range(9)), 1, [0, 1])  # a hit without the windowed group's entries


def test_blocks_for_tokens_and_capacity():
    # full: 25 blocks; window 6 with chunks of 8: keys 13 tokens wide, at most ceil(13 / 4) + 1 = 5 blocks
    assert blocks_for_tokens(100, (None, 6, 6), BS, 8) == 25 + 5 + 5
    assert blocks_for_tokens(8, (None, 6), BS, 8) == 2 + 2
    kv = KVCacheManager(35, BS, group_windows=(None, 6, 6))
    assert kv.capacity_tokens(8) == 100
    assert KVCacheManager(35, BS).capacity_tokens(8) == 35 * BS
    assert KVCacheManager(5, BS, group_windows=(6,)).capacity_tokens(8) >= 2**30  # only windows: unbounded

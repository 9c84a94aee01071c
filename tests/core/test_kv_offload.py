"""Unit tests for the lower KV tiers' bookkeeping (tokenmill/engine/kv_offload.py) and how the block
pool uses them: LRU order in the host tier, groups spilled to one disk file, pins, budgets, the
measured cost model, chains that continue from the device into host and disk. Pure Python."""
from __future__ import annotations

import itertools

import pytest

from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.kv_offload import (
    DISK,
    HOST,
    DeleteFileOp,
    LoadOp,
    OffloadTiers,
    SaveOp,
    SpillOp,
    TransferCosts,
)
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def H(i: int) -> bytes:
    return bytes([i]) * 32


def make_req(tokens, extra_keys=()) -> Request:
    return Request(f"o{next(_ids)}", list(tokens), SamplingParams(), max_tokens=8, extra_keys=extra_keys)


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], list[bytes]]:
    hit = kv.get_computed_blocks(req)
    loads = kv.get_offloaded_chain(req, len(hit))
    n = req.num_tokens - (len(hit) + len(loads)) * kv.block_size
    assert kv.allocate_slots(req, n, hit, loads)
    req.num_computed_tokens += n
    return hit, loads


# ---- host tier: LRU, groups, pins ----------------------------------------------------------


def test_host_tier_evicts_least_recently_used_first():
    t = OffloadTiers(host_slots=3, disk=True, group_blocks=1)
    for i in range(3):
        t.save(10 + i, H(i))
    assert [type(op) for op in t.take_ops()] == [SaveOp] * 3
    t.save(99, H(0))  # already there: touched, no copy
    assert t.take_ops() == [] and list(t.host) == [H(1), H(2), H(0)]
    t.save(13, H(3))  # full: the least recently used (H(1)) goes to disk, its slot is reused
    spill, save = t.take_ops()
    slot1 = spill.slots[0]
    assert spill == SpillOp(0, (slot1,), (H(1),))
    assert save == SaveOp(13, slot1, H(3))  # after the spill read the slot
    assert t.tier_of(H(1)) == DISK and t.tier_of(H(3)) == HOST
    assert list(t.host) == [H(2), H(0), H(3)]
    t.pin([H(2)])  # a load is coming: moves to the back, and cannot be spilled this step
    t.save(14, H(4))
    spill, save = t.take_ops()
    assert spill.hashes == (H(0),)
    assert t.stats.saves == 5 and t.stats.spills == 2 and t.stats.files_written == 2
    t.check_invariants()


def test_groups_spill_to_one_file_and_skip_blocks_already_on_disk():
    t = OffloadTiers(host_slots=4, disk=True, group_blocks=3)
    for i in range(4):
        t.save(i, H(i))
    t.take_ops()
    t.save(4, H(4))
    spill, save = t.take_ops()
    assert spill.hashes == (H(0), H(1), H(2)) and len(set(spill.slots)) == 3
    assert [t.disk_index[H(i)] for i in range(3)] == [(0, 0), (0, 1), (0, 2)]
    assert len(t.free_slots) == 2  # three slots freed, one taken by the save
    # Loading back keeps the disk copy (inclusive tiers); saving again puts it in host only.
    t.save(5, H(1))
    assert t.take_ops() == [SaveOp(5, t.host[H(1)], H(1))]
    assert t.tier_of(H(1)) == HOST and t.disk_index[H(1)] == (0, 1)
    t.save(6, H(6))  # the last free slot
    assert [type(op) for op in t.take_ops()] == [SaveOp]
    t.save(7, H(7))
    # Full again: victims H(3), H(4), H(1); H(1) is on disk already, so only two are written.
    spill, _ = t.take_ops()
    assert spill.hashes == (H(3), H(4))
    t.check_invariants()


def test_without_disk_host_evictions_drop_blocks():
    t = OffloadTiers(host_slots=2, disk=False, group_blocks=1)
    t.save(0, H(0))
    t.save(1, H(1))
    t.save(2, H(2))
    assert [type(op) for op in t.take_ops()] == [SaveOp] * 3
    assert H(0) not in t and t.stats.host_evictions == 1


def test_all_pinned_host_drops_the_save():
    t = OffloadTiers(host_slots=1, disk=True, group_blocks=1)
    t.save(0, H(0))
    t.take_ops()
    t.load(H(0), 5)
    t.save(1, H(1))  # the only slot is being read this step
    assert t.take_ops() == [LoadOp(5, H(0), slot=0)]
    assert t.stats.dropped == 1 and H(1) not in t
    t.save(1, H(1))  # pins are released once the ops ran
    assert [type(op) for op in t.take_ops()] == [SpillOp, SaveOp]


def test_disk_budget_evicts_least_recently_used_file():
    t = OffloadTiers(host_slots=1, disk=True, group_blocks=1, disk_budget_blocks=2)
    for i in range(4):  # H(0), H(1), H(2) spill to files 0, 1, 2 in turn
        t.save(i, H(i))
    ops = t.take_ops()
    assert [type(op) for op in ops].count(DeleteFileOp) == 1
    assert DeleteFileOp(0) in ops and H(0) not in t
    t.load(H(1), 9)  # touches file 1
    t.take_ops()
    t.save(4, H(4))  # spills H(3) to file 3: file 2 is now the least recently used
    ops = t.take_ops()
    assert DeleteFileOp(2) in ops and H(1) in t and H(2) not in t
    assert t.stats.disk_evictions == 2
    t.check_invariants()


def test_forget_deletes_a_file_when_nothing_is_left_in_it():
    t = OffloadTiers(host_slots=2, disk=True, group_blocks=2)
    for i in range(3):
        t.save(i, H(i))
    t.take_ops()
    assert t.disk_index[H(0)][0] == t.disk_index[H(1)][0] == 0
    t.load_failed(H(0))
    assert t.take_ops() == [] and 0 in t.files
    t.load_failed(H(1))
    assert t.take_ops() == [DeleteFileOp(0)] and not t.files
    assert t.stats.load_failures == 2
    t.check_invariants()


def test_host_tier_needs_a_slot():
    with pytest.raises(ValueError):
        OffloadTiers(host_slots=0)


# ---- cost model ----------------------------------------------------------------------------


def test_break_even_from_measured_costs():
    c = TransferCosts(recompute_per_block=1.0, host_fixed=0.5, host_per_block=0.1, disk_fixed=2.9, disk_per_block=0.4)
    assert c.break_even(HOST) == 1  # 0.5 + 0.1 < 1.0
    assert c.break_even(DISK) == 5  # 2.9 + 0.4k < k from k = 5
    assert c.blocks_worth_loading([HOST] * 3) == 3
    assert c.blocks_worth_loading([DISK] * 4) == 0
    assert c.blocks_worth_loading([DISK] * 5) == 5
    # A host prefix pays; the disk tail does not, until it is long enough.
    assert c.blocks_worth_loading([HOST, HOST] + [DISK] * 2) == 2
    assert c.blocks_worth_loading([HOST, HOST] + [DISK] * 8) == 10
    slow = TransferCosts(recompute_per_block=1.0, host_per_block=1.0)
    assert slow.break_even(HOST) is None and slow.blocks_worth_loading([HOST] * 100) == 0
    t = OffloadTiers(host_slots=4, disk=True, costs=c)
    assert t.break_even_blocks == {HOST: 1, DISK: 5}
    assert OffloadTiers(host_slots=4, disk=False, min_chain_blocks=3).break_even_blocks == {HOST: 3, DISK: None}


def test_tiers_that_never_pay_are_not_used():
    never = TransferCosts(recompute_per_block=1.0, host_per_block=2.0, disk_per_block=2.0)
    t = OffloadTiers(host_slots=4, disk=True, costs=never)
    assert not t.use_host and not t.use_disk
    t.save(0, H(0))
    assert t.take_ops() == [] and H(0) not in t
    host_only = TransferCosts(recompute_per_block=1.0, host_per_block=0.1, disk_per_block=2.0)
    t = OffloadTiers(host_slots=1, disk=True, group_blocks=1, costs=host_only)
    t.save(0, H(0))
    t.save(1, H(1))
    assert [type(op) for op in t.take_ops()] == [SaveOp, SaveOp]  # no spill: disk never pays
    assert t.stats.host_evictions == 1 and not t.files


# ---- with the block pool -------------------------------------------------------------------


def test_evicted_blocks_are_saved_in_lru_order_and_chains_continue_into_lower_tiers():
    tiers = OffloadTiers(host_slots=2, disk=True, group_blocks=1, min_chain_blocks=1)
    kv = KVCacheManager(4, BS, offload=tiers)
    a = make_req(range(13))  # 3 full named blocks + 1 partial
    admit(kv, a)
    ids, hashes = list(a.block_ids), list(a.block_hashes)
    kv.free(a)  # free queue, tail first: a3, a2, a1, a0
    b = make_req([50] * 13)  # takes the whole pool: evicts a2, a1, a0 (a3 holds no name)
    assert admit(kv, b) == ([], [])
    ops = kv.take_transfer_ops()
    saves = [op for op in ops if isinstance(op, SaveOp)]
    assert [(op.block_id, op.hash) for op in saves] == [(ids[2], hashes[2]), (ids[1], hashes[1]), (ids[0], hashes[0])]
    spills = [op for op in ops if isinstance(op, SpillOp)]
    assert [op.hashes for op in spills] == [(hashes[2],)]  # host holds 2: the oldest went to disk
    assert kv.stats.evictions == 3
    kv.free(b)
    kv.take_transfer_ops()
    # The same prompt comes back: nothing on the device, two blocks in host, one on disk.
    c = make_req(range(13))
    assert kv.get_computed_blocks(c) == []
    assert kv.get_offloaded_chain(c, 0) == hashes
    hit, loads = admit(kv, c)
    assert c.num_computed_tokens == 13 and loads == hashes
    ops = [op for op in kv.take_transfer_ops() if isinstance(op, LoadOp)]
    assert [(op.hash, op.tier) for op in ops] == [(hashes[0], HOST), (hashes[1], HOST), (hashes[2], DISK)]
    assert [op.block_id for op in ops] == c.block_ids[:3]
    # Loaded blocks are named at once: a request in the same step shares them.
    assert [kv.cached[h] for h in hashes] == c.block_ids[:3]
    d = make_req(range(13))
    assert kv.get_computed_blocks(d) == c.block_ids[:3]
    kv.check_invariants()


def test_offloaded_chain_leaves_the_last_token_and_respects_the_threshold():
    tiers = OffloadTiers(host_slots=8, min_chain_blocks=3)
    kv = KVCacheManager(4, BS, offload=tiers)
    a = make_req(range(12))  # exactly three full blocks
    admit(kv, a)
    kv.free(a)
    admit(kv, make_req([60] * 16))  # evicts all three
    kv.take_transfer_ops()
    assert set(a.block_hashes) <= set(tiers.host)
    assert kv.get_offloaded_chain(make_req(range(12)), 0) == []  # two blocks usable (last token): under 3
    assert kv.get_offloaded_chain(make_req(range(13)), 0) == a.block_hashes
    p = Request("p", list(range(13)), SamplingParams(prompt_logprobs=1), max_tokens=1)
    assert kv.get_offloaded_chain(p, 0) == []  # prompt logprobs need every position computed


def test_reset_prefix_cache_clears_lower_tiers():
    tiers = OffloadTiers(host_slots=1, disk=True, group_blocks=1, min_chain_blocks=1)
    kv = KVCacheManager(3, BS, offload=tiers)
    for t in range(3):
        r = make_req([t] * 9)
        admit(kv, r)
        kv.free(r)
    kv.take_transfer_ops()
    assert tiers.host and tiers.files
    assert kv.reset_prefix_cache()
    assert [type(op) for op in kv.take_transfer_ops()] == [DeleteFileOp] * 3
    assert not tiers.host and not tiers.files and not tiers.disk_index
    tiers.check_invariants()


def test_offload_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(4, BS, enable_prefix_caching=False, offload=OffloadTiers(host_slots=1))


def test_extra_keys_separate_equal_tokens():
    kv = KVCacheManager(16, BS)
    a = make_req(range(9), extra_keys=("adapter-a",))
    admit(kv, a)
    assert kv.get_computed_blocks(make_req(range(9))) == []
    assert kv.get_computed_blocks(make_req(range(9), extra_keys=("adapter-b",))) == []
    assert kv.get_computed_blocks(make_req(range(9), extra_keys=("adapter-a",))) == a.block_ids[:2]
    assert make_req(range(9), extra_keys=(7,)).block_hashes == []  # named lazily

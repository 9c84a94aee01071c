"""Property test of the multi-token step contract: Scheduler.build_batch / update_from_output with
speculative drafts accepted 0..k at random, aborts and preemptions, against a fake worker that keeps
its own request copies from the batch diffs and writes token ids into a shadow KV pool.

After every step: no block leaked or double-freed (ref counts equal the block tables that hold them),
the KV of every accepted token is intact, the worker's copy equals the scheduler's, and prefix-cache
hashes cover accepted tokens only (every named block holds exactly the tokens its hash names).
"""
from __future__ import annotations

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.core.batch import ModelRunnerOutput, ScheduledBatch
from tokenmill.core.kv_cache import KVCacheManager, hash_block
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


class FakeWorker:
    """Applies batches like executor/input_batch.py does, 'computes' KV by writing token ids to slots,
    and accepts a random prefix of each request's drafts."""

    def __init__(self, block_size: int, rng: random.Random) -> None:
        self.bs = block_size
        self.rng = rng
        self.kv: dict[int, int] = {}  # slot -> token id whose KV it holds
        self.reqs: dict[str, dict] = {}

    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        for rid in batch.finished_req_ids:
            self.reqs.pop(rid, None)
        for n in batch.new_requests:
            self.reqs[n.req_id] = {"tokens": list(n.token_ids), "blocks": list(n.block_ids)}
        for c in batch.cached_requests:
            r = self.reqs[c.req_id]
            r["tokens"].extend(c.new_token_ids)
            del r["blocks"][c.block_table_len - len(c.new_block_ids):]
            r["blocks"].extend(c.new_block_ids)
        computed = {n.req_id: n.num_computed_tokens for n in batch.new_requests}
        computed.update({c.req_id: c.num_computed_tokens for c in batch.cached_requests})
        out = ModelRunnerOutput()
        for rid, n, rows in zip(batch.req_ids, batch.num_scheduled_tokens, batch.num_sample_rows):
            r, start = self.reqs[rid], computed[rid]
            spec = batch.spec_token_ids.get(rid, [])
            seq = r["tokens"][start : start + n - len(spec)] + spec
            assert len(seq) == n
            for i, tok in enumerate(seq):
                pos = start + i
                self.kv[r["blocks"][pos // self.bs] * self.bs + pos % self.bs] = tok
            if rows:
                accepted = self.rng.randint(0, len(spec)) if spec else 0
                bonus = self.rng.randrange(VOCAB)
                out.req_ids.append(rid)
                out.sampled_token_ids.append(spec[:accepted] + [bonus])
        return out


def chain(tokens: list[int], bs: int, upto: int) -> list[bytes]:
    hashes, parent = [], None
    for i in range(upto // bs):
        parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
        hashes.append(parent)
    return hashes


def check(sched: Scheduler, worker: FakeWorker, reqs: list[Request], contents: dict[bytes, list[int]]) -> None:
    kv, bs = sched.kv, sched.kv.block_size
    kv.check_invariants()
    refs: dict[int, int] = {}
    for r in sched.running:
        assert len(set(r.block_ids)) == len(r.block_ids)
        for b in r.block_ids:
            refs[b] = refs.get(b, 0) + 1
    for r in reqs:
        if r.status != RequestStatus.RUNNING:
            assert r.block_ids == []
    for block in kv.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} leaked or double-freed"
    for r in sched.running:
        assert r.num_computed_tokens <= r.num_tokens
        assert len(r.block_ids) * bs >= r.num_computed_tokens
        for pos in range(r.num_computed_tokens):  # the KV of every accepted token is where the table says
            assert worker.kv.get(r.block_ids[pos // bs] * bs + pos % bs) == r.token_ids[pos], (r.request_id, pos)
        expected = chain(r.token_ids, bs, len(r.block_hashes) * bs)
        assert r.block_hashes == expected  # hashes over accepted tokens only
        for i, h in enumerate(expected):
            contents.setdefault(h, r.token_ids[i * bs : (i + 1) * bs])
        if r.sent is not None and r.request_id in worker.reqs:
            w = worker.reqs[r.request_id]
            assert w["tokens"] == r.token_ids[: len(w["tokens"])]
    for h, b in kv.cached.items():  # a named block holds exactly the tokens its hash names
        if h in contents and kv.blocks[b].ref_count > 0:
            assert [worker.kv.get(b * bs + j) for j in range(bs)] == contents[h]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4]), k=st.integers(1, 5),
       num_blocks=st.integers(24, 80), budget=st.integers(8, 40))
def test_random_accept_counts_keep_kv_and_blocks_consistent(seed, block_size, k, num_blocks, budget):
    rng = random.Random(seed)
    max_len = 48
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, num_lookahead_tokens=k)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(cfg, kv, max_len)
    worker = FakeWorker(block_size, rng)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]  # a common prefix, for cache hits
    reqs: list[Request] = []
    contents: dict[bytes, list[int]] = {}
    for step in range(120):
        if len(reqs) < 14 and rng.random() < 0.3:
            prompt = (shared[: rng.randint(0, 12)] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))])
            p = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.5)
            req = Request(f"r{len(reqs)}", prompt, p, min(p.max_tokens, max_len - len(prompt)), frozenset({EOS}))
            if len(prompt) + k >= num_blocks * block_size:  # the whole pool cannot hold it: refused up front
                with pytest.raises(ValueError, match="does not fit the KV cache"):
                    sched.add_request(req)
                continue
            reqs.append(req)
            sched.add_request(req)
        if reqs and rng.random() < 0.05:
            victim = rng.choice(reqs)
            if not victim.finished:
                sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
        for r in sched.running:  # drafts for decoding requests, as a proposer would make
            if r.num_uncomputed_tokens == 1 and rng.random() < 0.7:
                r.spec_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, k))]
        out = sched.schedule()
        if not out:
            check(sched, worker, reqs, contents)
            continue
        batch = sched.build_batch(out)
        for rid, n in zip(batch.req_ids, batch.num_scheduled_tokens):
            assert len(batch.spec_token_ids.get(rid, [])) < n or n == 0
        before = {r.request_id: r.num_tokens for r, _ in out.scheduled}
        outputs = sched.update_from_output(out, worker.execute(batch))
        for o in outputs:  # only accepted tokens come back, cut at the first stop
            r = next(x for x in reqs if x.request_id == o.request_id)
            assert r.token_ids[before[o.request_id] :] == o.new_token_ids
            if o.finished and o.finish_reason == "stop" and not r.params.ignore_eos:
                assert o.new_token_ids[-1] == EOS
            assert r.num_output_tokens <= r.max_tokens and r.num_tokens <= max_len
        check(sched, worker, reqs, contents)
    sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_blocks and not sched.requests
    kv.check_invariants()

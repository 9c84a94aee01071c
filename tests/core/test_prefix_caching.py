"""Prefix caching and KV offloading change where KV comes from, never what the model says: greedy
tokens and logprobs equal a run with caching off, across chunked prefill, preemption, n > 1 and
aborts; with host and disk tiers (blocks really loaded back from both); and with damaged disk files,
which are recomputed (and counted), never served. Tiny random models, fp32."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

LOGPROB_ATOL = 2e-4  # fp32; cached and recomputed KV differ only in summation order
VOCAB = 384


def stems_and_prompts(seed: int = 0, stems: int = 3, stem_len: int = 30):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    heads = [rand(stem_len) for _ in range(stems)]
    prompts = [h + rand(k) for h in heads for k in (3, 11, 19)]
    prompts.append(list(prompts[0]))  # an exact repeat
    prompts.append(heads[1][:16])  # a prefix of another prompt, on a block boundary
    return prompts


def run(llm: LLM, prompts, params, abort: tuple[int, int] | None = None) -> dict[int, object]:
    """Drive the engine step by step; abort prompt abort[0] after abort[1] steps. -> {index: output}."""
    engine = llm.engine
    ids = [f"{id(llm)}-{next(_counter)}" for _ in prompts]
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, p, sp)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if abort and steps == abort[1] and ids[abort[0]] not in done:
            done[ids[abort[0]]] = engine.abort_request(ids[abort[0]])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()
    return {i: done[rid] for i, rid in enumerate(ids)}


_counter = iter(range(1 << 30))


def assert_same(got, ref, label, prefix_ok=()):
    for i in ref:
        for a, b in zip(got[i].outputs, ref[i].outputs):
            if i in prefix_ok:  # aborted: what it produced is a prefix of the full answer
                assert a.token_ids == b.token_ids[: len(a.token_ids)], f"{label}: aborted prompt {i}"
            else:
                assert a.token_ids == b.token_ids, f"{label}: prompt {i} seq {a.index}"
            for step, (ea, eb) in enumerate(zip(a.logprobs, b.logprobs)):
                assert ea.keys() == eb.keys(), f"{label}: prompt {i} step {step} top tokens"
                for tid in ea:
                    assert abs(ea[tid].logprob - eb[tid].logprob) < LOGPROB_ATOL, f"{label}: prompt {i} step {step}"


def params_for(prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=2)
    pair = SamplingParams(n=2, temperature=0.0, max_tokens=12, min_tokens=12, logprobs=2)
    return [pair if i % 4 == 1 else greedy for i in range(len(prompts))]


CONFIGS = {
    # prompts chunked by a 16-token budget and mixed with decodes
    "chunked": dict(max_model_len=96, num_gpu_blocks_override=64, block_size=8, max_num_batched_tokens=16),
    # a pool of 14 blocks of 8 for 11 prompts of up to 61 tokens: preemption must happen
    "preempted": dict(max_model_len=96, num_gpu_blocks_override=14, block_size=8, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_caching_on_equals_off(tiny_llama, config):
    kw = CONFIGS[config]
    prompts = stems_and_prompts()
    params = params_for(prompts)
    off = LLM(str(tiny_llama), enable_prefix_caching=False, **kw)
    on = LLM(str(tiny_llama), enable_prefix_caching=True, **kw)
    ref = run(off, prompts, params)
    first = run(on, prompts, params, abort=(4, 5))
    assert_same(first, ref, f"{config} first pass", prefix_ok={4})
    assert first[4].outputs[0].finish_reason == "abort"
    second = run(on, prompts, params)  # now mostly from the cache
    assert_same(second, ref, f"{config} second pass")
    # n > 1 greedy: the pair decodes the same sequence on shared prompt blocks.
    for i in range(1, len(prompts), 4):
        assert second[i].outputs[0].token_ids == second[i].outputs[1].token_ids
    stats = on.engine.kv.stats
    assert sum(o.num_cached_tokens for o in second.values()) > 0
    assert stats.hits > 0 and stats.queries > stats.hits and 0 < stats.hit_rate < 1
    assert off.engine.kv.stats.hits == 0 and all(o.num_cached_tokens == 0 for o in ref.values())
    if config == "preempted":
        assert on.engine.scheduler.num_preemptions > 0 and off.engine.scheduler.num_preemptions > 0
        assert stats.evictions > 0


def offload_llm(path, tmp_path, **kw):
    # 14 device blocks of 8 tokens; the host tier holds 8 blocks, the rest spills to files.
    bpb = 2 * 2 * 8 * 2 * 16 * 4  # layers * (K, V) * block_size * kv heads * head_dim * fp32
    return LLM(str(path), max_model_len=96, num_gpu_blocks_override=14, block_size=8,
               kv_offload_bytes=8 * bpb, kv_offload_dir=str(tmp_path / "kv"), kv_offload_min_blocks=1, **kw)


def sequential(llm, prompts, params):
    """One request at a time, so each evicts its predecessors from the small device pool."""
    out = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        out.update({i: run(llm, [p], [sp])[0]})
    return out


def test_offload_on_equals_off_and_loads_from_host_and_disk(tiny_llama, tmp_path):
    prompts = stems_and_prompts(seed=1, stems=4, stem_len=40)
    params = params_for(prompts)
    ref = sequential(LLM(str(tiny_llama), max_model_len=96, num_gpu_blocks_override=14, block_size=8,
                         enable_prefix_caching=False), prompts, params)
    llm = offload_llm(tiny_llama, tmp_path)
    assert llm.engine.kv.offload.host_slots == 8
    first = sequential(llm, prompts, params)
    assert_same(first, ref, "offload first pass")
    llm.engine.transfer.flush()
    assert glob.glob(str(tmp_path / "kv" / "*" / "*.kvb")), "nothing reached the disk tier"
    second = sequential(llm, prompts, params)
    assert_same(second, ref, "offload second pass")
    # Both passes batched together, with preemption, on top of the tiers.
    together = run(llm, prompts, params)
    assert_same(together, ref, "offload batched")
    st = llm.engine.kv.offload.stats
    assert st.saves > 0 and st.spills > 0 and st.files_written > 0
    assert st.host_loads > 0 and st.disk_loads > 0, st
    assert st.load_failures == 0
    assert sum(o.num_cached_tokens for o in second.values()) > sum(o.num_cached_tokens for o in first.values())
    assert llm.engine.stats.offload_s > 0


def test_damaged_disk_files_are_recomputed(tiny_llama, tmp_path):
    prompts = stems_and_prompts(seed=2, stems=4, stem_len=40)
    params = params_for(prompts)
    ref = sequential(LLM(str(tiny_llama), max_model_len=96, num_gpu_blocks_override=14, block_size=8,
                         enable_prefix_caching=False), prompts, params)
    llm = offload_llm(tiny_llama, tmp_path)
    sequential(llm, prompts, params)
    llm.engine.transfer.flush()
    files = sorted(glob.glob(str(tmp_path / "kv" / "*" / "*.kvb")))
    assert len(files) >= 2
    damaged = {}
    for k, f in enumerate(files):  # every file: flip a data byte in half, truncate the other half
        raw = bytearray(open(f, "rb").read())
        if k % 2 == 0:
            raw[len(raw) - 100] ^= 0xFF
            damaged[os.path.basename(f)] = "flipped"
        else:
            raw = raw[: len(raw) // 2]
            damaged[os.path.basename(f)] = "truncated"
        open(f, "wb").write(bytes(raw))
    # Record which files the failed loads came from.
    transfer, failed_kinds = llm.engine.transfer, set()
    real_run = transfer.run

    def spy(ops):
        failed = real_run(ops)
        failed_kinds.update(damaged[os.path.basename(transfer.path(op.file_id))] for op in failed)
        return failed

    transfer.run = spy
    again = sequential(llm, prompts, params)
    assert_same(again, ref, "after damage")
    st = llm.engine.kv.offload.stats
    assert st.load_failures >= 2 and failed_kinds == {"flipped", "truncated"}, (st, failed_kinds)
    # The damaged hashes were forgotten: a third pass recomputes or uses fresh copies, and still agrees.
    assert_same(sequential(llm, prompts, params), ref, "third pass")


def test_break_even_is_measured_at_start_up(tiny_llama, tmp_path):
    llm = LLM(str(tiny_llama), max_model_len=96, num_gpu_blocks_override=14, block_size=8,
              kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path / "kv"))
    tiers = llm.engine.kv.offload
    costs = tiers.costs
    # Measured, not assumed (the values themselves depend on the machine and its load).
    assert costs is not None and costs.recompute_per_block >= 0
    assert 0 <= costs.host_per_block < float("inf") and 0 <= costs.disk_per_block < float("inf")
    be = tiers.break_even_blocks
    assert be == {"host": costs.break_even("host"), "disk": costs.break_even("disk")}
    for tier in ("host", "disk"):
        assert be[tier] is None or be[tier] >= 1
    # Calibration leaves nothing behind: no stats, no ops, no files.
    assert tiers.stats.saves == 0 and not tiers.ops and llm.engine.transfer.stats.ops_s == 0
    assert os.listdir(llm.engine.transfer.dir) == []
    out = llm.generate([list(range(3, 40))], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_offload_config_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(str(tiny_llama), max_model_len=96, num_gpu_blocks_override=14, enable_prefix_caching=False,
            kv_offload_bytes=1 << 20)
    with pytest.raises(ValueError, match="holds no block"):
        LLM(str(tiny_llama), max_model_len=96, num_gpu_blocks_override=14, kv_offload_bytes=10)

"""KV events: the prefix cache reports the blocks it names and drops, so a router can tell which replica
holds a prompt's prefix (computing the same hash chain from the prompt's tokens)."""
from __future__ import annotations

from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_cache import KVCacheManager, hash_block
from tokenmill.core.kv_events import KVEventLog
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams as SP


def chain(tokens: list[int], bs: int) -> list[str]:
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
        out.append(parent.hex())
    return out


def test_log_since_and_reset():
    log = KVEventLog(maxlen=4)
    for i in range(3):
        log.stored(bytes([i]))
    log.removed(bytes([0]))
    got = log.since(1, lambda: [])
    assert not got["reset"] and [e[0] for e in got["events"]] == [2, 3, 4] and got["last_seq"] == 4
    assert got["events"][-1][1:] == ["removed", "00"]
    log.stored(b"\x09")
    log.stored(b"\x0a")  # seq 6: events 1-2 fell off the buffer
    stale = log.since(1, lambda: [b"\x01", b"\x0a"])
    assert stale["reset"] and stale["stored"] == ["01", "0a"]
    assert log.since(6, lambda: [])["events"] == []
    assert log.since(99, lambda: [b"\x01"])["reset"]  # a sequence number from another run


def test_manager_reports_named_and_evicted_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5], SP(max_tokens=1), max_tokens=1)
    assert kv.allocate_slots(a, 5)
    stored = [e[2] for e in kv.events.since(0, lambda: [])["events"] if e[1] == "stored"]
    assert stored == chain([1, 2, 3, 4, 5], 2)
    kv.free(a)
    b = Request("b", [7, 8, 9, 10, 11, 12, 13, 14], SP(max_tokens=1), max_tokens=1)
    seq = kv.events.seq
    assert kv.allocate_slots(b, 8)  # needs all 4 blocks: a's named blocks are evicted
    ev = kv.events.since(seq, lambda: [])["events"]
    assert {e[2] for e in ev if e[1] == "removed"} == set(stored)
    kv.free(b)
    assert kv.reset_prefix_cache()
    after = kv.events.since(0, lambda: list(kv.cached))
    assert after["reset"] is False and after["events"][-1][1] == "removed" and not kv.cached


def test_engine_kv_events_match_the_prompt_hash_chain(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=4 << 20, block_size=4)
    prompt = list(range(20, 33))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
    got = llm.engine.core.kv_events(0)
    assert got["block_size"] == 4
    stored = {e[2] for e in got["events"] if e[1] == "stored"}
    assert set(chain(prompt, 4)) <= stored

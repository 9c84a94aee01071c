"""Weights beyond memory (issue 29, model/weight_store.py): with --weights-resident-gb a third of the weights, the
other decoder layers stream from a file each step. Output equals the fully resident model's (greedy tokens and
logprobs, bit for bit: the same bytes), for a safetensors model and a GGUF one with quantized blocks; the
weights' resident pages (mincore over every parameter) stay within the budget plus the layers being read; the
diagnostics say what each step streams and which bound sets its speed; a budget below the non-layer weights is
refused, one above the model streams nothing."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.model.mapped_pages import resident_bytes

# The kernel's readahead may bring a little past a layer's range into the page cache when a streamed layer is read
# in (the device's read_ahead_kb, 128 KiB by default): part of the working set, so part of the bound below.
READAHEAD = 512 << 10
# Layers of some MiB each, so that a third of the weights is several layers and the readahead a small share.
SIZE = dict(num_hidden_layers=12, hidden_size=256, intermediate_size=512)
SP = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=3)
PROMPTS = [[5 + (i * 13 + j * 7) % 300 for j in range(9 + 11 * i)] for i in range(4)]
KW = dict(max_model_len=128, num_gpu_blocks_override=64)


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())


def same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in x.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in e.items()} for e in y.outputs[0].logprobs]


def check_streaming(path, tmp_path, **kw) -> None:
    resident = LLM(str(path), **KW, **kw)
    want = resident.generate(PROMPTS, SP, use_tqdm=False)
    total = weight_bytes(resident)
    budget = total / 3
    llm = LLM(str(path), **KW, **kw, weights_resident_gb=budget / 2**30, weights_stream_dir=str(tmp_path))
    store = llm.engine.model.weight_store
    layers = list(llm.engine.model.own_layers)
    assert store.streamed and store.resident_bytes <= budget
    if kw.get("tokenizer"):  # the GGUF file's blocks stream as they are
        assert sum(hasattr(p, "gguf_qtype") for s in store.streamed for p in layers[s.index].parameters()) >= 4
    assert all(not any(p.is_mkldnn for p in layers[s.index].parameters()) for s in store.streamed)
    for _ in range(2):  # the second run reads every streamed layer from the file again
        same(llm.generate(PROMPTS, SP, use_tqdm=False), want)
    # Resident now: the budget's weights, plus at most the layer read ahead for the next step, one more and the
    # kernel's readahead; well under the whole model.
    biggest = max(s.nbytes for s in store.streamed)
    bound = store.resident_bytes + 2 * biggest + READAHEAD
    assert resident_bytes(llm.engine.model.parameters()) <= bound < 0.75 * total
    assert llm.engine.model._native_stack() is None  # each layer's forward must be seen
    from tokenmill import diagnostics as d

    w = d.engine_diagnostics(llm.engine)["weights"]
    assert w["streamed_bytes_per_step"] == store.streamed_bytes and w["read_bytes_per_s"] > 0 and w["source"] == "disk"
    assert w["bound"] in ("disk", "compute") and w["compute_s_per_step"] > 0


def test_safetensors_layers_stream_with_a_third_resident(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama", **SIZE)
    check_streaming(path, tmp_path)


def test_gguf_blocks_stream_with_a_third_resident(tmp_path):
    import gguf

    from gguf_tiny import write_gguf

    folder = make_tiny_model(tmp_path / "llama", "llama", **SIZE)
    path = write_gguf(folder, tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q4_1)
    check_streaming(path, tmp_path, tokenizer=str(folder))


def test_budgets_outside_the_model(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="outside the decoder layers"):
        LLM(str(path), **KW, weights_resident_gb=1e-6)
    llm = LLM(str(path), **KW, weights_resident_gb=1.0)
    assert llm.engine.model.weight_store.streamed == []
    llm.generate(PROMPTS[:1], SP, use_tqdm=False)
    from tokenmill.config import EngineConfig, ModelConfig

    with pytest.raises(ValueError, match="cpu-offload-gb"):
        EngineConfig(model=ModelConfig(weights_resident_gb=1.0), device="cuda").validate()
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(model=ModelConfig(weights_resident_gb=0.0)).validate()


def test_streaming_reads_ahead_and_counts_its_waits(tmp_path):
    """Every streamed layer is read by the background thread before its forward: the pages a forward touches
    come from the page cache the read filled; the waits are counted in the step's timings."""
    path = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=6)
    total = weight_bytes(LLM(str(path), **KW))
    llm = LLM(str(path), **KW, weights_resident_gb=total / 3 / 2**30)
    store = llm.engine.model.weight_store
    reads = []
    load = store._load
    store._load = lambda offset, n: reads.append(offset) or load(offset, n)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    steps = list(llm.engine.stats.history)
    # every step reads each streamed layer once, in forward order (the first ones were queued at start-up, before
    # _load was wrapped: the reads seen start at the first one queued after)
    order = [s.offset for s in store.streamed]
    first = order.index(reads[0])
    assert reads == (order * (len(steps) + 2))[first: first + len(reads)]
    assert len(reads) >= len(steps) * len(order) - 2
    assert all(s.weight_wait_s >= 0 for s in steps) and all(s.weight_wait_s <= s.forward_s for s in steps)


def test_a_failed_read_fails_only_its_step(tmp_path):
    """Fault injection: the read-ahead of a streamed layer fails (an I/O error from the disk). The read-ahead is
    advice: the error is counted and logged, the forward's page faults read the layer from the file, and every
    request ends with its solo output; no step fails, no KV block leaks."""
    import errno

    path = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=6)
    resident = LLM(str(path), **KW)
    want = resident.generate(PROMPTS, SP, use_tqdm=False)
    llm = LLM(str(path), **KW, weights_resident_gb=weight_bytes(resident) / 3 / 2**30)
    store = llm.engine.model.weight_store
    load, calls, failed = store._load, [], []

    def flaky(offset: int, nbytes: int) -> None:
        calls.append(offset)
        if len(calls) == 3:
            failed.append(offset)
            raise OSError(errno.EIO, "injected read error")
        load(offset, nbytes)

    store._load = flaky
    same(llm.generate(PROMPTS, SP, use_tqdm=False), want)
    assert failed and len(calls) > 3
    assert store.read_errors == 1
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_host_offload_copies_each_layer_in_for_its_forward(tmp_path):
    """--cpu-offload-gb (model/host_offload.py), its choreography on a CPU "device" (the copies are plain copies;
    the CUDA side stream, pinned memory and events are not exercised without a GPU): with a third of the weights
    offloaded, output equals the resident model's bit for bit; between forwards the offloaded parameters are the
    host tensors; each step copies every offloaded layer once, the next one launched when the previous starts;
    the diagnostics name the host as the source. On the CPU the engine refuses the flag itself."""
    from tokenmill import diagnostics as d
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.host_offload import HostOffload

    with pytest.raises(ValueError, match="on the CPU they are there already"):
        EngineArgs(cpu_offload_gb=1).create_engine_config().validate()
    path = make_tiny_model(tmp_path / "llama", "llama", **SIZE)
    want = LLM(str(path), **KW).generate(PROMPTS, SP, use_tqdm=False)
    llm = LLM(str(path), **KW)
    model = llm.engine.model
    store = HostOffload.attach(model, weight_bytes(llm) // 3, "cpu")
    layers = list(model.own_layers)
    assert store.streamed and store.streamed_bytes >= weight_bytes(llm) // 3
    seen = []  # during each offloaded layer's forward: are its parameters the device copies?
    for s in store.streamed:
        layers[s.index].register_forward_pre_hook(
            lambda mod, args, s=s: seen.append(all(p.data_ptr() != h.data_ptr() for p, h in zip(s.params, s.host))))
    copies = []  # layer copies made: their layers' indices among the offloaded
    copy = store._copy
    store._copy = lambda k: copies.append(k) or copy(k)
    out = llm.generate(PROMPTS, SP, use_tqdm=False)
    same(out, want)
    steps = len(seen) // len(store.streamed)
    assert steps > 1 and all(seen)
    assert len(copies) in (steps * len(store.streamed), steps * len(store.streamed) + 1)  # + next step's first
    for s in store.streamed:  # back on the host tensors between forwards
        assert all(p.data_ptr() == h.data_ptr() for p, h in zip(s.params, s.host))
    llm.engine.core.info.weights = store.describe()
    w = d.engine_diagnostics(llm.engine)["weights"]
    assert w["source"] == "host" and w["bound"] in ("host", "compute") and w["read_bytes_per_s"] > 0


@dataclass
class SlowDisk:
    """A test double for the stream file's reads: the real bytes, delivered at `rate` bytes/s (sleeping, so the
    GIL is free as a real read leaves it), with every byte counted. Slow enough that the machine's own speed is
    small against it."""
    rate: float
    bytes_read: int = 0

    def preadv(self, fd: int, buffers, offset: int) -> int:
        got = os.preadv(fd, buffers, offset)
        self.bytes_read += max(got, 0)
        time.sleep(max(got, 0) / self.rate)
        return got


def test_streamed_steps_overlap_a_slow_disk(tmp_path, monkeypatch):
    """Issue 50: a float model streamed from a slow disk runs each step within 1.3x of max(the streamed bytes at
    the measured read speed, the forward's compute), the bound the start-up log and /v1/diagnostics give. The
    reads are the slowed reader's (~50 ms per layer of a few MiB): every streamed byte of every step goes through
    it in large reads, none is left to the forward's page faults (which read 4 KiB at a time, ~10x below the
    disk's speed: the issue's 2.96 s of waiting against a 0.337 s bound). Each layer also computes ~15 ms (a sleep
    in its forward), so reads and compute are of a size and a step that did not overlap them would take ~1.5x.
    Float32 (bf16 weights on the CPU are oneDNN-packed, an opaque layout that stays resident)."""
    from tokenmill.model.weight_store import WeightStore

    path = make_tiny_model(tmp_path / "llama", "llama", **SIZE)
    total = weight_bytes(LLM(str(path), **KW))
    disk = SlowDisk(rate=50 * 2**20)
    monkeypatch.setattr(WeightStore, "preadv", staticmethod(disk.preadv))
    llm = LLM(str(path), **KW, weights_resident_gb=total / 3 / 2**30, weights_stream_dir=str(tmp_path))
    store = llm.engine.model.weight_store
    assert len(store.streamed) >= 4
    for layer in llm.engine.model.own_layers:
        layer.register_forward_pre_hook(lambda mod, args: time.sleep(0.015))
    before = disk.bytes_read
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps = list(llm.engine.stats.history)
    assert len(steps) >= 4
    # every step read each streamed layer through the reader (the first step's first layer was read at start-up)
    assert disk.bytes_read - before >= len(steps) * store.streamed_bytes - store.streamed[0].nbytes
    read_s = store.streamed_bytes / store.read_bytes_per_s  # the logged bound: ~50 ms a layer
    assert read_s >= 0.04 * len(store.streamed)
    # The 1.3x for the typical (median) step; every step within 2x (the bug was 10x), so that one step
    # a loaded machine descheduled for a while does not fail the test.
    ratios = sorted(s.forward_s / max(read_s, s.forward_s - s.weight_wait_s) for s in steps)
    assert ratios[len(ratios) // 2] <= 1.3 and ratios[-1] <= 2.0, ratios

"""CUDA graphs for decode steps (executor/cuda_graphs.py), checked on the CPU through their emulation
(TOKENMILL_CUDA_GRAPHS=emulate: a replay runs the captured body again over the same fixed buffers and metadata
views): padded batches, the pad block, fixed addresses, and tokens equal to transformers' whatever size a step
replays. triton_paged runs under TRITON_INTERPRET=1 (tests/conftest.py)."""
from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import pytest
import torch

from test_parity import check_against_oracle, hf_greedy, prompts_for
from tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import EngineArgs
from tokenmill.executor.cuda_graphs import GRAPHS_ENV, capture_sizes, graph_mode
from tokenmill.layers.attention_backends import BatchLayout, get_attention_backend

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is a test extra")
BACKEND = "triton_paged"


def test_capture_sizes_pad_a_batch_by_at_most_seven_rows_above_eight():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 3 + 32
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))


def test_graph_mode_follows_the_device_the_flag_and_the_env(monkeypatch):
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert graph_mode(torch.device("cpu"), False) is None  # no graphs on the CPU
    assert graph_mode(torch.device("cuda"), False) == "cuda"
    assert graph_mode(torch.device("cuda"), True) is None  # --enforce-eager
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert graph_mode(torch.device("cuda"), False) is None
    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    assert graph_mode(torch.device("cpu"), False) == "emulate"
    assert graph_mode(torch.device("cpu"), True) is None
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert EngineArgs.from_cli_args(parser.parse_args([])).enforce_eager is False


def test_buffers_take_a_step_and_pad_it_into_the_pad_block():
    backend = get_attention_backend(BACKEND, "cpu")(4, torch.device("cpu"))
    buf = backend.graph_buffers(8, 5, pad_block=9)
    addresses = [t.data_ptr() for t in (buf.slot_mapping, buf.block_table, buf.kv_len)]
    for B, P in ((3, 4), (1, 1), (8, 8), (2, 4)):
        table = np.arange(B * 3, dtype=np.int32).reshape(B, 3)
        kv = np.arange(1, B + 1) + 5
        t = torch.from_numpy
        slots = t(table[:, 1].astype(np.int64) * 4 + 1)
        layout = BatchLayout(query_start=t(np.arange(B)), query_len=t(np.ones(B, np.int64)), kv_len=t(kv),
                             block_table=t(table), slot_mapping=slots, num_tokens=B, max_query_len=1,
                             max_kv_len=int(kv.max()))
        buf.fill(layout, P)
        meta = buf.view(P)
        assert meta.slot_mapping.tolist() == slots.tolist() + [36] * (P - B)  # pad slot: block 9, offset 0
        assert meta.kv_len.tolist() == kv.tolist() + [1] * (P - B)
        assert meta.block_table[:B, :3].tolist() == table.tolist()
        assert meta.block_table[B:, 0].tolist() == [9] * (P - B)
        assert meta.tile_req.tolist() == list(range(P)) and meta.query_len.tolist() == [1] * P
    assert [t.data_ptr() for t in (buf.slot_mapping, buf.block_table, buf.kv_len)] == addresses
    with pytest.raises(ValueError, match="cannot take this step"):
        buf.fill(layout, 1)  # 2 requests into a graph of 1


def _llm(path, **kw):
    return LLM(str(path), max_model_len=128, num_gpu_blocks_override=64, block_size=16, attention_backend=BACKEND,
               max_num_batched_tokens=64, max_num_seqs=6, **kw)


def test_decode_batches_replay_padded_graphs_and_equal_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    path = make_tiny_model(tmp_path / "llama", "llama")
    llm = _llm(path)
    runner = llm.engine.core.executor.worker.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    # The pool holds one block past the scheduler's: the pad block.
    assert runner.kv_groups[0].layers[0].k_cache.shape[0] == runner.num_blocks + 1 == 65
    addresses = [graphs.input_ids.data_ptr(), graphs.positions.data_ptr(), graphs.buffers[0].block_table.data_ptr()]
    prompts = prompts_for(llm.engine.vocab_size)[:5]
    oracle = hf_greedy(path, prompts)
    # Different lengths: the running batch shrinks 5 -> 1 and replays graphs of 6, 4, 2 and 1 rows.
    lengths = [4, 6, 8, 10, 12]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in lengths],
                        use_tqdm=False)
    check_against_oracle(outs, [(t[:n], lp[:n]) for (t, lp), n in zip(oracle, lengths)], "graphs")
    stats = graphs.stats
    assert {6, 4, 2, 1} <= set(stats.by_size), stats
    assert stats.padded_rows > 0 and stats.replays == sum(stats.by_size.values())
    assert [graphs.input_ids.data_ptr(), graphs.positions.data_ptr(),
            graphs.buffers[0].block_table.data_ptr()] == addresses
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked


def test_the_same_tokens_with_graphs_and_without_under_sampling(tmp_path, monkeypatch):
    path = make_tiny_model(tmp_path / "llama", "llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    monkeypatch.setenv(GRAPHS_ENV, "0")
    llm = _llm(path)
    prompts = [{"prompt_token_ids": p} for p in prompts_for(llm.engine.vocab_size)[:3]]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    llm = _llm(path)
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphed == eager
    assert llm.engine.core.executor.worker.runner.graphs.stats.replays > 0


@pytest.mark.parametrize("kw, reason", [
    (dict(enforce_eager=True), None),
    (dict(attention_backend="torch_sdpa"), "no fixed-address metadata"),
    (dict(enable_lora=True, max_lora_rank=8), "LoRA adapters"),
])
def test_configurations_graphs_cannot_take_run_eagerly_and_say_why(tmp_path, monkeypatch, caplog, kw, reason):
    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    path = make_tiny_model(tmp_path / "llama", "llama")
    args = dict(max_model_len=128, num_gpu_blocks_override=64, block_size=16, attention_backend=BACKEND)
    args.update(kw)
    with caplog.at_level("INFO", logger="tokenmill.executor.worker"):
        llm = LLM(str(path), **args)
    runner = llm.engine.core.executor.worker.runner
    assert runner.graphs is None and runner.graph_mode is None
    if reason is not None:
        assert any("CUDA graphs off" in r.message and reason in r.message for r in caplog.records)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_moe_model_replays_graphs_only_on_the_sync_free_triton_path(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    path = make_tiny_model(tmp_path / "mixtral", "mixtral")
    monkeypatch.setenv("TOKENMILL_MOE_TRITON", "0")  # the grouped CPU path: expert counts go to the host
    with caplog.at_level("INFO", logger="tokenmill.executor.worker"):
        assert _llm(path).engine.core.executor.worker.runner.graphs is None
    assert any("MoE layers" in r.message for r in caplog.records)
    monkeypatch.setenv("TOKENMILL_MOE_TRITON", "1")  # moe_triton.py: routing stays on the device
    llm = _llm(path)
    prompts = prompts_for(llm.engine.vocab_size)[:3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3), use_tqdm=False)
    check_against_oracle(outs, [(t[:8], lp[:8]) for t, lp in hf_greedy(path, prompts)], "moe graphs")
    assert llm.engine.core.executor.worker.runner.graphs.stats.replays > 0


def test_a_model_with_sliding_window_layers_replays_with_a_table_per_kv_cache_group(tmp_path, monkeypatch):
    """Gemma 3: full and sliding-window layers in two KV cache groups, each with its fixed buffers; contexts grow
    past the window while the batch shrinks."""
    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    path = make_tiny_model(tmp_path / "gemma3", "gemma3", num_hidden_layers=4,
                           layer_types=["sliding_attention", "full_attention"] * 2)
    llm = _llm(path)
    runner = llm.engine.core.executor.worker.runner
    assert len(runner.kv_groups) == 2 and len(runner.graphs.buffers) == 2
    prompts = prompts_for(llm.engine.vocab_size)[2:5]  # 14, 21 and 30 tokens: past the window of 24 as they grow
    oracle = hf_greedy(path, prompts)
    lengths = [3, 6, 9]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in lengths],
                        use_tqdm=False)
    check_against_oracle(outs, [(t[:n], lp[:n]) for (t, lp), n in zip(oracle, lengths)], "gemma3 graphs")
    assert {4, 2, 1} <= set(runner.graphs.stats.by_size)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_speculative_decoding_replays_decodes_and_uniform_verifications(tmp_path, monkeypatch, method):
    """Graphs for 1 and k + 1 tokens per request: steps where every request verifies k drafts replay (an EAGLE head
    drafts k each step), as do steps with no drafts (n-gram lookups that find nothing); others run eagerly. The
    tokens are transformers' either way."""
    from draft_heads_tiny import write_eagle_head

    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    path = make_tiny_model(tmp_path / "llama", "llama")
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec["prompt_lookup_min"] = 2
    else:
        spec["model"] = str(write_eagle_head(tmp_path / "eagle", path, copy=False))
    llm = _llm(path, speculative_config=spec)
    runner = llm.engine.core.executor.worker.runner
    assert runner.graphs.query_lens == (1, 4)
    prompts = [p[:6] * 3 for p in prompts_for(llm.engine.vocab_size)[:2]]  # repeats for the n-gram lookup
    oracle = [(t[:9], lp[:9]) for t, lp in hf_greedy(path, prompts)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3), use_tqdm=False)
    check_against_oracle(outs, oracle, f"{method} + graphs")
    stats = runner.graphs.stats
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0 and stats.replays > 0
    if method == "eagle":
        assert stats.by_query_len.get(4, 0) > 0, stats
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_buffers_take_uniform_steps_of_several_tokens_per_request():
    backend = get_attention_backend(BACKEND, "cpu")(4, torch.device("cpu"))
    buf = backend.graph_buffers(4, 5, pad_block=9, max_query_len=3)
    B, P, q = 2, 4, 3
    t = torch.from_numpy
    table = np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int32)
    kv = np.array([7, 11])
    slots = t(np.arange(B * q, dtype=np.int64) + 100)
    layout = BatchLayout(query_start=t(np.arange(B) * q), query_len=t(np.full(B, q)), kv_len=t(kv),
                         block_table=t(table), slot_mapping=slots, num_tokens=B * q, max_query_len=q,
                         max_kv_len=11)
    buf.fill(layout, P)
    meta = buf.view(P, q)
    assert meta.slot_mapping.tolist() == list(range(100, 106)) + [36, 37, 38] * 2  # pad requests: the pad block
    assert meta.kv_len.tolist() == [7, 11, 3, 3] and meta.query_len.tolist() == [3] * 4
    assert meta.query_start.tolist() == [0, 3, 6, 9] and meta.tile_req.tolist() == [0, 1, 2, 3]
    assert meta.block_table[:B, :3].tolist() == table.tolist() and meta.block_table[B:, :3].tolist() == [[9] * 3] * 2
    assert backend.graph_buffers(4, 5, 9, max_query_len=17) is None  # more queries than a tile holds


def test_a_replay_sets_the_eagle3_aux_hidden_states_of_its_rows(tmp_path, monkeypatch):
    """EAGLE-3 targets keep the residual stream of some layers in model.aux_hidden_states, set by the forward: a
    replay sets it from the graph's output, equal to what the eager forward of the same step computes."""
    monkeypatch.setenv(GRAPHS_ENV, "emulate")
    path = make_tiny_model(tmp_path / "llama", "llama")
    llm = _llm(path)
    runner = llm.engine.core.executor.worker.runner
    runner.model.aux_hidden_layers = (0, 1)
    runner.capture_graphs(6, 8)  # again, now returning the aux states (decodes only)
    graphs, checked = runner.graphs, []
    replay = graphs.run

    def run(inp, size):
        hidden = replay(inp, size)
        aux = runner.model.aux_hidden_states
        eager = runner.model(inp.input_ids, inp.positions, runner._metadata(inp))  # same K/V rewritten
        torch.testing.assert_close(aux, runner.model.aux_hidden_states)
        torch.testing.assert_close(hidden, eager)
        checked.append(aux.shape[0])
        return hidden

    monkeypatch.setattr(graphs, "run", run)
    prompts = prompts_for(llm.engine.vocab_size)[:3]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)], use_tqdm=False)
    assert {3, 2, 1} <= set(checked)

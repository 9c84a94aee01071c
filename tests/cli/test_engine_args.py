"""EngineArgs is the one source of engine settings: argparse flags, LLM(**kw) and EngineConfig come from it."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import pytest

import tokenmill.llm
from tokenmill.cli import build_parser, main
from tokenmill.config import EngineConfig, KVTransferConfig, LoRAConfig, SpeculativeConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.llm import LLM, parse_prompts

# Each field: command-line words giving it a non-default value, that value, and where EngineConfig keeps it.
ROUND_TRIP = {
    "model": (["some/model"], "some/model", "model.model"),
    "tokenizer": (["--tokenizer", "tok"], "tok", "model.tokenizer"),
    "revision": (["--revision", "v1.0"], "v1.0", "model.revision"),
    "download_dir": (["--download-dir", "/var/tmp/hf"], "/var/tmp/hf", "model.download_dir"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16", "model.dtype"),
    "max_model_len": (["--max-model-len", "300"], 300, "model.max_model_len"),
    "seed": (["--seed", "7"], 7, "model.seed"),
    "quantization": (["--quantization", "int4"], "int4", "model.quantization"),
    "quantization_group_size": (["--quantization-group-size", "64"], 64, "model.quantization_group_size"),
    "activation_quantization": (["--activation-quantization", "int8"], "int8", "model.activation_quantization"),
    "quantized_batch_dtype": (["--quantized-batch-dtype", "bfloat16"], "bfloat16", "model.quantized_batch_dtype"),
    "decode_context_parallel_size": (["--decode-context-parallel-size", "2"], 2,
                                     "parallel.decode_context_parallel_size"),
    "prefill_context_parallel_size": (["--prefill-context-parallel-size", "2"], 2,
                                      "parallel.prefill_context_parallel_size"),
    "weights_resident_gb": (["--weights-resident-gb", "1.5"], 1.5, "model.weights_resident_gb"),
    "weights_stream_dir": (["--weights-stream-dir", "/var/tmp/w"], "/var/tmp/w", "model.weights_stream_dir"),
    "cpu_offload_gb": (["--cpu-offload-gb", "4"], 4.0, "model.cpu_offload_gb"),
    "pooling": (["--pooling", "mean"], "mean", "model.pooling"),
    "device": (["--device", "cuda"], "cuda", "device"),
    "attention_backend": (["--attention-backend", "torch_sdpa"], "torch_sdpa", "attention_backend"),
    "enforce_eager": (["--enforce-eager"], True, "enforce_eager"),
    "block_size": (["--block-size", "32"], 32, "cache.block_size"),
    "kv_cache_dtype": (["--kv-cache-dtype", "float16"], "float16", "cache.kv_cache_dtype"),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False, "cache.enable_prefix_caching"),
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes", "512M"], 512 << 20, "cache.kv_cache_memory_bytes"),
    "kv_cache_memory_fraction": (["--kv-cache-memory-fraction", "0.5"], 0.5, "cache.kv_cache_memory_fraction"),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.8"], 0.8, "cache.gpu_memory_utilization"),
    "num_gpu_blocks_override": (["--num-gpu-blocks-override", "99"], 99, "cache.num_gpu_blocks_override"),
    "kv_offload_bytes": (["--kv-offload-bytes", "2G"], 2 << 30, "cache.kv_offload_bytes"),
    "kv_offload_dir": (["--kv-offload-dir", "/tmp/kv"], "/tmp/kv", "cache.kv_offload_dir"),
    "kv_offload_disk_bytes": (["--kv-offload-disk-bytes", "1G"], 1 << 30, "cache.kv_offload_disk_bytes"),
    "kv_offload_group_blocks": (["--kv-offload-group-blocks", "4"], 4, "cache.kv_offload_group_blocks"),
    "kv_offload_min_blocks": (["--kv-offload-min-blocks", "3"], 3, "cache.kv_offload_min_blocks"),
    "max_num_seqs": (["--max-num-seqs", "12"], 12, "scheduler.max_num_seqs"),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "512"], 512, "scheduler.max_num_batched_tokens"),
    "long_prefill_token_threshold": (["--long-prefill-token-threshold", "256"], 256,
                                     "scheduler.long_prefill_token_threshold"),
    "max_long_partial_prefills": (["--max-long-partial-prefills", "3"], 3, "scheduler.max_long_partial_prefills"),
    "scheduling_policy": (["--scheduling-policy", "priority"], "priority", "scheduler.policy"),
    "slo_shed": (["--slo-shed"], True, "scheduler.slo_shed"),
    "disable_hybrid_kv_cache_manager": (["--disable-hybrid-kv-cache-manager"], True,
                                        "scheduler.disable_hybrid_kv_cache_manager"),
    "tensor_parallel_size": (["-tp", "2"], 2, "parallel.tensor_parallel_size"),
    "pipeline_parallel_size": (["--pipeline-parallel-size", "3"], 3, "parallel.pipeline_parallel_size"),
    "distributed_executor_backend": (["--distributed-executor-backend", "mp"], "mp",
                                     "parallel.distributed_executor_backend"),
    "enable_expert_parallel": (["--enable-expert-parallel"], True, "parallel.enable_expert_parallel"),
    "kv_transfer_config": (["--kv-transfer-config", '{"kv_role": "kv_both"}'], '{"kv_role": "kv_both"}',
                           "kv_transfer"),
    "enable_lora": (["--enable-lora"], True, "lora"),
    "max_loras": (["--max-loras", "2"], 2, "lora.max_loras"),
    "max_lora_rank": (["--max-lora-rank", "8"], 8, "lora.max_lora_rank"),
    "max_cpu_loras": (["--max-cpu-loras", "4"], 4, "lora.max_cpu_loras"),
    "speculative_config": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                           '{"method": "ngram", "num_speculative_tokens": 2}', "speculative"),
}
# Fields whose config value is parsed from the argument's.
CONFIG_VALUES = {"speculative_config": SpeculativeConfig("ngram", 2), "kv_transfer_config": KVTransferConfig("kv_both"),
                 "enable_lora": LoRAConfig(2, 8, 4)}
NAMES = [f.name for f in fields(EngineArgs)]


def engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def lookup(config: EngineConfig, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


class FakeEngine:
    """Stands in for LLMEngine: keeps the config instead of loading a model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.setattr(tokenmill.llm, "LLMEngine", FakeEngine)


@pytest.fixture
def no_validation(monkeypatch):
    """Lets tp/pp > 1 through, to check that they are carried; validation has its own tests."""
    monkeypatch.setattr(EngineConfig, "validate", lambda self: None)


# ---- generated from the fields -------------------------------------------------------------------
def test_every_field_has_a_default_and_help():
    for f in fields(EngineArgs):
        assert f.default is not MISSING, f.name
        assert f.metadata["help"], f.name


def test_cli_defaults_equal_dataclass_defaults():
    defaults = EngineArgs()
    args = engine_parser().parse_args([])
    assert EngineArgs.from_cli_args(args) == defaults
    for name in NAMES:
        assert getattr(args, name) == getattr(defaults, name), name
    # The subcommands carry the same defaults.
    for argv in (["generate", "--prompt", "x"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "latency"]):
        assert EngineArgs.from_cli_args(build_parser().parse_args(argv)) == defaults, argv


def test_every_field_has_a_flag():
    parser = engine_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    dests = {a.dest for a in parser._actions}
    for name in NAMES:
        assert f"--{name.replace('_', '-')}" in options and name in dests, name
    assert {"-tp", "-pp", "--no-enable-prefix-caching", "model_pos"} <= options | dests


def test_round_trip_table_covers_every_field():
    assert set(ROUND_TRIP) == set(NAMES), "a new EngineArgs field needs a row here and a line in create_engine_config"


def test_cli_to_engine_config_carries_every_value(no_validation):
    argv = [word for words, _, _ in ROUND_TRIP.values() for word in words]
    engine_args = EngineArgs.from_cli_args(engine_parser().parse_args(argv))
    config = engine_args.create_engine_config()
    for name, (_, value, path) in ROUND_TRIP.items():
        assert getattr(engine_args, name) == value, name
        assert lookup(config, path) == CONFIG_VALUES.get(name, value), name


def test_llm_kwargs_reach_the_engine_config(fake_engine, no_validation):
    kwargs = {name: value for name, (_, value, _) in ROUND_TRIP.items()}
    llm = LLM(**kwargs)
    for name, (_, value, path) in ROUND_TRIP.items():
        assert lookup(llm.engine.config, path) == CONFIG_VALUES.get(name, value), name
    assert llm.engine.config == EngineArgs(**kwargs).create_engine_config()


def test_llm_defaults(fake_engine):
    config = LLM("m").engine.config
    assert config == EngineArgs(model="m").create_engine_config()
    assert config.parallel.distributed_executor_backend == "uni"  # None resolves by world size


def test_model_positional_or_flag():
    parse = engine_parser().parse_args
    assert EngineArgs.from_cli_args(parse(["--model", "a"])).model == "a"
    assert EngineArgs.from_cli_args(parse(["a", "--model", "a"])).model == "a"
    with pytest.raises(ValueError, match="two different models"):
        EngineArgs.from_cli_args(parse(["a", "--model", "b"]))


# ---- bad values ----------------------------------------------------------------------------------
def test_unknown_llm_kwarg_names_it_and_suggests(fake_engine):
    with pytest.raises(TypeError, match="'max_len'.*did you mean 'max_model_len'"):
        LLM("m", max_len=128)
    with pytest.raises(TypeError, match="'frobnicate'"):
        LLM("m", frobnicate=True)


@pytest.mark.parametrize("kwargs, words", [
    (dict(block_size=-1), ["block_size", "at least 1", "-1"]),
    (dict(max_num_seqs=0), ["max_num_seqs", "at least 1"]),
    (dict(max_num_batched_tokens=-4), ["max_num_batched_tokens"]),
    (dict(long_prefill_token_threshold=-1), ["long_prefill_token_threshold", "negative"]),
    (dict(max_long_partial_prefills=0), ["max_long_partial_prefills", "at least 1"]),
    (dict(max_model_len=0), ["max_model_len", "at least 1"]),
    (dict(kv_cache_memory_bytes=-5), ["kv_cache_memory_bytes"]),
    (dict(num_gpu_blocks_override=0), ["num_gpu_blocks_override"]),
    (dict(kv_offload_bytes=-1), ["kv_offload_bytes", "negative"]),
    (dict(kv_offload_disk_bytes=-1), ["kv_offload_disk_bytes", "negative"]),
    (dict(kv_offload_group_blocks=0), ["kv_offload_group_blocks"]),
    (dict(gpu_memory_utilization=1.5), ["gpu_memory_utilization", "(0, 1]", "1.5"]),
    (dict(gpu_memory_utilization=0.0), ["gpu_memory_utilization", "(0, 1]"]),
    (dict(kv_cache_memory_fraction=2.0), ["kv_cache_memory_fraction", "(0, 1]"]),
    (dict(kv_cache_dtype="fp4"), ["kv_cache_dtype", "'fp4'", "int8", "fp8_e4m3"]),
    (dict(scheduling_policy="lifo"), ["policy", "'lifo'"]),
    (dict(tensor_parallel_size=0), ["tensor_parallel_size", "at least 1"]),
    (dict(pipeline_parallel_size=-1), ["pipeline_parallel_size", "at least 1"]),
    (dict(pipeline_parallel_size=2, speculative_config='{"method": "ngram"}'), ["pipeline parallelism"]),
    (dict(distributed_executor_backend="slurm"), ["distributed_executor_backend", "'slurm'"]),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), ["'uni' runs one worker"]),
    (dict(kv_offload_bytes=1 << 20, enable_prefix_caching=False), ["prefix caching"]),
])
def test_bad_values(kwargs, words):
    with pytest.raises(ValueError) as e:
        EngineArgs(**kwargs).create_engine_config()
    for word in words:
        assert word in str(e.value)


def test_cli_rejects_bad_values(tmp_path, capsys):
    def run(argv: list[str]) -> int:
        try:
            return main(argv)
        except SystemExit as e:  # argparse usage errors
            return e.code

    # Validation runs before the model loads: an empty folder never gets that far.
    assert run(["generate", str(tmp_path), "--prompt", "x", "-pp", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pipeline_parallel_size must be at least 1") and len(err.strip().splitlines()) == 1
    for flags in (["--kv-cache-memory-bytes", "12Q"], ["--kv-cache-dtype", "fp4"], ["--block-size", "x"]):
        assert run(["generate", str(tmp_path), "--prompt", "x", *flags]) == 2
        assert flags[0] in capsys.readouterr().err


def test_engine_core_process_is_a_serve_flag_only():
    parse = build_parser().parse_args
    assert parse(["serve"]).engine_core_process is True
    assert parse(["serve", "--no-engine-core-process"]).engine_core_process is False
    assert not hasattr(parse(["generate", "--prompt", "x"]), "engine_core_process")
    assert "engine_core_process" not in NAMES


# ---- LLM.generate's prompt shapes ----------------------------------------------------------------
def test_prompt_shapes():
    assert parse_prompts("hi") == [("hi", None)]
    assert parse_prompts([5, 6]) == [(None, [5, 6])]
    assert parse_prompts({"prompt": "hi"}) == [("hi", None)]
    assert parse_prompts({"prompt_token_ids": [5, 6]}) == [(None, [5, 6])]
    assert parse_prompts(["a", [1, 2], {"prompt": "b"}, {"prompt_token_ids": (3,)}, (4, 5)]) == [
        ("a", None), (None, [1, 2]), ("b", None), (None, [3]), (None, [4, 5])]
    assert parse_prompts([[1], [2, 3]]) == [(None, [1]), (None, [2, 3])]
    assert parse_prompts([]) == []


def test_numpy_token_ids_become_ints():
    np = pytest.importorskip("numpy")
    ((text, ids),) = parse_prompts({"prompt_token_ids": list(np.array([7, 8]))})
    assert text is None and ids == [7, 8] and all(type(t) is int for t in ids)


@pytest.mark.parametrize("prompt, words", [
    ({}, ["exactly one of 'prompt' or 'prompt_token_ids'", "neither"]),
    ({"prompt": "a", "prompt_token_ids": [1]}, ["exactly one of", "'prompt', 'prompt_token_ids'"]),
    ({"prompt_token_ids": ["a", "b"]}, ["token ids must be ints", "'a'"]),
    ({"prompt_token_ids": [1, 2.5]}, ["token ids must be ints", "2.5"]),
    ({"prompt_token_ids": [True]}, ["token ids must be ints"]),
    ({"prompt_token_ids": []}, ["non-empty"]),
    ({"prompt_token_ids": "abc"}, ["list of ints"]),
    ({"prompt": [1, 2]}, ["'prompt' must be a string"]),
    ({"prompt": "a", "multi_modal_data": {}}, ["unsupported key", "multi_modal_data"]),
    ([None], ["expected text, a list of token ids"]),
    (["ok", {}], ["prompt 1:"]),
])
def test_bad_prompt_shapes(prompt, words):
    with pytest.raises(ValueError) as e:
        parse_prompts(prompt)
    for word in words:
        assert word in str(e.value)

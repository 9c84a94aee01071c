"""The quantization-method registry (layers/quantization/registry.py) and the embedding table methods.

- `--quantization NAME` resolves through the registry: an unknown name (or a checkpoint format without a
  flag of its own) is a ValueError listing every registered flag; every registered name builds a config of
  that name; QUANTIZATION_METHODS / CHECKPOINT_METHODS are the registry's at-load / flag-checkpoint names.
- Every registered checkpoint format parses a minimal config.json entry, and the flag its config is named
  after is accepted for that checkpoint by resolve_quantization (the flag the mismatch error suggests).
- A method registered from outside (here, by the test) is found by name and by quant_method, listed, and
  gone again once unregistered; a second registration of a name is refused.
- The embedding / LM head read their table through `table_method`: float by default, int8 rows after
  quantize_int8 (a tied embedding shares them), and any EmbeddingMethod set on the module.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tokenmill.layers.quantization as quantization
from tokenmill.layers.embedding import EmbeddingMethod, FloatTable, Int8Rows, ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.quantization import get_quantization_config, registry
from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.layers.quantization.checkpoint import CheckpointFormat, checkpoint_quant_config, resolve_quantization
from tokenmill.layers.quantization.weight_only import dequantize_int8, quantize_int8

# A minimal valid quantization_config per checkpoint format: a new format needs one here (the test says so).
CHECKPOINT_SAMPLES = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "compressed-tensors": {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
    "tokenmill": {"quant_method": "tokenmill", "method": "int4", "group_size": 64, "symmetric": True},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]},
}


class _TestConfig(QuantizationConfig):
    def __init__(self, name: str, group_size: int, int8_activations: bool) -> None:
        self.name, self.group_size, self.int8_activations = name, group_size, int8_activations

    def get_quant_method(self, layer, prefix):
        return None


# ---------------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------------

def test_unknown_names_list_the_registered_ones():
    flags = registry.flag_names()
    assert {"int8", "int4", "gguf", "gptq", "awq", "fp8"} <= set(flags)
    for name in ("int3", "compressed-tensors", "tokenmill", "INT8"):  # formats without a flag; names are exact
        with pytest.raises(ValueError, match=f"unknown quantization method {name!r}") as err:
            get_quantization_config(name)
        assert str(err.value).endswith(f"known: {', '.join(flags)}, none.")
    with pytest.raises(ValueError, match=r"quant_method 'bitsandbytes' is not supported") as err:
        checkpoint_quant_config({"quant_method": "bitsandbytes"}, "m")
    listed = str(err.value).rpartition("(")[2]
    for method in registry.methods("checkpoint"):
        assert method.name in listed
    with pytest.raises(ValueError, match=r"quant_method 'int8' is not supported"):  # an at-load name
        checkpoint_quant_config({"quant_method": "int8"}, "m")


def test_views_follow_the_registry():
    assert quantization.QUANTIZATION_METHODS == ("int8", "int4", "gguf")
    assert quantization.CHECKPOINT_METHODS == ("gptq", "awq", "fp8", "mxfp4")
    from tokenmill.layers.quantization import checkpoint

    assert checkpoint.CHECKPOINT_METHODS == quantization.CHECKPOINT_METHODS
    assert set(quantization.QUANTIZATION_METHODS + quantization.CHECKPOINT_METHODS) == set(registry.flag_names())


@pytest.mark.parametrize("name", registry.flag_names())
def test_every_flag_round_trips(name):
    config = get_quantization_config(name, 64, activations="int8")
    assert config.name == name
    if registry.get_method(name).kind == "checkpoint":
        assert isinstance(config, CheckpointFormat)  # resolved against config.json at load
    else:
        assert not isinstance(config, CheckpointFormat)
        assert config.int8_activations  # the options reach the method's config


def test_every_checkpoint_format_parses_and_its_flag_agrees():
    formats = {m.name for m in registry.methods("checkpoint")}
    assert formats == set(CHECKPOINT_SAMPLES), "add a sample quantization_config for each registered format"
    for name, raw in CHECKPOINT_SAMPLES.items():
        found = checkpoint_quant_config(dict(raw, quant_method=name.upper()), "m")  # quant_method: any case
        assert type(found) is type(registry.get_checkpoint_method(name, "m").parse(raw, "m"))
        hf = SimpleNamespace(quantization_config=raw)
        flag = get_quantization_config(found.name, 64)
        assert resolve_quantization(hf, flag, "m").name == found.name
        assert resolve_quantization(hf, None, "m").name == found.name
    other = get_quantization_config("awq")
    with pytest.raises(ValueError, match=r"already quantized \(gptq.*--quantization awq does not apply"):
        resolve_quantization(SimpleNamespace(quantization_config=CHECKPOINT_SAMPLES["gptq"]), other, "m")
    with pytest.raises(ValueError, match="--quantization awq needs a pre-quantized checkpoint"):
        resolve_quantization(SimpleNamespace(), other, "m")


def test_parse_errors_name_the_format():
    cases = [({"quant_method": "gptq", "bits": 8}, r"gptq with bits=8 is not supported"),
             ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"AWQ version 'gemv'"),
             ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two positive ints"),
             ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
              r"block-wise fp8 with activation_scheme 'static'"),
             ({"quant_method": "compressed-tensors"}, r"compressed-tensors without config_groups"),
             (dict(CHECKPOINT_SAMPLES["compressed-tensors"], ignore=["re:.*lm_head"]), r"regex ignore patterns")]
    for raw, pattern in cases:
        with pytest.raises(ValueError, match=r"^quantization_config of 'ckpt': .*" + pattern):
            checkpoint_quant_config(raw, "ckpt")


# ---------------------------------------------------------------------------------------------------
# Registering from outside
# ---------------------------------------------------------------------------------------------------

def test_a_registered_method_is_found_by_name_then_removed():
    @registry.quantize_at_load("test-int2")
    def build(options: registry.QuantOptions) -> _TestConfig:
        return _TestConfig("test-int2", options.group_size, options.int8_activations)

    @registry.checkpoint_format("test-format", flag=False)
    def parse(raw: dict, where: str) -> _TestConfig:
        if raw.get("bits") != 2:
            raise ValueError(f"{where}: test-format needs bits=2")
        return _TestConfig("test-int2", 128, False)

    try:
        config = get_quantization_config("test-int2", 64, activations="int8")
        assert isinstance(config, _TestConfig) and (config.group_size, config.int8_activations) == (64, True)
        assert "test-int2" in quantization.QUANTIZATION_METHODS
        with pytest.raises(ValueError, match=r"'int3'; known: .*test-int2, .*none\."):
            get_quantization_config("int3")
        found = checkpoint_quant_config({"quant_method": "Test-Format", "bits": 2}, "m")
        assert isinstance(found, _TestConfig)
        with pytest.raises(ValueError, match=r"^quantization_config of 'm': test-format needs bits=2"):
            checkpoint_quant_config({"quant_method": "test-format", "bits": 3}, "m")
        # The flag its config is named after applies to such a checkpoint; its own name is no flag.
        hf = SimpleNamespace(quantization_config={"quant_method": "test-format", "bits": 2})
        assert isinstance(resolve_quantization(hf, config, "m"), _TestConfig)
        with pytest.raises(ValueError, match="unknown quantization method 'test-format'"):
            get_quantization_config("test-format")
        with pytest.raises(ValueError, match="already registered"):
            registry.quantize_at_load("int8")(build)
    finally:
        registry.unregister_method("test-int2")
        registry.unregister_method("test-format")
    assert "test-int2" not in quantization.QUANTIZATION_METHODS
    with pytest.raises(ValueError, match="unknown quantization method 'test-int2'"):
        get_quantization_config("test-int2")
    with pytest.raises(ValueError, match="quant_method 'test-format' is not supported"):
        checkpoint_quant_config({"quant_method": "test-format", "bits": 2}, "m")
    assert registry.get_method("int8").kind == "at_load"  # the refused duplicate left the real one in place


# ---------------------------------------------------------------------------------------------------
# Embedding / LM head table methods
# ---------------------------------------------------------------------------------------------------

def _loaded(cls, table: torch.Tensor):
    m = cls(*table.shape)
    m.weight.weight_loader(m.weight, table)
    return m


def test_int8_rows_replace_the_float_table_for_head_and_tied_embedding():
    V, D = 13, 8
    g = torch.Generator().manual_seed(3)
    table, hidden, ids = torch.randn(V, D, generator=g), torch.randn(2, D, generator=g), torch.tensor([[0, 12, 5]])
    emb = _loaded(VocabParallelEmbedding, table)
    head = ParallelLMHead(V, D).tie_weights(emb)
    assert isinstance(emb.table_method, FloatTable) and isinstance(head.table_method, FloatTable)
    assert not head.int8_activations
    head.quantize_int8(emb, int8_activations=True)
    assert isinstance(head.table_method, Int8Rows) and isinstance(emb.table_method, Int8Rows)
    assert head.int8_activations and not emb.int8_activations  # a lookup has no activations
    assert emb.qweight is head.qweight and not hasattr(head, "weight")
    deq = dequantize_int8(*quantize_int8(table))
    torch.testing.assert_close(emb(ids), F.embedding(ids, deq), rtol=0, atol=0)
    head.table_method = Int8Rows(int8_activations=False)  # the float-activation path: x @ deq^T
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ deq.T, rtol=1e-5, atol=1e-5)


def test_a_module_reads_its_table_through_any_embedding_method():
    class Negated(EmbeddingMethod):  # a stand-in for a new packed format: the module defers to it
        def lookup(self, module, input_ids):
            return -F.embedding(input_ids, module.weight)

        def logits(self, module, hidden):
            return -(hidden @ module.weight.T).float()

    table = torch.arange(12.0).reshape(4, 3)
    emb, head = _loaded(VocabParallelEmbedding, table), _loaded(ParallelLMHead, table)
    ids, hidden = torch.tensor([3, 1]), torch.ones(1, 3)
    torch.testing.assert_close(emb(ids), table[ids], rtol=0, atol=0)
    emb.table_method = head.table_method = Negated()
    torch.testing.assert_close(emb(ids), -table[ids], rtol=0, atol=0)
    torch.testing.assert_close(head.compute_logits(hidden), -(hidden @ table.T), rtol=0, atol=0)

"""Pre-quantized checkpoints: the `quantization_config` of config.json picks the quant method (as vLLM
does), and `--quantization` must agree with it.

The formats are the registry's checkpoint methods (registry.py), each validated by its own parse function
next to its config class: "gptq" and "awq" (gptq_awq.py: bits 4; GPTQ desc_act true or false, AWQ version
gemm), "fp8" (per-tensor or per-channel weight scales, no block-wise scales) and "compressed-tensors" when
every config group is float 8-bit weights with a tensor or channel strategy (fp8.py), and "tokenmill"
(packed.py, written by `tokenmill quantize`).
"""
from __future__ import annotations

from tokenmill.layers.quantization import registry
from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase
from tokenmill.model.hf_config import hf_get


def __getattr__(name: str) -> tuple[str, ...]:
    # Computed per access, so a format registered after this module was imported is listed too.
    if name == "CHECKPOINT_METHODS":  # --quantization names that only describe a checkpoint (quantize nothing)
        return registry.checkpoint_flag_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CheckpointFormat(QuantizationConfig):
    """`--quantization gptq|awq|fp8`: a claim about the checkpoint, resolved against its config.json by
    `resolve_quantization` (load_model) into the real config."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get_quant_method(self, layer, prefix: str) -> QuantizeMethodBase | None:
        raise RuntimeError(f"--quantization {self.name} needs the checkpoint's quantization_config: "
                           "resolve_quantization() was not called")


def resolve_quantization(hf_config, requested: QuantizationConfig | None, path: str) -> QuantizationConfig | None:
    """The config to build the model with: the checkpoint's own when it has one (the flag, if given, must
    name the same method), else the flag's."""
    raw = hf_get(hf_config, "quantization_config")  # pre-quantized checkpoints only
    if raw is None:
        if isinstance(requested, CheckpointFormat):
            raise ValueError(f"--quantization {requested.name} needs a pre-quantized checkpoint, but the config.json "
                             f"of {path!r} has no quantization_config")
        return requested
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    found = checkpoint_quant_config(raw, path)
    if requested is not None and requested.name != found.name:
        raise ValueError(f"{path!r} is already quantized ({found.name}, from quantization_config in config.json); "
                         f"--quantization {requested.name} does not apply to it: drop the flag or pass "
                         f"--quantization {found.name}")
    return found


def checkpoint_quant_config(raw: dict, path: str = "?") -> QuantizationConfig:
    """The config a checkpoint's quantization_config dict describes; ValueError naming what is unsupported."""
    where = f"quantization_config of {path!r}"
    return registry.get_checkpoint_method(str(raw.get("quant_method", "")).lower(), where).parse(raw, where)

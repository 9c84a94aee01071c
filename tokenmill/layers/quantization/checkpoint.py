"""Pre-quantized checkpoints: the `quantization_config` of config.json picks the quant method (as vLLM
does), and `--quantization` must agree with it.

Supported quant_method values: "gptq" (bits 4, desc_act true or false), "awq" (bits 4, version gemm), "fp8"
(per-tensor weight scales, no block-wise scales), "compressed-tensors" when every config group is
float 8-bit weights with a tensor or channel strategy, and "tokenmill" (written by `tokenmill quantize`).
"""
from __future__ import annotations

from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase

# --quantization names that only describe a checkpoint (they quantize nothing at load).
CHECKPOINT_METHODS = ("gptq", "awq", "fp8")


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
    raw = getattr(hf_config, "quantization_config", None)
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
    method = str(raw.get("quant_method", "")).lower()
    where = f"quantization_config of {path!r}"
    if method in ("gptq", "awq"):
        from tokenmill.layers.quantization.gptq_awq import Int4CheckpointConfig

        bits = raw.get("bits", raw.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{where}: {method} with bits={bits!r} is not supported (4 bits only)")
        group = int(raw.get("group_size", raw.get("q_group_size", 128)))
        if raw.get("lm_head") or raw.get("dynamic"):
            raise ValueError(f"{where}: a quantized lm_head or per-module 'dynamic' overrides are not supported")
        ignored = tuple(raw.get("modules_to_not_convert") or ())
        if method == "gptq":
            fmt = str(raw.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
            return Int4CheckpointConfig("gptq", group, zero_plus_one=fmt == "gptq", ignored=ignored,
                                        act_order=bool(raw.get("desc_act")))
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {version!r} is not supported (gemm only)")
        if raw.get("zero_point") is False:
            raise ValueError(f"{where}: AWQ with zero_point=false is not supported (qzeros are expected)")
        return Int4CheckpointConfig("awq", group, ignored=ignored)
    if method == "fp8":
        from tokenmill.layers.quantization.fp8 import Fp8Config

        if raw.get("weight_block_size"):
            raise ValueError(f"{where}: block-wise fp8 (weight_block_size {raw['weight_block_size']}) is not "
                             "supported; per-tensor or per-channel scales only")
        return Fp8Config(tuple(raw.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(raw, where)
    if method == "tokenmill":
        from tokenmill.layers.quantization.packed import PackedConfig

        return PackedConfig(str(raw.get("method")), int(raw.get("group_size") or 32), bool(raw.get("symmetric")))
    raise ValueError(f"{where}: quant_method {method!r} is not supported "
                     "(gptq, awq, fp8, compressed-tensors fp8, tokenmill)")


def _compressed_tensors_fp8(raw: dict, where: str) -> QuantizationConfig:
    from tokenmill.layers.quantization.fp8 import Fp8Config

    groups = raw.get("config_groups") or {}
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type")) != (8, "float") or w.get("strategy") not in ("tensor", "channel"):
            raise ValueError(f"{where}: compressed-tensors group {name!r} ({w}) is not supported: only float 8-bit "
                             "weights with a tensor or channel strategy")
        if group.get("targets") not in (["Linear"], None):
            raise ValueError(f"{where}: compressed-tensors group {name!r} targets {group.get('targets')}; only "
                             "['Linear'] is supported")
    if not groups:
        raise ValueError(f"{where}: compressed-tensors without config_groups")
    ignored = tuple(i for i in raw.get("ignore") or () if not i.startswith("re:"))
    if len(ignored) != len(raw.get("ignore") or ()):
        raise ValueError(f"{where}: compressed-tensors regex ignore patterns are not supported")
    return Fp8Config(ignored)

from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.checkpoint import CHECKPOINT_METHODS, CheckpointFormat
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

# --quantization names: weights quantized at load from a float checkpoint.
QUANTIZATION_METHODS = ("int8", "int4")


def get_quantization_config(name: str | None, group_size: int = 32, symmetric: bool = False) -> QuantizationConfig | None:
    """The config for `--quantization NAME` (None: unquantized); ValueError naming the known methods."""
    if name is None or name in ("", "none"):
        return None
    if name in CHECKPOINT_METHODS:  # pre-quantized: load_model reads the rest from config.json
        return CheckpointFormat(name)
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {name!r}; known: "
                         f"{', '.join(QUANTIZATION_METHODS + CHECKPOINT_METHODS)}.")
    from tokenmill.layers.quantization.weight_only import WeightOnlyConfig

    return WeightOnlyConfig(name, group_size, symmetric)


__all__ = ["CHECKPOINT_METHODS", "QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase",
           "UnquantizedLinearMethod", "get_quantization_config", "set_weight_attrs"]

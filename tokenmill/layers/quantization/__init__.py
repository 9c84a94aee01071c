from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

# --quantization names: int8/int4 quantize a float checkpoint at load; gguf keeps a GGUF file's blocks.
QUANTIZATION_METHODS = ("int8", "int4", "gguf")


def get_quantization_config(name: str | None, group_size: int = 32, symmetric: bool = False, *,
                            model: str | None = None) -> QuantizationConfig | None:
    """The config for `--quantization NAME` (None: unquantized); ValueError naming the known methods.
    A .gguf `model` with no method named gets "gguf" (its blocks kept); "none" dequantizes it at load."""
    if name is None and model is not None and str(model).endswith(".gguf"):
        name = "gguf"
    if name is None or name in ("", "none"):
        return None
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {name!r}; known: {', '.join(QUANTIZATION_METHODS)}.")
    if name == "gguf":
        from tokenmill.layers.quantization.gguf import GGUFConfig

        return GGUFConfig()
    from tokenmill.layers.quantization.weight_only import WeightOnlyConfig

    return WeightOnlyConfig(name, group_size, symmetric)


__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase", "UnquantizedLinearMethod",
           "get_quantization_config", "set_weight_attrs"]

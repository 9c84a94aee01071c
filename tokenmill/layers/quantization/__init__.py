from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.checkpoint import CHECKPOINT_METHODS, CheckpointFormat
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

# --quantization names: int8/int4 quantize a float checkpoint at load; gguf keeps a GGUF file's blocks.
QUANTIZATION_METHODS = ("int8", "int4", "gguf")


def get_quantization_config(name: str | None, group_size: int = 32, symmetric: bool = False, *,
                            model: str | None = None, device: str = "cpu",
                            activations: str = "none") -> QuantizationConfig | None:
    """The config for `--quantization NAME` (None: unquantized); ValueError naming the known methods.
    A .gguf `model` with no method named gets "gguf" (its blocks kept) where the block kernels run (the CPU
    with tokenmill's native kernels built); elsewhere, and with "none", it is dequantized at load: the
    kernel-less path of "gguf" dequantizes the weights at every call, the reference, not a default.
    `activations` "int8" asks the packed-weight kernels for int8 activations at batch 1 (GGUF, int8, int4);
    other methods ignore it."""
    from tokenmill.config import ACTIVATION_QUANTIZATIONS

    if activations not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"unknown activation quantization {activations!r}; known: {', '.join(ACTIVATION_QUANTIZATIONS)}.")
    if name is None and model is not None and str(model).endswith(".gguf") and _gguf_kernels(device):
        name = "gguf"
    if name is None or name in ("", "none"):
        return None
    if name in CHECKPOINT_METHODS:  # pre-quantized: load_model reads the rest from config.json
        return CheckpointFormat(name)
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {name!r}; known: "
                         f"{', '.join(QUANTIZATION_METHODS + CHECKPOINT_METHODS)}, none.")
    if name == "gguf":
        from tokenmill.layers.quantization.gguf import GGUFConfig

        return GGUFConfig(int8_activations=activations == "int8")
    from tokenmill.layers.quantization.weight_only import WeightOnlyConfig

    return WeightOnlyConfig(name, group_size, symmetric, int8_activations=activations == "int8")


def _gguf_kernels(device: str) -> bool:
    import torch

    from tokenmill import native

    return torch.device(device).type == "cpu" and native.has_op("gguf_linear")


__all__ = ["CHECKPOINT_METHODS", "QUANTIZATION_METHODS", "QuantizationConfig", "QuantizeMethodBase",
           "UnquantizedLinearMethod", "get_quantization_config", "set_weight_attrs"]

"""Quantization: per-layer quant methods (base.py) and the registry of named methods (registry.py)."""
from tokenmill.layers.quantization import registry
from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.checkpoint import CheckpointFormat
from tokenmill.layers.quantization.registry import QuantOptions, checkpoint_format, quantize_at_load
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod
# Registers the built-in methods, in the order error messages list them.
from tokenmill.layers.quantization import weight_only, gguf, gptq_awq, fp8, packed, mxfp4  # noqa: E402,F401  isort: skip


def __getattr__(name: str) -> tuple[str, ...]:
    # Computed per access from the registry, so a method registered after import is listed too.
    if name == "QUANTIZATION_METHODS":
        return registry.at_load_names()
    if name == "CHECKPOINT_METHODS":
        return registry.checkpoint_flag_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_quantization_config(name: str | None, group_size: int = 32, symmetric: bool = False, *,
                            model: str | None = None, device: str = "cpu",
                            activations: str = "none", batch_dtype: str = "float32") -> QuantizationConfig | None:
    """The config for `--quantization NAME` (None: unquantized); ValueError naming the known methods.
    A .gguf `model` with no method named gets "gguf" (its blocks kept) where the block kernels run (the CPU
    with tokenmill's native kernels built); elsewhere, and with "none", it is dequantized at load: the
    kernel-less path of "gguf" dequantizes the weights at every call, the reference, not a default.
    `activations` "int8" asks the packed-weight kernels for int8 activations (GGUF, int8, int4) per 32 columns;
    "int8_per_token" the same, but int8 weights take one scale per row of x and torch._int_mm (W8A8); other
    methods ignore it. `batch_dtype` "bfloat16" runs GGUF batches of 32+ rows as bf16 GEMMs (the others ignore
    it). A pre-quantized format's name (gptq, awq, fp8) gives a CheckpointFormat:
    load_model reads the rest from config.json."""
    from tokenmill.config import ACTIVATION_QUANTIZATIONS, QUANTIZED_BATCH_DTYPES

    if activations not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"unknown activation quantization {activations!r}; known: {', '.join(ACTIVATION_QUANTIZATIONS)}.")
    if batch_dtype not in QUANTIZED_BATCH_DTYPES:
        raise ValueError(f"unknown quantized batch dtype {batch_dtype!r}; known: {', '.join(QUANTIZED_BATCH_DTYPES)}.")
    if name is None and model is not None and str(model).endswith(".gguf") and _gguf_kernels(device):
        name = "gguf"
    if name is None or name in ("", "none"):
        return None
    options = QuantOptions(group_size, symmetric, int8_activations=activations in ("int8", "int8_per_token"),
                           per_token_activations=activations == "int8_per_token",
                           bf16_batches=batch_dtype == "bfloat16")
    return registry.get_method(name).from_options(options)


def _gguf_kernels(device: str) -> bool:
    import torch

    from tokenmill import native

    return torch.device(device).type == "cpu" and native.has_op("gguf_linear")


__all__ = ["CHECKPOINT_METHODS", "QUANTIZATION_METHODS", "CheckpointFormat", "QuantOptions", "QuantizationConfig",
           "QuantizeMethodBase", "UnquantizedLinearMethod", "checkpoint_format", "get_quantization_config",
           "quantize_at_load", "registry", "set_weight_attrs"]

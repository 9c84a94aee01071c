from tokenmill.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from tokenmill.layers.quantization.unquantized import UnquantizedLinearMethod

__all__ = ["QuantizationConfig", "QuantizeMethodBase", "UnquantizedLinearMethod", "set_weight_attrs"]

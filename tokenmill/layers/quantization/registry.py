"""Quantization methods by name, as attention backends are (layers/attention_backends/registry.py).

Two kinds share one namespace, so a name means one thing on the command line and in a config.json:
- at load (`--quantization int8|int4|gguf`): builds its QuantizationConfig from the CLI options;
- checkpoint formats (a pre-quantized config.json's quantization_config["quant_method"]: gptq, awq, fp8,
  compressed-tensors, tokenmill): builds it from that dict, validating it. Those with `flag` set can also be
  named by `--quantization NAME`, a claim resolved against config.json at load (checkpoint.py).

A method plugs in by decorating its builder next to its config class (weight_only.py, gguf.py,
gptq_awq.py, fp8.py, packed.py); importing the package registers the built-in ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Literal, Union

from tokenmill.layers.quantization.base import QuantizationConfig

Kind = Literal["at_load", "checkpoint"]


@dataclass(frozen=True)
class QuantOptions:
    """The command line's say in a quantize-at-load config (`--quantization-group-size`, `tokenmill quantize
    --symmetric`, `--activation-quantization int8`); a method ignores what does not apply to it."""

    group_size: int = 32
    symmetric: bool = False
    int8_activations: bool = False
    per_token_activations: bool = False  # int8_per_token: int8 weights take one activation scale per row (W8A8)
    bf16_batches: bool = False  # --quantized-batch-dtype bfloat16: GGUF batches as bf16 GEMMs


@dataclass(frozen=True)
class LoadMethod:
    """Quantizes a checkpoint (or keeps a GGUF file's blocks) while loading: `--quantization NAME`."""

    name: str
    build: Callable[[QuantOptions], QuantizationConfig]
    kind: ClassVar[Kind] = "at_load"
    flag: ClassVar[bool] = True

    def from_options(self, options: QuantOptions) -> QuantizationConfig:
        return self.build(options)


@dataclass(frozen=True)
class CheckpointMethod:
    """A pre-quantized checkpoint format: `parse(quantization_config, where)` validates the dict (ValueError
    starting with `where`) and returns the config to build the model with."""

    name: str  # config.json's quant_method, lower case
    parse: Callable[[dict, str], QuantizationConfig]
    # `--quantization NAME` claims such a checkpoint. compressed-tensors and tokenmill have no flag of their
    # own: they resolve to fp8 / int8 / int4, and those flags agree with them.
    flag: bool = True
    label: str = ""  # how the "not supported" error lists it, when the name alone says too little
    kind: ClassVar[Kind] = "checkpoint"

    def from_options(self, options: QuantOptions) -> QuantizationConfig:
        from tokenmill.layers.quantization.checkpoint import CheckpointFormat  # imports this module

        return CheckpointFormat(self.name)


QuantMethod = Union[LoadMethod, CheckpointMethod]

_METHODS: dict[str, QuantMethod] = {}  # registration order: the order error messages list them in


def register_method(method: QuantMethod) -> QuantMethod:
    if method.name in _METHODS and _METHODS[method.name] != method:
        raise ValueError(f"quantization method {method.name!r} is already registered")
    _METHODS[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Drop a method (a test's, or a plugin's being replaced); KeyError if it is not registered."""
    del _METHODS[name]


def quantize_at_load(name: str) -> Callable[[Callable[[QuantOptions], QuantizationConfig]],
                                            Callable[[QuantOptions], QuantizationConfig]]:
    """Decorator: `build(options)` makes the config of `--quantization NAME`."""

    def register(build: Callable[[QuantOptions], QuantizationConfig]) -> Callable[[QuantOptions], QuantizationConfig]:
        register_method(LoadMethod(name, build))
        return build

    return register


def checkpoint_format(name: str, *, flag: bool = True, label: str = "") -> Callable[
        [Callable[[dict, str], QuantizationConfig]], Callable[[dict, str], QuantizationConfig]]:
    """Decorator: `parse(quantization_config, where)` reads a checkpoint whose quant_method is NAME."""

    def register(parse: Callable[[dict, str], QuantizationConfig]) -> Callable[[dict, str], QuantizationConfig]:
        register_method(CheckpointMethod(name, parse, flag, label))
        return parse

    return register


def methods(kind: Kind | None = None) -> tuple[QuantMethod, ...]:
    return tuple(m for m in _METHODS.values() if kind is None or m.kind == kind)


def at_load_names() -> tuple[str, ...]:
    """QUANTIZATION_METHODS: the `--quantization` names that quantize at load (int8, int4, gguf)."""
    return tuple(m.name for m in methods("at_load"))


def checkpoint_flag_names() -> tuple[str, ...]:
    """CHECKPOINT_METHODS: the `--quantization` names that only describe a checkpoint (gptq, awq, fp8)."""
    return tuple(m.name for m in methods("checkpoint") if m.flag)


def flag_names() -> tuple[str, ...]:
    """Every name `--quantization` accepts (besides "none")."""
    return tuple(m.name for m in _METHODS.values() if m.flag)


def get_method(name: str) -> QuantMethod:
    """The method `--quantization NAME` picks; ValueError naming the ones that exist."""
    method = _METHODS.get(name)
    if method is None or not method.flag:
        raise ValueError(f"unknown quantization method {name!r}; known: {', '.join(flag_names())}, none.")
    return method


def get_checkpoint_method(quant_method: str, where: str) -> CheckpointMethod:
    """The format of a checkpoint whose quantization_config names `quant_method`; ValueError (starting with
    `where`) naming the supported ones."""
    method = _METHODS.get(quant_method)
    if not isinstance(method, CheckpointMethod):
        known = ", ".join(m.label or m.name for m in methods("checkpoint"))
        raise ValueError(f"{where}: quant_method {quant_method!r} is not supported ({known})")
    return method

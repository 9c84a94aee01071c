"""Model families by name: config.json's `architectures` entry -> model class, and a GGUF file's
`general.architecture` -> its GGUFArch (model/gguf_arch.py).

Each family declares its own names in its own module: `@register_model("LlamaForCausalLM", ...)` on the model
class, `register_gguf(GGUFArch(...))` for the llama.cpp layouts it loads. Nothing here lists the families: the
first lookup of a name not yet registered imports every module of the tokenmill.model package (those already
imported cost nothing), so a new family is one new module. This module imports no family, and families import
only it and gguf_arch.py from here, so there is no import cycle and importing the registry stays cheap.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, TypeVar

from tokenmill.model.gguf_arch import GGUFArch

T = TypeVar("T", bound=type)

_MODELS: dict[str, type] = {}
_GGUF: dict[str, GGUFArch] = {}


def _identity(value: Any) -> Any:
    """What makes two declarations the same: a class or a function by where it is defined (a module imported
    again declares new objects of the same names), a GGUFArch field by field."""
    if isinstance(value, GGUFArch):
        return tuple(_identity(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, type) or callable(value):
        return (value.__module__, value.__qualname__)
    return value


def _add(table: dict[str, Any], name: str, value: Any, what: str) -> None:
    old = table.get(name)
    if old is not None and _identity(old) != _identity(value):
        raise ValueError(f"{what} {name!r} is already registered ({old!r}); a family claims each name once")
    table[name] = value


def register_model(*architectures: str) -> Callable[[T], T]:
    """Class decorator: the config.json `architectures` names this model class serves."""
    def register(cls: T) -> T:
        for name in architectures:
            _add(_MODELS, name, cls, "model architecture")
        return cls
    return register


def register_gguf(arch: GGUFArch) -> GGUFArch:
    """Declare a llama.cpp architecture the GGUF loader reads (its `general.architecture` is arch.name)."""
    _add(_GGUF, arch.name, arch, "GGUF architecture")
    return arch


def _discover() -> None:
    """Import every module of tokenmill.model, so every family's declarations have run. pkgutil walks the
    package's __path__ (a test can add a folder to it); modules already imported are not run again."""
    import tokenmill.model as package

    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)


def _lookup(table: dict[str, Any], name: str) -> Any:
    if name not in table:
        _discover()
    return table.get(name)


def model_architectures() -> list[str]:
    """Every registered `architectures` name, sorted."""
    _discover()
    return sorted(_MODELS)


def gguf_architectures() -> list[str]:
    """Every registered GGUF `general.architecture`, sorted."""
    _discover()
    return sorted(_GGUF)


def resolve(architectures: list[str] | None) -> type:
    """The model class of the first `architectures` entry a family registered."""
    for name in architectures or []:
        cls = _lookup(_MODELS, name)
        if cls is not None:
            return cls
    raise ValueError(
        f"unsupported model architecture {architectures!r} in config.json; "
        f"tokenmill supports: {', '.join(model_architectures())}"
    )


def gguf_arch(name: str | None) -> GGUFArch:
    """The GGUFArch a family declared for a GGUF file's `general.architecture`."""
    arch = _lookup(_GGUF, name) if name is not None else None
    if arch is None:
        raise ValueError(f"unsupported GGUF architecture {name!r}; tokenmill supports: "
                         f"{', '.join(gguf_architectures())}")
    return arch

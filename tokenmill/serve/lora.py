"""The server's LoRA adapters by name: `--lora-modules` at start-up, and `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` at run time with `--allow-runtime-lora-updating` (vLLM's interface). A request's `model`
field names the base model or an adapter; /v1/models lists the adapters with the base model as their parent."""
from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field

from tokenmill.lora.request import LoRARequest


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}` -> [(name, path)]."""
    modules = []
    for value in values or []:
        value = value.strip()
        if value.startswith("{"):
            try:
                d = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({e}).") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise ValueError(f"--lora-modules: {value!r} needs string fields \"name\" and \"path\".")
            name, path = d["name"], d["path"]
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} is not NAME=PATH or a JSON object.")
        modules.append((name, path))
    names = [n for n, _ in modules]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"--lora-modules: the name(s) {dupes} are given twice.")
    return modules


@dataclass
class LoRARegistry:
    reserved: list[str]  # the base model's served names and aliases: no adapter may take them
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def new(self, name: str, path: str) -> LoRARequest:
        """A request for a new adapter name (not registered until `add`); ValueError for a taken or empty name."""
        if not name or not isinstance(name, str):
            raise ValueError("lora_name must be a non-empty string.")
        if not path or not isinstance(path, str):
            raise ValueError("lora_path must be a non-empty string.")
        with self._lock:
            if name in self.reserved:
                raise ValueError(f"The name {name!r} is the base model's.")
            if name in self.adapters:
                raise ValueError(f"The lora adapter {name!r} has already been loaded.")
            return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest) -> None:
        with self._lock:
            if lora.lora_name in self.adapters:
                raise ValueError(f"The lora adapter {lora.lora_name!r} has already been loaded.")
            self.adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self.adapters.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def names(self) -> list[str]:
        return list(self.adapters)

"""The server's LoRA adapters by name: `--lora-modules` at start-up, and `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` at run time with `--allow-runtime-lora-updating` (vLLM's interface; the admin key only,
paths inside `--lora-root`, at most `--max-loaded-loras`). A request's `model`
field names the base model or an adapter; /v1/models lists the adapters with the base model as their parent."""
from __future__ import annotations

import itertools
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

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


# The one answer to a runtime load whose lora_path cannot be used, whatever the reason (outside --lora-root, a
# symlink out of it, missing, unreadable, not an adapter, not for this model): it names no path and quotes no
# bytes, so the route cannot be used to probe the server's files. The reason goes to the server's log.
UNLOADABLE = "lora_path does not name an adapter this server can load."


def resolve_in_root(root: str | None, path: str) -> str:
    """The real path `path` names for a runtime load: inside `root` (taken relative to it; every symlink resolved,
    so none leads out) when a root is set, as given otherwise. ValueError(UNLOADABLE) when it is outside the root
    or does not exist."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(UNLOADABLE)
    if root is None:
        return path
    base = os.path.realpath(root)
    real = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([base, real]) != base or not os.path.exists(real):
        raise ValueError(UNLOADABLE)
    return real


@dataclass
class LoRARegistry:
    reserved: list[str]  # the base model's served names and aliases: no adapter may take them
    max_loaded: int = 64  # --max-loaded-loras
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    # Requests in flight per adapter name (HTTP requests, released when their response is done). A name cannot be
    # registered again while requests that started with its old adapter still run: they must not switch weights.
    in_use: dict[str, int] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def new(self, name: str, path: str) -> LoRARequest:
        """A request for a new adapter name (not registered until `add`); ValueError for a taken or empty name,
        a name still in use, or a full registry."""
        if not name or not isinstance(name, str):
            raise ValueError("lora_name must be a non-empty string.")
        if not path or not isinstance(path, str):
            raise ValueError("lora_path must be a non-empty string.")
        with self._lock:
            self._check_free(name)
            return LoRARequest(name, next(self._ids), path)

    def _check_free(self, name: str) -> None:
        if name in self.reserved:
            raise ValueError(f"The name {name!r} is the base model's.")
        if name in self.adapters:
            raise ValueError(f"The lora adapter {name!r} has already been loaded.")
        if self.in_use.get(name):
            raise ValueError(f"Requests that started with the lora adapter {name!r} are still running; load it "
                             "again once they finish.")
        if len(self.adapters) >= self.max_loaded:
            raise ValueError(f"This server holds at most {self.max_loaded} adapters (--max-loaded-loras); "
                             "unload one first.")

    def add(self, lora: LoRARequest) -> None:
        with self._lock:
            self._check_free(lora.lora_name)
            self.adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self.adapters.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def acquire(self, lora: LoRARequest) -> Callable[[], None]:
        """Count one request in flight with `lora`; returns its release (call it once)."""
        name = lora.lora_name
        with self._lock:
            self.in_use[name] = self.in_use.get(name, 0) + 1

        def release() -> None:
            with self._lock:
                left = self.in_use.get(name, 0) - 1
                if left > 0:
                    self.in_use[name] = left
                else:
                    self.in_use.pop(name, None)

        return release

    def names(self) -> list[str]:
        return list(self.adapters)

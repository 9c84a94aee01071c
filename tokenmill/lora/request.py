"""Which adapter a request runs with. Plain data (no torch): it crosses to the engine core and the workers."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: `lora_name` is what the API's `model` field names,
    `lora_int_id` a positive id unique per adapter, `lora_path` the PEFT folder (or GGUF LoRA file)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty.")

    @property
    def cache_key(self) -> tuple:
        """Mixed into the request's block hashes: KV computed under one adapter is never served to another
        request (or the base model), nor after the name is loaded again from another path."""
        return ("lora", self.lora_int_id, self.lora_path)

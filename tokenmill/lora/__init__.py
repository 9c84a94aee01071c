"""LoRA adapters: many fine-tunes of one base model served together (docs/lora.md).

`request.py` (which adapter a request uses), `peft.py` and `gguf_lora.py` (reading adapters), `manager.py` (the
worker's host cache and device slots); the batched delta lives with the layers (`layers/lora.py`)."""
from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]

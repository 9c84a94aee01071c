"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.moe_models import MixtralForCausalLM, MoEForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
}


def resolve(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {architectures!r} in config.json; "
        f"tokenmill supports: {', '.join(sorted(MODELS))}"
    )

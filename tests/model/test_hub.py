"""Hugging Face model ids (tokenmill/model/hub.py), offline, against a cache laid out as huggingface_hub lays it out
(models--ORG--NAME/{blobs,snapshots/<commit>,refs/main}), built here. Nothing touches the network: HF_HUB_OFFLINE=1,
and the online path is checked with huggingface_hub's calls replaced."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from tiny import make_tiny_model
from tokenmill import SamplingParams
from tokenmill.cli import main
from tokenmill.model import hub
from tokenmill.model.default import resolve_model, resolve_paths

REV_A = "a" * 40
REV_B = "b" * 40
ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=16 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def put_in_cache(cache: Path, repo_id: str, files: dict[str, Path | bytes], commit: str = REV_A,
                 ref: str | None = "main") -> Path:
    """huggingface_hub's cache layout: each file's bytes in blobs/<sha256>, snapshots/<commit>/<name> a relative
    symlink to its blob, refs/<ref> the commit. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, src in files.items():
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    if ref:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline; huggingface_hub's network calls fail if anything makes one."""
    from huggingface_hub import HfApi

    root = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(root))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(HfApi, "list_repo_files", no_network)
    return root / "hub"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hub-tiny"), "llama")


@pytest.fixture(scope="module")
def tiny_other(tmp_path_factory) -> Path:
    """The same shape with other weights: a second revision of the repository."""
    return make_tiny_model(tmp_path_factory.mktemp("hub-tiny-b"), "llama", seed=1)


@pytest.fixture(scope="module")
def ggufs(tiny, tmp_path_factory) -> dict[str, Path]:
    import gguf

    from gguf_tiny import write_gguf

    out = tmp_path_factory.mktemp("hub-gguf")
    return {q: write_gguf(tiny, out / f"tiny-{q}.gguf", qtype=getattr(gguf.GGMLQuantizationType, q))
            for q in ("Q8_0", "Q4_0")}


def generate(model: str, **kwargs) -> list[int]:
    from tokenmill.llm import LLM

    with LLM(model, **ENGINE, **kwargs) as llm:
        return list(llm.generate("The quick brown", GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


# ---- ids -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("Qwen/Qwen2.5-0.5B-Instruct", hub.ModelId("Qwen/Qwen2.5-0.5B-Instruct")),
    ("ggml-org/gemma-3-1b-it-GGUF:Q8_0", hub.ModelId("ggml-org/gemma-3-1b-it-GGUF", quant="Q8_0")),
    ("ggml-org/gemma-3-1b-it-GGUF:q4_k_m", hub.ModelId("ggml-org/gemma-3-1b-it-GGUF", quant="q4_k_m")),
    ("org/name/model-Q8_0.gguf", hub.ModelId("org/name", filename="model-Q8_0.gguf")),
    ("org/name/sub/model.gguf", hub.ModelId("org/name", filename="sub/model.gguf")),
    ("/abs/path", None), ("./rel/path", None), ("../up/path", None), ("~/models/x", None), ("model", None),
    ("a/b/c", None), ("a/b/config.json", None), ("a--b/c", None), ("a/b:", None), ("", None), (None, None),
])
def test_parse_model_id(text, expected):
    assert hub.parse_model_id(text) == expected


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == str(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.cache_dir() == str(tmp_path / "c")
    assert hub.cache_dir(str(tmp_path / "d")) == str(tmp_path / "d")


def test_match_quant():
    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "m-F16.gguf", "m-BF16.gguf"]
    assert hub.match_quant(files, "q8_0") == ["m-Q8_0.gguf"]
    assert hub.match_quant(files, "F16") == ["m-F16.gguf"]  # a whole word: not BF16
    assert hub.match_quant(files, "Q4_K") == ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf"]
    assert hub.match_quant(files, "Q5_0") == []


# ---- the cache, offline ----------------------------------------------------------------------------------------
def test_the_cache_is_huggingface_hubs_layout(cache, tiny):
    from huggingface_hub import scan_cache_dir

    put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny))
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == "tiny-org/tiny-llama" and not scan_cache_dir(cache).warnings
    (revision,) = repo.revisions
    assert revision.commit_hash == REV_A and revision.refs == {"main"}


def test_safetensors_id_serves_the_same_model_as_its_path(cache, tiny):
    snapshot = put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny))
    assert resolve_model("tiny-org/tiny-llama") == str(snapshot)
    assert generate("tiny-org/tiny-llama") == generate(str(tiny))


def test_cli_takes_an_id(cache, tiny, capsys):
    put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny))
    argv = ["--prompt", "The quick brown", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "-q",
            "--max-model-len", "128", "--kv-cache-memory-bytes", "16M"]
    assert main(["generate", "tiny-org/tiny-llama", *argv]) == 0
    by_id = capsys.readouterr().out
    assert main(["generate", str(tiny), *argv]) == 0
    assert by_id == capsys.readouterr().out and by_id.strip()


def test_revision_picks_another_snapshot(cache, tiny, tiny_other, capsys):
    a = put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny), REV_A)
    b = put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny_other), REV_B, ref="v2")
    assert resolve_model("tiny-org/tiny-llama") == str(a)
    assert resolve_model("tiny-org/tiny-llama", revision=REV_B) == str(b)
    assert resolve_model("tiny-org/tiny-llama", revision="v2") == str(b)
    assert generate("tiny-org/tiny-llama", revision="v2") == generate(str(tiny_other))
    # The CLI flag reaches the resolution.
    from tokenmill.cli import build_parser
    from tokenmill.cli.args import engine_kwargs

    kwargs = engine_kwargs(build_parser().parse_args(["serve", "tiny-org/tiny-llama", "--revision", REV_B]))
    assert kwargs["model"] == str(b) and kwargs["revision"] == REV_B
    with pytest.raises(FileNotFoundError, match="revision 'v3'"):
        resolve_model("tiny-org/tiny-llama", revision="v3")


def test_download_dir_is_the_cache(cache, tiny, tmp_path):
    other = tmp_path / "elsewhere"
    snapshot = put_in_cache(other, "tiny-org/tiny-llama", folder_files(tiny))
    with pytest.raises(FileNotFoundError):
        resolve_model("tiny-org/tiny-llama")
    assert resolve_model("tiny-org/tiny-llama", download_dir=str(other)) == str(snapshot)


def test_tokenizer_id(cache, tiny):
    snapshot = put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny))
    model, tokenizer = resolve_paths(str(tiny), "tiny-org/tiny-llama")
    assert model == str(tiny) and tokenizer == str(snapshot)


def test_gguf_quant_picks_its_file(cache, ggufs, tiny):
    snapshot = put_in_cache(cache, "tiny-org/tiny-GGUF", {f"tiny-{q}.gguf": p for q, p in ggufs.items()})
    assert resolve_model("tiny-org/tiny-GGUF:Q8_0") == str(snapshot / "tiny-Q8_0.gguf")
    assert resolve_model("tiny-org/tiny-GGUF:q4_0") == str(snapshot / "tiny-Q4_0.gguf")
    # The tiny GGUF files carry no tokenizer: the folder's, by id too.
    put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny))
    by_id = generate("tiny-org/tiny-GGUF:Q8_0", tokenizer="tiny-org/tiny-llama")
    assert by_id == generate(str(ggufs["Q8_0"]), tokenizer=str(tiny))


def test_gguf_file_in_the_id(cache, ggufs):
    snapshot = put_in_cache(cache, "tiny-org/tiny-GGUF", {f"tiny-{q}.gguf": p for q, p in ggufs.items()})
    assert resolve_model("tiny-org/tiny-GGUF/tiny-Q4_0.gguf") == str(snapshot / "tiny-Q4_0.gguf")
    with pytest.raises(FileNotFoundError, match=r"no file 'tiny-Q5_0.gguf'.*tiny-Q4_0.gguf, tiny-Q8_0.gguf"):
        resolve_model("tiny-org/tiny-GGUF/tiny-Q5_0.gguf")


def test_gguf_quant_none_or_several_lists_the_files(cache):
    files = {name: name.encode() for name in ("m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf",
                                               "mmproj-m-f16.gguf", "README.md")}
    put_in_cache(cache, "org/m-GGUF", files)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("org/m-GGUF:Q4_K")
    msg = str(e.value)
    assert "several" in msg and "'Q4_K'" in msg and "m-Q4_K_M.gguf, m-Q4_K_S.gguf" in msg and "Q8_0" not in msg
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("org/m-GGUF:Q2_K")
    msg = str(e.value)
    assert "none" in msg and "m-Q4_K_M.gguf, m-Q4_K_S.gguf, m-Q8_0.gguf" in msg and "mmproj" not in msg
    # No quant: llama.cpp's default, Q4_K_M.
    assert resolve_model("org/m-GGUF").endswith("/m-Q4_K_M.gguf")


def test_gguf_repo_without_default_quant_asks_for_one(cache):
    put_in_cache(cache, "org/m-GGUF", {"m-Q8_0.gguf": b"x", "m-Q4_0.gguf": b"y"})
    with pytest.raises(FileNotFoundError, match=r"several \.gguf files.*org/m-GGUF:QUANT"):
        resolve_model("org/m-GGUF")
    put_in_cache(cache, "org/one-GGUF", {"one-Q8_0.gguf": b"x"})
    assert resolve_model("org/one-GGUF").endswith("/one-Q8_0.gguf")


def test_missing_id_offline_names_the_id_and_the_cache(cache, capsys):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("nobody/nothing-GGUF:Q8_0")
    msg = str(e.value)
    assert "'nobody/nothing-GGUF:Q8_0'" in msg and str(cache) in msg and "HF_HUB_OFFLINE" in msg
    # The CLI says it in one line.
    assert main(["generate", "nobody/nothing", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'nobody/nothing'" in err and str(cache) in err
    assert len(err.strip().splitlines()) == 1


def test_incomplete_snapshot_is_named(cache, tiny):
    files = {k: v for k, v in folder_files(tiny).items() if not k.endswith(".safetensors")}
    put_in_cache(cache, "tiny-org/tiny-llama", files)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("tiny-org/tiny-llama")
    msg = str(e.value)
    assert "neither config.json with *.safetensors nor .gguf files" in msg and f"snapshots/{REV_A}" in msg


def test_a_local_path_wins_over_an_id(cache, tiny, tmp_path, monkeypatch):
    put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny, tmp_path / "tiny-org" / "tiny-llama")
    assert resolve_model("tiny-org/tiny-llama") == "tiny-org/tiny-llama"


def test_a_missing_path_is_not_an_id(cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not download"):
        resolve_model(str(tmp_path / "nope"))


# ---- online, with huggingface_hub's calls replaced -------------------------------------------------------------
def test_online_fetches_only_what_it_loads(cache, tiny, monkeypatch):
    import huggingface_hub
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    listing = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "pytorch_model.bin", "original/consolidated.00.pth", "onnx/model.onnx",
               "README.md", "model-Q8_0.gguf"]
    calls = []
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, revision=None, **kw: listing)

    def snapshot_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **kw):
        calls.append(("snapshot", repo_id, revision, cache_dir, sorted(allow_patterns or []), kw))
        return str(put_in_cache(Path(cache_dir), repo_id, folder_files(tiny)))

    def hf_hub_download(repo_id, filename, *, revision=None, cache_dir=None, **kw):
        calls.append(("file", repo_id, filename, revision, cache_dir))
        return str(Path(cache_dir) / filename)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    resolve_model("org/model", revision="main")
    assert calls == [("snapshot", "org/model", "main", str(cache),
                      ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json"], {})]
    calls.clear()
    resolve_model("org/model:q8_0", download_dir="/somewhere")
    assert calls == [("file", "org/model", "model-Q8_0.gguf", None, "/somewhere")]


def test_online_unreachable_hub_falls_back_to_the_cache(cache, tiny, monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def down(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(HfApi, "list_repo_files", down)
    snapshot = put_in_cache(cache, "tiny-org/tiny-llama", folder_files(tiny))
    assert resolve_model("tiny-org/tiny-llama") == str(snapshot)
    with pytest.raises(FileNotFoundError, match="no route to host"):
        resolve_model("tiny-org/other")


def test_online_unknown_repository(cache, monkeypatch):
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def missing(*args, **kwargs):
        raise RepositoryNotFoundError("404", response=httpx.Response(404, request=httpx.Request("GET", "http://x")))

    monkeypatch.setattr(HfApi, "list_repo_files", missing)
    with pytest.raises(FileNotFoundError, match="'org/typo' is neither a local path nor a repository.*HF_TOKEN"):
        resolve_model("org/typo")


def test_serve_names_an_id_by_its_last_part(cache, tiny):
    from tokenmill.cli import build_parser
    from tokenmill.serve.server import model_aliases, served_names

    args = build_parser().parse_args(["serve", "tiny-org/tiny-llama"])
    names = served_names(args)
    assert names == ["tiny-llama"] and model_aliases(args, names) == ["tiny-org/tiny-llama"]

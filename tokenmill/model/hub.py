"""Hugging Face model ids -> local paths in the Hugging Face cache, through `huggingface_hub`.

Forms (a local path that exists always wins over an id):
  ORG/NAME             a safetensors repository (config.json + *.safetensors): the folder of its snapshot, with
                       only the config, tokenizer and safetensors files fetched; a repository holding only .gguf
                       files gets its one file, or its Q4_K_M (llama.cpp's default), else an error listing them
  ORG/NAME:QUANT       a GGUF repository: the .gguf file whose name carries QUANT, case-insensitive (llama.cpp's
                       `-hf` convention), e.g. ggml-org/gemma-3-1b-it-GGUF:Q8_0
  ORG/NAME/FILE.gguf   that file of the repository

`revision` (a branch, tag or commit), `download_dir` (the cache folder; default: HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub) and HF_TOKEN (private and gated repositories, read by huggingface_hub)
apply. With HF_HUB_OFFLINE=1 only the cache is read; an id that is not there is an error naming the id and the
cache folder. Downloads show huggingface_hub's progress bars (HF_HUB_DISABLE_PROGRESS_BARS=1 hides them).
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

# Files of a safetensors repository that tokenmill reads: the configs, the tokenizer, the weights (top level only).
MODEL_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja")
TOKENIZER_PATTERNS = ("*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja")
DEFAULT_GGUF_QUANT = "Q4_K_M"  # llama.cpp's -hf default when no :QUANT is given

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})"
                 rf"(?:(?::(?P<quant>[A-Za-z0-9._-]+))|(?:/(?P<file>(?:[^/\\:]+/)*[^/\\:]+\.gguf)))?$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelId:
    repo_id: str
    quant: str | None = None  # ORG/NAME:QUANT
    filename: str | None = None  # ORG/NAME/FILE.gguf

    def __str__(self) -> str:
        if self.quant:
            return f"{self.repo_id}:{self.quant}"
        return f"{self.repo_id}/{self.filename}" if self.filename else self.repo_id


def parse_model_id(text: str | None) -> ModelId | None:
    """'ORG/NAME', 'ORG/NAME:QUANT' or 'ORG/NAME/FILE.gguf' -> ModelId; anything else (paths) -> None."""
    if not text or text.startswith(("/", ".", "~")) or "\\" in text:
        return None
    m = _ID.match(text)
    if m is None or "--" in m["repo"] or ".." in m["repo"] or m["repo"].endswith(".git"):
        return None
    return ModelId(m["repo"], m["quant"], m["file"])


def is_offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE)


def cache_dir(download_dir: str | None = None) -> str:
    """The cache folder huggingface_hub uses, from the environment as it is now."""
    if download_dir:
        return os.path.expanduser(download_dir)
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.environ[var])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return os.path.join(xdg, "huggingface", "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


class ModelIdError(FileNotFoundError):
    """A model id that cannot be resolved: not cached offline, not on the Hub, or no file fits."""


def resolve(model: str | None, *, revision: str | None = None, download_dir: str | None = None,
            tokenizer: bool = False) -> str | None:
    """`model` unchanged when it is empty, a path that exists, or not an id; else the local path of the id
    (downloading what is missing unless offline). `tokenizer`: fetch only the tokenizer files of a
    safetensors repository."""
    if not model or os.path.exists(model):
        return model
    mid = parse_model_id(model)
    if mid is None:
        return model
    return _Resolver(mid, revision, cache_dir(download_dir), tokenizer).run()


class _Resolver:
    def __init__(self, mid: ModelId, revision: str | None, cache: str, tokenizer: bool) -> None:
        self.mid, self.revision, self.cache, self.tokenizer = mid, revision, cache, tokenizer
        self.offline = is_offline()

    # ---- where the files are listed from: the Hub, or the cached snapshot offline --------------------------
    def run(self) -> str:
        files = self._cached_files() if self.offline else self._hub_files()
        if self.mid.quant or self.mid.filename:
            return self._fetch_file(self._pick_gguf(files))
        if self.tokenizer:
            return self._fetch_snapshot(files, TOKENIZER_PATTERNS, need_weights=False)
        top = [f for f in files if "/" not in f]
        if "config.json" in top and any(f.endswith(".safetensors") for f in top):
            return self._fetch_snapshot(files, MODEL_PATTERNS, need_weights=True)
        ggufs = _gguf_candidates(files)
        if ggufs:
            return self._fetch_file(self._pick_default_gguf(ggufs))
        cached = f" (as cached at {self._snapshot_folder()}: download it again without HF_HUB_OFFLINE if it " \
            "is incomplete)" if self.offline else ""
        raise ModelIdError(
            f"{self._where()} has neither config.json with *.safetensors nor .gguf files"
            f"{_listing(files)}{cached}; tokenmill loads safetensors folders and GGUF files.")

    def _hub_files(self) -> list[str]:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                            RepositoryNotFoundError, RevisionNotFoundError)

        try:
            return HfApi().list_repo_files(self.mid.repo_id, revision=self.revision)
        except GatedRepoError as e:
            raise ModelIdError(f"{self.mid.repo_id} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                               f"to a token with access ({_first_line(e)}).") from None
        except RepositoryNotFoundError:
            raise ModelIdError(f"model {str(self.mid)!r} is neither a local path nor a repository on the Hugging "
                               "Face Hub (private ones need HF_TOKEN).") from None
        except RevisionNotFoundError:
            raise ModelIdError(f"{self.mid.repo_id} has no revision {self.revision!r}.") from None
        except (*_transport_errors(), OfflineModeIsEnabled, HfHubHTTPError) as e:
            # The Hub cannot be reached: what the cache holds will do.
            try:
                files = self._cached_files()
            except ModelIdError as cached:
                raise ModelIdError(f"{cached} The Hub could not be reached: {_first_line(e)}") from None
            self.offline = True
            return files

    def _snapshot_folder(self) -> str:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return snapshot_download(self.mid.repo_id, revision=self.revision, cache_dir=self.cache,
                                     local_files_only=True)
        except (LocalEntryNotFoundError, FileNotFoundError):
            raise ModelIdError(
                f"model {str(self.mid)!r}{self._rev()} is not in the Hugging Face cache at {self.cache} "
                "and HF_HUB_OFFLINE=1 forbids downloading it: download it once without HF_HUB_OFFLINE (or give "
                "--download-dir / HF_HUB_CACHE where it is), or give a local path.") from None

    def _cached_files(self) -> list[str]:
        folder = Path(self._snapshot_folder())
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    # ---- picking the files ------------------------------------------------------------------------------
    def _pick_gguf(self, files: list[str]) -> str:
        if self.mid.filename:
            if self.mid.filename in files:
                return self.mid.filename
            raise ModelIdError(f"{self._where()} has no file {self.mid.filename!r}{_listing(_gguf_candidates(files))}.")
        candidates = _gguf_candidates(files)
        if not candidates:
            raise ModelIdError(f"{self._where()} has no .gguf files{_listing(files)}.")
        match = match_quant(candidates, self.mid.quant)
        if len(match) == 1:
            return match[0]
        what = "several" if match else "none"
        raise ModelIdError(
            f"{self._where()}: {what} of its .gguf files match the quantization {self.mid.quant!r}"
            f"{_listing(match or candidates)}; name one as {self.mid.repo_id}:QUANT or "
            f"{self.mid.repo_id}/FILE.gguf.")

    def _pick_default_gguf(self, candidates: list[str]) -> str:
        if len(candidates) == 1:
            return candidates[0]
        match = match_quant(candidates, DEFAULT_GGUF_QUANT)
        if len(match) == 1:
            return match[0]
        raise ModelIdError(
            f"{self._where()} holds several .gguf files{_listing(candidates)}; pick one as "
            f"{self.mid.repo_id}:QUANT (e.g. :{_quant_of(candidates[0]) or 'Q8_0'}) or {self.mid.repo_id}/FILE.gguf.")

    # ---- fetching ---------------------------------------------------------------------------------------
    def _fetch_file(self, filename: str) -> str:
        if self.offline:
            path = Path(self._snapshot_folder()) / filename
            if not path.is_file():
                raise ModelIdError(f"{filename} of {self._where()} is not in the cache at {self.cache}.")
            return str(path)
        from huggingface_hub import hf_hub_download

        return hf_hub_download(self.mid.repo_id, filename, revision=self.revision, cache_dir=self.cache)

    def _fetch_snapshot(self, files: list[str], patterns: tuple[str, ...], need_weights: bool) -> str:
        wanted = [f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in patterns)]
        if self.offline:
            folder = self._snapshot_folder()
        else:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(self.mid.repo_id, revision=self.revision, cache_dir=self.cache,
                                       allow_patterns=wanted)
        present = set(os.listdir(folder))
        missing = [f for f in wanted if f not in present]
        if need_weights and ("config.json" not in present or not any(f.endswith(".safetensors") for f in present)):
            missing = missing or ["config.json + *.safetensors"]
        if missing:
            raise ModelIdError(f"the cached snapshot of {self._where()} at {folder} lacks {', '.join(missing[:5])}; "
                               "download it again without HF_HUB_OFFLINE.")
        return folder

    def _rev(self) -> str:
        return f" (revision {self.revision!r})" if self.revision else ""

    def _where(self) -> str:
        return f"{self.mid.repo_id}{self._rev()}"


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection errors of the HTTP client huggingface_hub uses (httpx2 in 2.x, httpx in 1.x)."""
    import importlib

    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for name in ("httpx2", "httpx", "requests"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr in ("TransportError", "ConnectionError"):
            cls = getattr(module, attr, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                errors.append(cls)
    return tuple(errors)


def _gguf_candidates(files: list[str]) -> list[str]:
    """The model files among a repository's .gguf files (not llama.cpp's multimodal projectors)."""
    return [f for f in files if f.lower().endswith(".gguf") and not f.rsplit("/", 1)[-1].lower().startswith("mmproj")]


def match_quant(candidates: list[str], quant: str) -> list[str]:
    """The files whose path carries `quant`, case-insensitive: as a whole word between separators (- _ . /) when
    some do (Q4_K matches ...-Q4_K.gguf, not ...-Q4_K_M.gguf), else anywhere in the name."""
    q = re.escape(quant.lower())
    whole = [f for f in candidates if re.search(rf"(?:^|[-_./]){q}(?:$|[-./])", f.lower())]
    return whole or [f for f in candidates if quant.lower() in f.lower()]


def _quant_of(filename: str) -> str | None:
    m = re.search(r"(?:^|[-_.])((?:I?Q\d+_[A-Z0-9_]+?|F16|BF16|F32))(?:\.gguf$|[-.])", filename, re.IGNORECASE)
    return m.group(1) if m else None


def _listing(files: list[str], most: int = 20) -> str:
    if not files:
        return " (it has no files)"
    shown = ", ".join(files[:most])
    more = f", ... ({len(files) - most} more)" if len(files) > most else ""
    return f" ({shown}{more})"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

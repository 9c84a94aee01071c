"""Benchmark prompts: made locally from a seed (`random`, `shared-prefix`, `long-context`,
`long-decode`) or read from a file (`file`: JSONL of prompts/messages, or a ShareGPT export).

Lengths are in tokens when a tokenizer is given (prompts are cut to exact token counts); without
one a prompt of N "tokens" is N common English words, most of which are one token in BPE
vocabularies, so lengths are approximate. The server's `usage` gives the true counts either way.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

DATASETS = ("random", "shared-prefix", "long-context", "long-decode", "file")

# Short common words: in GPT-2/Llama/SmolLM-style vocabularies " word" is a single token.
WORDS = tuple("""
the of and to in is was for on are with as his they be at one have this from or had by word but
what some we can out other were all there when up use your how said an each she which do their time
if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form great think say
help low line differ turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here must big
high such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found answer
school grow study still learn plant cover food sun four between state keep eye never last let
thought city tree cross farm hard start might story saw far sea draw left late run while press
close night real life few north open seem together next white children begin got walk example ease
paper group always music those both mark often letter until mile river car feet care second book
carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top
whole king space heard best hour better true during hundred five remember step early hold west
ground interest reach fast verb sing listen six table travel less morning ten simple several vowel
toward war lay against pattern slow center love person money serve appear road map rain rule govern
pull cold notice voice unit power town fine certain fly fall lead cry dark machine note wait plan
figure star box noun field rest correct able pound done beauty drive stood contain front teach week
final gave green quick develop ocean warm free minute strong special mind behind clear tail produce
fact street inch multiply nothing course stay wheel full force blue object decide surface deep moon
island foot system busy test record boat common gold possible plane stead dry wonder laugh thousand
ago ran check game shape equate hot miss brought heat snow tire bring yes distant fill east paint
language among
""".split())


class Tokenizer(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: Sequence[int], *args: Any, **kwargs: Any) -> str: ...


@dataclass
class BenchRequest:
    """One request to send: `prompt` (completions) or `messages` (chat); the client converts
    between the two when the endpoint wants the other."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_len: int = 0          # tokens if `exact`, else an estimate (words)
    output_len: int | None = None  # sent as max_tokens; None leaves it to the server
    exact: bool = False


@dataclass
class DatasetSpec:
    name: str = "random"
    num_prompts: int | None = None  # None: the dataset's default (DEFAULT_NUM_PROMPTS)
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    shared_prefix_num_prefixes: int = 4
    shared_prefix_prefix_len: int = 2048
    shared_prefix_suffix_len: int = 64
    shared_prefix_output_len: int = 128
    long_context_input_len: int = 7168
    long_context_output_len: int = 128
    long_decode_input_len: int = 64
    long_decode_output_len: int = 4096
    dataset_path: str | None = None
    file_output_len: int | None = None  # overrides per-entry lengths when set


DEFAULT_NUM_PROMPTS = {"random": 1000, "shared-prefix": 256, "long-context": 4, "long-decode": 8, "file": 1000}
FILE_DEFAULT_OUTPUT_LEN = 256


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` without BOS/EOS (the server adds those; they are not the prompt's)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def count_tokens(tokenizer: Tokenizer | None, text: str) -> int:
    return len(encode(tokenizer, text)) if tokenizer is not None else len(text.split())


def make_text(rng: np.random.Generator, n: int, tokenizer: Tokenizer | None) -> tuple[str, int]:
    """A text of `n` tokens (exact with a tokenizer when re-tokenization allows, else `n` words);
    returns the text and its measured length."""
    if n <= 0:
        return "", 0
    # Every " word" is at least one token, so n + 8 words are always long enough to cut n from.
    words = " ".join(rng.choice(WORDS, size=n + 8))
    if tokenizer is None:
        return " ".join(words.split()[:n]), n
    ids = encode(tokenizer, words)
    cut = n
    for _ in range(8):
        text = tokenizer.decode(ids[:cut])
        got = len(encode(tokenizer, text))
        if got == n:
            break
        # The cut merged or split a token on re-encoding: move it by the difference.
        cut = min(max(1, cut + n - got), len(ids))
    return text, got


def _lengths(rng: np.random.Generator, length: int, ratio: float, n: int, low_min: int) -> np.ndarray:
    """vLLM's random lengths: integers uniform in [length*(1-r), length*(1+r)], both ends included."""
    low = max(low_min, int(length * (1 - ratio)))
    high = max(low, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def random_dataset(spec: DatasetSpec, n: int, tokenizer: Tokenizer | None) -> list[BenchRequest]:
    if not 0 <= spec.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {spec.random_range_ratio}")
    rng = np.random.default_rng(spec.seed)
    ins = _lengths(rng, spec.random_input_len, spec.random_range_ratio, n, 1)
    outs = _lengths(rng, spec.random_output_len, spec.random_range_ratio, n, 1)
    out = []
    for i_len, o_len in zip(ins, outs):
        text, got = make_text(rng, int(i_len), tokenizer)
        out.append(BenchRequest(prompt=text, prompt_len=got, output_len=int(o_len), exact=tokenizer is not None))
    return out


def shared_prefix_dataset(spec: DatasetSpec, n: int, tokenizer: Tokenizer | None) -> list[BenchRequest]:
    """`num_prefixes` long system prompts, each shared by ~n/num_prefixes requests that differ in
    their question; the order is shuffled so hits interleave as in agent/RAG traffic."""
    if spec.shared_prefix_num_prefixes < 1:
        raise ValueError("--shared-prefix-num-prefixes must be at least 1")
    rng = np.random.default_rng(spec.seed)
    prefixes = [make_text(rng, spec.shared_prefix_prefix_len, tokenizer)[0]
                for _ in range(spec.shared_prefix_num_prefixes)]
    order = rng.permutation(n) % spec.shared_prefix_num_prefixes
    out = []
    for k in order:
        question, _ = make_text(rng, spec.shared_prefix_suffix_len, tokenizer)
        system = prefixes[int(k)]
        out.append(BenchRequest(
            prompt=f"{system}\n\n{question}",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            prompt_len=count_tokens(tokenizer, f"{system}\n\n{question}"),
            output_len=spec.shared_prefix_output_len, exact=tokenizer is not None))
    return out


def _fixed_dataset(spec: DatasetSpec, n: int, tokenizer: Tokenizer | None,
                   input_len: int, output_len: int) -> list[BenchRequest]:
    rng = np.random.default_rng(spec.seed)
    out = []
    for _ in range(n):
        text, got = make_text(rng, input_len, tokenizer)
        out.append(BenchRequest(prompt=text, prompt_len=got, output_len=output_len, exact=tokenizer is not None))
    return out


def _read_entries(path: str) -> list[dict[str, Any]]:
    """JSONL (one object a line) or a JSON array (the original ShareGPT export)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        data = json.loads(text)
        return [d for d in data if isinstance(d, dict)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e.msg}") from None
        if isinstance(entry, dict):
            out.append(entry)
    return out


def _sharegpt_turns(entry: dict[str, Any]) -> tuple[str | None, str | None]:
    """First human turn and the reply after it, from {"conversations": [{"from", "value"}...]}."""
    turns = entry.get("conversations") or []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            continue
        who = turn.get("from", turn.get("role"))
        if who in ("human", "user"):
            text = turn.get("value", turn.get("content"))
            nxt = turns[i + 1] if i + 1 < len(turns) and isinstance(turns[i + 1], dict) else {}
            reply = nxt.get("value", nxt.get("content"))
            return (text if isinstance(text, str) else None), (reply if isinstance(reply, str) else None)
    return None, None


def entry_to_request(entry: dict[str, Any], spec: DatasetSpec, tokenizer: Tokenizer | None) -> BenchRequest | None:
    """One file entry as a request, or None when it has no usable prompt. Output length:
    --file-output-len if given, else the entry's max_tokens, else the length of a ShareGPT
    reply, else FILE_DEFAULT_OUTPUT_LEN."""
    prompt, messages, reply = None, None, None
    if isinstance(entry.get("prompt"), str):
        prompt = entry["prompt"]
    elif isinstance(entry.get("messages"), list) and entry["messages"]:
        messages = entry["messages"]
    else:
        prompt, reply = _sharegpt_turns(entry)
    if not prompt and not messages:
        return None
    text = prompt if prompt is not None else "\n".join(str(m.get("content", "")) for m in messages)
    if spec.file_output_len is not None:
        output_len = spec.file_output_len
    elif isinstance(entry.get("max_tokens"), int):
        output_len = entry["max_tokens"]
    elif reply:
        output_len = max(1, count_tokens(tokenizer, reply))
    else:
        output_len = FILE_DEFAULT_OUTPUT_LEN
    return BenchRequest(prompt=prompt, messages=messages, prompt_len=count_tokens(tokenizer, text),
                        output_len=output_len, exact=tokenizer is not None)


def file_dataset(spec: DatasetSpec, n: int | None, tokenizer: Tokenizer | None) -> list[BenchRequest]:
    """The file's first n usable entries in order (cycled when the file has fewer)."""
    if not spec.dataset_path:
        raise ValueError("--dataset file needs --dataset-path")
    if not os.path.isfile(spec.dataset_path):
        raise FileNotFoundError(f"dataset file not found: {spec.dataset_path}")
    reqs = [r for r in (entry_to_request(e, spec, tokenizer) for e in _read_entries(spec.dataset_path)) if r]
    if not reqs:
        raise ValueError(f"{spec.dataset_path}: no entry has a prompt, messages or a human turn")
    if n is None:
        return reqs
    return [reqs[i % len(reqs)] for i in range(n)]


def build_dataset(spec: DatasetSpec, tokenizer: Tokenizer | None = None) -> list[BenchRequest]:
    if spec.name not in DATASETS:
        raise ValueError(f"unknown dataset {spec.name!r}; choose from {', '.join(DATASETS)}")
    if spec.name == "file":
        return file_dataset(spec, spec.num_prompts, tokenizer)
    n = spec.num_prompts if spec.num_prompts is not None else DEFAULT_NUM_PROMPTS[spec.name]
    if n < 1:
        raise ValueError("--num-prompts must be at least 1")
    if spec.name == "random":
        return random_dataset(spec, n, tokenizer)
    if spec.name == "shared-prefix":
        return shared_prefix_dataset(spec, n, tokenizer)
    if spec.name == "long-context":
        return _fixed_dataset(spec, n, tokenizer, spec.long_context_input_len, spec.long_context_output_len)
    return _fixed_dataset(spec, n, tokenizer, spec.long_decode_input_len, spec.long_decode_output_len)


def load_tokenizer(path: str | None) -> Tokenizer | None:
    """A Hugging Face tokenizer folder or a .gguf file; None when no path is given."""
    if not path:
        return None
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        try:  # tokenmill's reader caches the converted tokenizer; transformers' own works too
            from tokenmill.model.gguf_loader import load_gguf_tokenizer
        except ImportError:
            folder, name = os.path.split(os.path.abspath(path))
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return load_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)

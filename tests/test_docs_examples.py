"""The docs against the code: what they say is built is built, and their quick starts run as written."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import LiveServer, start_server

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_no_doc_calls_a_built_flag_unbuilt():
    """A flag under a "## Built: ... (`--flag`)" heading is not also "not built" in the same doc (issue 50 item
    4: docs/long_context.md called `--cpu-offload-gb` both)."""
    for doc in DOCS:
        text = doc.read_text()
        built = {f for h in re.findall(r"^## Built:.*$", text, re.M) for f in re.findall(r"`(--[a-z0-9-]+)", h)}
        for sentence in re.split(r"(?<=[.;])\s", text.replace("\n", " ")):
            for flag in built:
                assert not (flag in sentence and re.search(r"\bnot built\b", sentence)), (doc.name, sentence)


def test_cpu_offload_is_accepted_on_a_gpu_and_refused_on_the_cpu():
    """What docs/long_context.md says of --cpu-offload-gb: accepted for a GPU, refused on the CPU."""
    from tokenmill.config import EngineConfig, ModelConfig

    EngineConfig(model=ModelConfig(cpu_offload_gb=1.0), device="cuda").validate()
    with pytest.raises(ValueError, match="--weights-resident-gb"):
        EngineConfig(model=ModelConfig(cpu_offload_gb=1.0), device="cpu").validate()


# The quick starts, run as written against a live server on a tiny random model. Only what must differ here is
# rewritten, by this mapping (a key of the docs → what it becomes in the test):
#   http://127.0.0.1:8000, localhost:8000  → the test server's address (a free port)
#   "SmolLM2-135M-Instruct"                → served as such (--served-model-name), so not rewritten
#   LLM()  (README: the embedded model)    → LLM("<tiny model folder>")
#   BASE                                   → the tiny model's folder
#   /adapters/sql, /adapters/fr.gguf       → a PEFT adapter of it and the same as a GGUF LoRA file
#   sk-...                                 → the test's key
# A doc's `tokenmill serve ...` line is not run by the shell: its arguments start the server (so a key it sets
# is a key the server needs), and every other command of the block runs as written, curl failing on any HTTP
# error (a 401 from a missing Authorization header fails the test).
SERVED = "SmolLM2-135M-Instruct"
KEY = "sk-docs-test"
QUICK_STARTS = {  # doc → (section, the languages of its blocks that are quick starts)
    "README.md": [("### curl", "bash"), ("### The `openai` client", "python"),
                  ("## Quick start", "python")],  # not its command-line block: an interactive REPL, a router
    "docs/lora.md": [("# LoRA adapters", "bash python")],
    "docs/server.md": [("## curl", "bash")],
}


def section_blocks(doc: str, heading: str) -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks between `heading` (a line starting with it) and the next heading."""
    lines = (REPO / doc).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    out, lang, code = [], None, []
    for line in lines[start + 1:]:
        if lang is None and line.startswith("#"):
            break
        if line.startswith("```"):
            if lang is None:
                lang, code = line[3:].strip(), []
            else:
                out.append((lang, "\n".join(code)))
                lang = None
        elif lang is not None:
            code.append(line)
    assert out, f"{doc}: no code under {heading!r}"
    return out


def split_serve(script: str) -> tuple[list[str] | None, str]:
    """The `tokenmill serve` command's arguments (after `serve`), and the script without it."""
    lines, rest, serve = script.splitlines(), [], None
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("tokenmill serve"):
            cmd = lines[i]
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1] + " " + lines[i]
            serve = shlex.split(cmd, comments=True)[2:]
        else:
            rest.append(lines[i])
        i += 1
    return serve, "\n".join(rest)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The mapping's right-hand sides that are files: the tiny model and its two adapters."""
    from lora_tiny import make_adapter, write_gguf_lora
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("docs")
    base = make_tiny_model(root / "base", "llama")
    sql = make_adapter(base, root / "sql", r=8)
    cfg = json.loads((base / "config.json").read_text())
    fr = write_gguf_lora(make_adapter(base, root / "fr", r=4, seed=1), root / "fr.gguf",
                         cfg["num_attention_heads"], cfg["num_key_value_heads"])
    return {"BASE": str(base), "/adapters/sql": str(sql), "/adapters/fr.gguf": str(fr)}


def rewrite(code: str, files: dict[str, str], base_url: str | None) -> str:
    if base_url:
        code = code.replace("http://127.0.0.1:8000", base_url).replace("localhost:8000", base_url)
    code = code.replace("LLM()", f'LLM("{files["BASE"]}")').replace("sk-...", KEY)
    for name in sorted(files, key=len, reverse=True):  # /adapters/fr.gguf before a shorter prefix of it
        code = re.sub(rf"(?<![\w/]){re.escape(name)}(?![\w.])", files[name], code)
    return code


def run_shell(script: str, needs_key: bool, where: str) -> str:
    for cmd in re.split(r"\n(?=curl)", script):
        if cmd.startswith("curl") and needs_key:
            assert "Authorization: Bearer" in cmd, f"{where}: the server needs a key, this curl sends none:\n{cmd}"
    # --fail-with-body: an HTTP error fails the block, its body shown
    prelude = 'set -euo pipefail\ncurl() { command curl -sS --fail-with-body --max-time 60 "$@"; }\n'
    done = subprocess.run(["bash", "-c", prelude + script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{where}: exit {done.returncode}\n{script}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_python(code: str, where: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"{where}: exit {done.returncode}\n{code}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One live server per distinct serve line (the docs without one share the README's: no key)."""
    live: dict[tuple[str, ...], LiveServer] = {}
    root = tmp_path_factory.mktemp("servers")

    def get(model: str, args: list[str]) -> LiveServer:
        key = (model, *args)
        if key not in live:
            live[key] = start_server(model, root / f"server{len(live)}.log", "--served-model-name", SERVED, *args,
                                     "--max-model-len", "256")
        return live[key]

    yield get
    for srv in live.values():
        srv.stop()


@pytest.mark.parametrize("doc", sorted(QUICK_STARTS))
def test_quick_starts_run_as_written(doc, files, servers):
    """Each quick start's bash and python blocks against a server started from the doc's own serve line (else
    the README's: no key), rewritten only by the mapping above."""
    blocks = [(h, lang, code) for h, langs in QUICK_STARTS[doc] for lang, code in section_blocks(doc, h)
              if lang in langs.split()]
    serve_args = next((a for _, lang, c in blocks if lang == "bash" for a in [split_serve(c)[0]] if a), [])
    args = shlex.split(rewrite(shlex.join(serve_args), files, None))
    model = args.pop(0) if args and not args[0].startswith("-") else files["BASE"]
    needs_key = "--api-key" in args
    srv = servers(model, args)
    for heading, lang, code in blocks:
        where = f"{doc} {heading} ({lang})"
        if lang == "bash":
            out = run_shell(rewrite(split_serve(code)[1], files, srv.base_url), needs_key, where)
            assert "choices" in out, f"{where}: no completion in\n{out}"
        elif lang == "python":
            run_python(rewrite(code, files, srv.base_url), where)

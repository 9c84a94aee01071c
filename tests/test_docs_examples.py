"""The docs against the code: what they say is built is built, and their quick starts run as written."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
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


# The examples that talk to a server, run as written against a live server on a tiny random model.
#
# The convention (README.md and docs/*.md):
# - every fenced bash/sh/shell or python block that names the server's address (`localhost:8000`,
#   `127.0.0.1:8000`) is an example and runs here;
# - a line `<!-- docs-test: skip: WHY -->` right above its fence (blank lines between are fine) skips it, the
#   reason shown by pytest: for blocks that need what a test does not have (downloads, a GPU, minutes of load, a
#   server of their own);
# - `<!-- docs-test: run -->` above any other bash or python block makes it an example too (README's offline
#   quick start).
# Only what must differ here is rewritten, by this mapping (a key of the docs → what it becomes in the test):
#   http://127.0.0.1:8000, localhost:8000  → the test server's address (a free port)
#   "SmolLM2-135M-Instruct"                → served as such (--served-model-name), so not rewritten
#   LLM()  (README: the embedded model)    → LLM("<tiny model folder>")
#   BASE                                   → the tiny model's folder
#   /adapters/sql, /adapters/fr.gguf       → a PEFT adapter of it and the same as a GGUF LoRA file
#   sk-...                                 → the test's key
# A block's `tokenmill serve ...` line is not run by the shell: its arguments start the server (so a key it sets
# is a key the server needs), and every other command of the block runs as written, curl failing on any HTTP
# error (a 401 from a missing Authorization header fails the test). A block without a serve line talks to a
# server with no flags beyond the mapping's (no key).
SERVED = "SmolLM2-135M-Instruct"
KEY = "sk-docs-test"
ADDRESS = re.compile(r"(localhost|127\.0\.0\.1):8000\b")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|run)\s*:?\s*(.*?)\s*-->\s*$")
SHELL, PYTHON = {"bash", "sh", "shell"}, {"python", "py"}


@dataclass
class Block:
    doc: str  # relative to the repo
    line: int  # of the opening fence, 1-based
    lang: str  # "bash" or "python"
    code: str
    skip: str | None  # the marker's reason, when skipped

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_blocks(doc: Path) -> list[Block]:
    """Every example of one doc by the convention above, skipped ones included."""
    out, lines = [], doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip().lower(), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        code = "\n".join(lines[i + 1:end])
        i = end + 1
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(above)
        kind = lang if lang in PYTHON else "bash" if lang in SHELL else None
        if kind is None or not (ADDRESS.search(code) or (marker and marker[1] == "run")):
            continue
        kind = "python" if kind in PYTHON else kind
        skip = (marker[2] or "no reason given") if marker and marker[1] == "skip" else None
        out.append(Block(str(doc.relative_to(REPO)), start + 1, kind, code, skip))
    return out


BLOCKS = [b for doc in DOCS for b in doc_blocks(doc)]


def test_the_convention_finds_the_quick_starts():
    """The examples this test must run are found, and none is skipped without a reason (a marker's typo would
    otherwise turn a refused example into a silent pass)."""
    ran = {b.doc for b in BLOCKS if b.skip is None}
    assert {"README.md", "docs/lora.md", "docs/server.md"} <= ran, ran
    assert any(b.doc == "README.md" and "LLM()" in b.code and b.skip is None for b in BLOCKS)
    assert all(b.skip != "no reason given" for b in BLOCKS), [b.id for b in BLOCKS if b.skip == "no reason given"]
    for doc in DOCS:  # every docs-test comment is one the convention reads (prose may name the markers)
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("<!--") and "docs-test" in line:
                assert MARKER.match(line.strip()), f"{doc.name}:{n}: {line}"


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
        code = code.replace("http://127.0.0.1:8000", base_url).replace("http://localhost:8000", base_url)
        code = code.replace("localhost:8000", base_url)
    code = code.replace("LLM()", f'LLM("{files["BASE"]}")').replace("sk-...", KEY)
    for name in sorted(files, key=len, reverse=True):  # /adapters/fr.gguf before a shorter prefix of it
        code = re.sub(rf"(?<![\w/]){re.escape(name)}(?![\w.])", files[name], code)
    return code


def run_shell(script: str, needs_key: bool, where: str) -> str:
    for cmd in re.split(r"\n(?=curl)", script):
        if cmd.startswith("curl") and needs_key:
            assert re.search(r"Authorization: Bearer|x-api-key:", cmd, re.I), \
                f"{where}: the server needs a key, this curl sends none:\n{cmd}"
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
    """One live server per distinct serve line, started when first needed (the blocks without one share one with
    no key): most blocks of the module share one server."""
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


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_examples_run_as_written(block, files, servers):
    """One example against a server started from its own serve line (else the shared one), rewritten only by the
    mapping above."""
    if block.skip is not None:
        pytest.skip(f"docs-test: skip: {block.skip}")
    where = f"{block.id} ({block.lang})"
    serve_args, script = split_serve(block.code) if block.lang == "bash" else (None, block.code)
    args = shlex.split(rewrite(shlex.join(serve_args or []), files, None))
    model = args.pop(0) if args and not args[0].startswith("-") else files["BASE"]
    if not ADDRESS.search(block.code):  # an offline example (docs-test: run): no server
        run_python(rewrite(script, files, None), where) if block.lang == "python" else \
            run_shell(rewrite(script, files, None), False, where)
        return
    srv = servers(model, args)
    if block.lang == "bash":
        out = run_shell(rewrite(script, files, srv.base_url), "--api-key" in args, where)
        if "completions" in script:
            assert "choices" in out, f"{where}: no completion in\n{out}"
    else:
        run_python(rewrite(script, files, srv.base_url), where)

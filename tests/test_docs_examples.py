"""The docs against the code: what they say is built is built, and their quick starts run as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

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

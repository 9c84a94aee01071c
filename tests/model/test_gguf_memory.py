"""Issue 26: the RSS that LLM() adds on the embedded GGUF stays within the resident weights, the KV pages
actually touched and 150 MB, and the start-up log says what is resident.

Runs in a fresh interpreter: RSS is only meaningful for a process that has loaded nothing else.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

MiB = 2**20
SLACK = 150 * 10**6  # the bound: what LLM() may add beyond weights and touched KV

_CHILD = r"""
import json, logging

class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []
    def emit(self, record):
        self.lines.append(record.getMessage())

def rss():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("Rss:"))

import torch, tokenmill
from tokenmill import LLM
from tokenmill.model.default import default_model_path

path = default_model_path()
handler = Lines()
logging.getLogger("tokenmill").addHandler(handler)
logging.getLogger("tokenmill").setLevel(logging.INFO)
before = rss()
llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=64 << 20)
after = rss()
print(json.dumps({"before": before, "after": after, "log": handler.lines}))
"""


def _mib(pattern: str, line: str) -> float:
    m = re.search(pattern, line)
    assert m, f"{pattern!r} not in {line!r}"
    return float(m.group(1)) * MiB


def test_llm_rss_growth_within_weights_touched_kv_and_slack():
    pytest.importorskip("gguf")
    from tokenmill.model.default import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("no /proc/self/smaps_rollup (Linux 4.14+)")
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [l for l in out["log"] if l.startswith("resident:")]
    assert len(lines) == 1, out["log"]
    line = lines[0]

    weights = _mib(r"weights ([\d.]+) MiB", line)
    dequantized = _mib(r"dequantized at load ([\d.]+)", line)
    reserved = _mib(r"KV cache ([\d.]+) MiB reserved", line)
    touched = _mib(r"([\d.]+) MiB touched", line)
    logged_rss = _mib(r"process RSS ([\d.]+) MiB", line)
    from tokenmill import native

    if native.has_op("gguf_linear"):
        # SmolLM2-135M Q4_1: ~92 MiB of Q4_1/Q8_0 blocks, all kept; the norms are the only floats
        assert 80 * MiB < _mib(r"GGUF blocks ([\d.]+)", line) <= weights < 100 * MiB, line
        assert dequantized == 0, line
    else:  # no block kernels: every matrix dequantized at load, and the bound still holds
        assert dequantized > 400 * MiB, line
    assert 60 * MiB < reserved <= 64 * MiB, line
    assert 0 <= touched <= reserved, line
    assert abs(logged_rss - out["after"]) < 20 * MiB, (line, out)

    growth = out["after"] - out["before"]
    print(f"RSS +{growth / MiB:.0f} MiB; {line}")
    bound = weights + touched + SLACK
    assert growth <= bound, (f"LLM() grew RSS by {growth / MiB:.0f} MiB, more than weights {weights / MiB:.0f} + "
                             f"touched KV {touched / MiB:.0f} + {SLACK / MiB:.0f} MiB", line)


def test_log_says_which_tensors_were_dequantized_and_why(tmp_path, caplog):
    """attn_output as Q5_0 (no kernel) and layer 1's qkv mixing Q4_K with Q6_K are float; the line says so."""
    gguf = pytest.importorskip("gguf")
    from gguf_tiny import write_gguf
    from tiny import make_tiny_model
    from tokenmill import LLM, native

    if not native.has_op("gguf_linear"):
        pytest.skip("GGUF block kernels not built")
    T = gguf.GGMLQuantizationType
    folder = make_tiny_model(tmp_path / "k", "llama", hidden_size=256, intermediate_size=512)
    table = {"blk.0.attn_output": T.Q5_0, "blk.1.attn_q": T.Q4_K, "blk.1.attn_k": T.Q4_K, "blk.1.attn_v": T.Q6_K}
    path = write_gguf(folder, tmp_path / "k.gguf", types=lambda name: table.get(name.rsplit(".", 1)[0], T.Q8_0))
    caplog.set_level(logging.INFO, logger="tokenmill")
    llm = LLM(str(path), tokenizer=str(folder), max_model_len=128, num_gpu_blocks_override=64, quantization="gguf")
    model = llm.engine.model
    o_proj, qkv = model.layers[0].self_attn.o_proj.weight, model.layers[1].self_attn.qkv_proj.weight
    assert o_proj.dtype == qkv.dtype == torch.float32
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resident:"))
    assert re.search(rf"Q5_0 has no kernel: {o_proj.numel() * 4 / MiB:.1f}\b", line), line
    assert re.search(rf"merged layer of mixed types Q4_K\+Q6_K: {qkv.numel() * 4 / MiB:.1f}\b", line), line
    assert _mib(r"dequantized at load ([\d.]+)", line) > 0, line
    assert _mib(r"GGUF blocks ([\d.]+)", line) > 0, line

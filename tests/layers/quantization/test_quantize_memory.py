"""Quantizing at load gives the float weights' memory back (issue 25, item 5).

A random Llama whose decoder linears are ~100 MiB of float32 is loaded three times, each in a fresh
process so RSS is its own: float32, int8 and int4. After loading, the float model's parameters are read
once (its weights that alias the safetensors mapping are resident only once touched, as in serving), and
RSS is read from /proc/self/status against the same process's RSS just before loading. Before the fix
the quantized loads ended *above* float32 (the file mapping stayed resident behind the norms that
aliased it, and every float weight was resident at once before packing).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")

# hidden 768, 4 layers: 25 MiB of float32 linears per layer (qkv 4.5, o 2.25, gate_up 12, down 6).
SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
             num_key_value_heads=4)

_PROBE = r"""
import gc, json, sys
import torch

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

path, method = sys.argv[1], sys.argv[2]
from tokenmill.layers.quantization import get_quantization_config
from tokenmill.model.loader import load_hf_config, load_model
import tokenmill.model.llama  # noqa: F401  (imports that load_model would do, before the baseline)
import tokenmill.layers.quantization.weight_only  # noqa: F401
load_hf_config(path)
gc.collect()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS, so the peak is the load's
except OSError:
    pass
before = status()
model, _, _ = load_model(path, quant_config=get_quantization_config(None if method == "none" else method))
peak = status()["VmHWM"]
gc.collect()
with torch.no_grad():
    for p in model.parameters():
        if p.is_floating_point():
            float(p.sum())  # a float weight aliasing the file is resident once read (the first forward)
after = status()
print(json.dumps({
    "rss": after["VmRSS"] - before["VmRSS"],
    "anon": after["RssAnon"] - before["RssAnon"],
    "file": after["RssFile"] - before["RssFile"],
    "peak": peak - before["VmRSS"],
    "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
}))
"""


def _write_model(path: Path) -> None:
    """config.json + model.safetensors of a random Llama (no tokenizer: load_model needs none)."""
    from safetensors.torch import save_file

    from tiny import make_config

    cfg = make_config("llama", vocab_size=512, **SHAPE)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "lm_head.weight": rand(cfg.vocab_size, h),
               "model.norm.weight": torch.ones(h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
        for name, shape in shapes.items():
            tensors[f"{p}{name}.weight"] = rand(*shape)
        tensors[f"{p}input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def loads(tmp_path_factory) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("qmem")
    _write_model(path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
    procs = {m: subprocess.Popen([sys.executable, "-c", _PROBE, str(path), m], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
             for m in ("none", "int8", "int4")}
    out = {}
    for m, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{m}: {stderr[-3000:]}"
        out[m] = json.loads(stdout.strip().splitlines()[-1])
    for m, r in out.items():  # shown with -s
        print(f"{m}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in r.items()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_load_gives_back_the_float_weights(loads, method):
    """RSS after a quantized load is below float32's by at least 80 % of the bytes quantizing saved."""
    float_, quant = loads["none"], loads[method]
    saved = float_["param_bytes"] - quant["param_bytes"]
    assert saved > 60 << 20  # the model is large enough for the weights to dominate
    shown = {k: f"{v / 2**20:.1f} MiB" for k, v in quant.items()}
    assert float_["rss"] - quant["rss"] >= 0.8 * saved, (
        f"{method}: RSS +{quant['rss'] / 2**20:.1f} MiB vs float32 +{float_['rss'] / 2**20:.1f} MiB, "
        f"weights {quant['param_bytes'] / 2**20:.1f} vs {float_['param_bytes'] / 2**20:.1f} MiB; {shown}")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_load_does_not_hold_the_whole_float_model(loads, method):
    """Layers are packed as they load: the peak stays under the whole float model plus its packed form
    (where it was before: every float weight, then the packed ones, then the file pages behind them)."""
    float_, quant = loads["none"], loads[method]
    bound = float_["param_bytes"] + quant["param_bytes"]
    assert quant["peak"] < bound, (f"{method}: load peaked at +{quant['peak'] / 2**20:.1f} MiB, "
                                   f"float32 + packed weights {bound / 2**20:.1f} MiB")


def _mapping_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path`."""
    real, total, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5] == real
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_released_pages_spare_live_tensors(tmp_path):
    """Only whole pages of tensors that no parameter holds are given back; a parameter that aliases the
    file (even one written since, so its pages are private copies) keeps its values, and a released
    tensor reads back the file's bytes."""
    from safetensors.torch import save_file
    from torch import nn

    from tokenmill.layers.linear import assign
    from tokenmill.model.loader import iter_safetensors
    from tokenmill.model.mapped_pages import MappedPages

    n = 300_001  # not a whole number of pages: neighbours share their boundary pages
    src = {name: torch.arange(n, dtype=torch.float32) + i for i, name in enumerate("abcd")}
    save_file(src, str(tmp_path / "model.safetensors"))
    pages = MappedPages()
    got = dict(iter_safetensors(str(tmp_path), None, pages))
    for t in got.values():
        float(t.sum())  # resident
    if not pages._pending:
        pytest.skip("this safetensors copies tensors instead of mapping the file")
    module = nn.Module()
    module.keep = nn.Parameter(torch.empty(n), requires_grad=False)
    assign(module.keep, got["b"])  # aliases the mapping
    assert module.keep.data_ptr() == got["b"].data_ptr()
    module.keep.data[:10] = -1.0  # written: those pages are this process's copies now
    before = _mapping_rss(tmp_path / "model.safetensors")
    released = pages.release(module)
    assert released >= 3 * n * 4 - 6 * 4096
    after = _mapping_rss(tmp_path / "model.safetensors")
    assert before - after >= released * 0.9
    assert after <= n * 4 + 2 * 4096 + (64 << 10)  # what is left: "b" (and fault-around neighbours)
    expected = src["b"].clone()
    expected[:10] = -1.0
    assert torch.equal(module.keep, expected)
    for name in "acd":
        assert torch.equal(got[name], src[name])  # faulted back in from the file
    assert pages.release(module) == 0  # "b" stays tracked while it is live
    del module.keep
    assert pages.release(module) > 0


def test_release_skips_ranges_whose_file_was_unmapped(tmp_path):
    """Once no tensor views the file it is unmapped and its addresses may be reused (an allocation, a JIT's
    code): release must leave such ranges alone, not zero whatever lies there now."""
    import ctypes
    import gc
    import mmap

    from safetensors.torch import save_file
    from torch import nn

    from tokenmill.model.loader import iter_safetensors
    from tokenmill.model.mapped_pages import MappedPages, _file_mappings

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(300_000, dtype=torch.float32)}, str(path))
    pages = MappedPages()
    got = dict(iter_safetensors(str(tmp_path), None, pages))
    if not pages._pending:
        pytest.skip("this safetensors copies tensors instead of mapping the file")
    assert len(pages._pending) == 1
    start, end = pages._pending[0][:2]
    del got
    gc.collect()
    if _file_mappings(str(path)):
        pytest.skip("the mapping outlived its tensors here")
    # Anonymous memory placed exactly where the file was, as an allocator or a JIT would, with a marker in it.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    a = start // page * page
    n = -(-end // page) * page - a
    map_fixed_noreplace = 0x100000  # Linux >= 4.17: fails instead of replacing a mapping
    got_at = libc.mmap(a, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_fixed_noreplace,
                       -1, 0)
    if got_at != a:
        pytest.skip("could not map memory at the freed addresses")
    try:
        ctypes.memset(a, 0x7F, n)
        assert pages.release(nn.Module()) == 0  # nothing released: the file is gone
        assert pages._pending == []
        assert ctypes.string_at(a, n) == b"\x7f" * n  # and the memory now there is untouched
    finally:
        libc.munmap(a, n)

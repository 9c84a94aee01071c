"""Instruction-set tiers of the native kernels: which build a CPU gets, and that every tier the build machine
can run computes what the float64 references say (each tier in its own process: a process loads one build)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill import isa, native

# /proc/cpuinfo flags of the two CPU families this project runs on (trimmed to what matters).
ZEN3 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe abm".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni avx512_bf16".split())
SKYLAKE_X = ZEN3 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl".split())
ALDER_LAKE = ZEN3 | {"avx_vnni"}
ALL = [t.name for t in isa.TIERS]


@pytest.mark.parametrize("flags, want", [(ZEN3, "avx2"), (ZEN4, "avx512_vnni"), (SKYLAKE_X, "avx512"),
                                         (ALDER_LAKE, "avx2_vnni")])
def test_each_cpu_gets_its_best_tier(flags, want):
    assert isa.pick(ALL, flags)[0] == want


def test_a_build_without_the_best_tier_falls_to_the_next_that_runs():
    assert isa.pick(["avx2"], ZEN4)[0] == "avx2"
    # An AVX-512 build copied to an AVX2-only machine is not loaded (it would die of SIGILL).
    tier, why = isa.pick(["avx512_vnni"], ZEN3)
    assert tier is None and "lacks" in why
    # No tier needs less than AVX2: an older CPU runs the torch fallback.
    assert isa.pick(ALL, frozenset({"sse2"}))[0] is None


def test_native_build_is_the_last_resort():
    assert isa.pick(["native"], None)[0] == "native"  # flags unreadable (not Linux): the build for this machine
    assert isa.pick(["avx2", "native"], ZEN3)[0] == "avx2"
    assert isa.pick(["avx2"], None)[0] is None


def test_forced_tier():
    assert isa.pick(ALL, ZEN4, forced="avx2") == ("avx2", "TOKENMILL_ISA=avx2")
    tier, why = isa.pick(ALL, ZEN3, forced="avx512")
    assert tier is None and "lacks" in why
    tier, why = isa.pick(["avx2"], ZEN4, forced="avx512_vnni")
    assert tier is None and "not built" in why


def test_build_tiers():
    assert isa.build_tiers("auto", ZEN4) == ["avx512_vnni", "avx2"]
    assert isa.build_tiers("auto", ZEN3) == ["avx2"]
    assert isa.build_tiers("auto", None) == []
    assert isa.build_tiers("all", ZEN3) == ALL
    assert isa.build_tiers("avx2, avx512", ZEN3) == ["avx2", "avx512"]
    with pytest.raises(ValueError, match="avx9"):
        isa.build_tiers("avx9", ZEN4)


def test_cpu_flags_reads_the_flags_line(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_vnni\nbugs\t\t: none\n")
    assert isa.cpu_flags(str(p)) == {"fpu", "avx2", "avx512_vnni"}
    assert isa.cpu_flags(str(tmp_path / "missing")) is None


def test_loaded_tier_is_the_pick():
    if not native.available():
        pytest.skip(f"native kernels not built: {native.load()}")
    want, _ = isa.pick(native.built_tiers(), isa.cpu_flags(), isa.forced())
    assert native.tier() == want
    vnni = {"avx512_vnni": "avx512-vnni", "avx2_vnni": "avx-vnni"}
    if native.tier() in isa.BY_NAME:
        assert native.int8_dot_path() == vnni.get(native.tier(), "avx2")
        assert native.cpu_capability() == ("AVX512" if native.tier().startswith("avx512") else "AVX2")


# The kernel tests against float64 references that differ by instruction set: the int8 dot products, the
# vectorised attention, norms, rotary and small GEMMs.
KERNEL_TESTS = ["tests/layers/quantization/test_int8_activations.py", "tests/layers/quantization/test_gguf_x8_rows.py", "tests/layers/quantization/test_int8_activation_rows.py",
                "tests/layers/test_fused_ops.py", "tests/layers/test_dense_linear.py", "tests/layers/test_cpu_paged_attention.py",
                "tests/sample/test_argmax.py"]


@pytest.mark.slow
@pytest.mark.parametrize("tier", [t.name for t in isa.TIERS])
def test_kernels_of_every_tier_this_machine_runs(tier):
    """The tier loaded by default runs in the whole suite; the others built here (`auto` builds AVX2 under the
    best one) get the kernel tests in a process of their own."""
    runs = {t.name for t in isa.runnable(isa.cpu_flags())}
    if tier not in native.built_tiers() or tier not in runs:
        pytest.skip(f"{tier}: not built here or not runnable on this CPU")
    if native.available() and tier == native.tier():
        pytest.skip(f"{tier} is the tier this process runs the suite with")
    env = dict(os.environ, TOKENMILL_ISA=tier)
    check = (f"from tokenmill import native; assert native.tier() == {tier!r}, native.load(); "
             "print(native.tier(), native.int8_dot_path())")
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # Kernels against their references; the whole-model tests in those files add time, not instruction paths.
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow",
                        "-k", "not model", *KERNEL_TESTS], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]
    # Skips for what the CPU lacks (e.g. native bf16) are fine; a skip for want of the kernels means the tier
    # did not load.
    missing = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED") and "not built" in line]
    assert not missing, missing

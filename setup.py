"""Builds tokenmill's native CPU kernels (tokenmill/csrc) as the extension `tokenmill._C`.

Metadata lives in pyproject.toml. The kernels are optional: without torch in the build environment
(pip's build isolation hides it: install with --no-build-isolation, as the Makefile does) or without
a C++ compiler, the package installs without them and the engine falls back to the torch_sdpa
attention backend. TOKENMILL_NO_NATIVE=1 skips the build on purpose.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

from setuptools import setup


def _accepts(flag: str) -> bool:
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        try:
            r = subprocess.run([cxx, flag, src, "-o", os.path.join(d, "t")], capture_output=True)
        except OSError:  # no compiler at all: the build below fails and is skipped
            return False
        return r.returncode == 0


def native_extensions():
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        print("tokenmill: TOKENMILL_NO_NATIVE=1, building without native kernels", file=sys.stderr)
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("tokenmill: torch is not importable at build time (build isolation?); building without native "
              "kernels. Install with `pip install --no-build-isolation -e .` to build them.", file=sys.stderr)
        return [], {}

    class OptionalBuild(BuildExtension):
        """A missing or failing compiler leaves the package without kernels, never without an install."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - any compiler failure
                print(f"tokenmill: native kernels not built ({e}); attention falls back to torch_sdpa",
                      file=sys.stderr)

    # The kernels are built for the machine that installs them (its vector width: AVX2, AVX-512, NEON).
    arch = os.environ.get("TOKENMILL_ARCH_FLAGS")
    arch_flags = arch.split() if arch is not None else (["-march=native"] if _accepts("-march=native") else [])
    ext = CppExtension(
        "tokenmill._C",
        sources=sorted(glob.glob("tokenmill/csrc/*.cpp")),
        depends=sorted(glob.glob("tokenmill/csrc/*.h")),  # a changed header rebuilds
        extra_compile_args=["-O3", "-fopenmp", "-std=c++17", *arch_flags],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": OptionalBuild.with_options(use_ninja=False)}


ext_modules, cmdclass = native_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

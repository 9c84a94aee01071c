"""Builds tokenmill's native CPU kernels (tokenmill/csrc) as the extension `tokenmill._C`.

Metadata lives in pyproject.toml. The kernels are optional: without torch in the build environment
(pip's build isolation hides it: install with --no-build-isolation, as the Makefile does) or without
a C++ compiler, the package installs without them and the engine falls back to the torch_sdpa
attention backend. TOKENMILL_NO_NATIVE=1 skips the build on purpose.
"""
from __future__ import annotations

import glob
import importlib.util
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

    sources = sorted(glob.glob("tokenmill/csrc/*.cpp"))
    depends = sorted(glob.glob("tokenmill/csrc/*.h"))  # a changed header rebuilds

    def extension(name: str, arch_flags: list[str]):
        return CppExtension(name, sources=sources, depends=depends,
                            extra_compile_args=["-O3", "-fopenmp", "-std=c++17", *arch_flags],
                            extra_link_args=["-fopenmp"])

    # One build per instruction-set tier (tokenmill/isa.py); tokenmill/native.py loads the best one the running
    # CPU has. TOKENMILL_ARCH_FLAGS, non-x86 CPUs and compilers without -march=x86-64-v4 get one build for this
    # machine instead (-march=native), loaded as the tier "native".
    isa = _load_isa()
    arch = os.environ.get("TOKENMILL_ARCH_FLAGS")
    if arch is None and isa.is_x86() and _accepts("-march=x86-64-v4"):
        tiers = isa.build_tiers(os.environ.get("TOKENMILL_ISA_TIERS", "auto"), isa.cpu_flags())
        exts = [extension(f"tokenmill._C_{t}", list(isa.BY_NAME[t].compile_flags)) for t in tiers
                if all(_accepts(f) for f in isa.BY_NAME[t].compile_flags)]
        print(f"tokenmill: native kernels for {[e.name for e in exts]}", file=sys.stderr)
    else:
        flags = arch.split() if arch is not None else (["-march=native"] if _accepts("-march=native") else [])
        exts = [extension(f"tokenmill._C_{isa.NATIVE}", flags)]
    # Ninja compiles the files of a build in parallel, one per core.
    return exts, {"build_ext": OptionalBuild.with_options(use_ninja=_has_ninja())}


def _load_isa():
    spec = importlib.util.spec_from_file_location("tokenmill_isa", os.path.join(os.path.dirname(__file__) or ".",
                                                                                "tokenmill", "isa.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is made
    spec.loader.exec_module(module)
    return module


def _has_ninja() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:
        return False
    return is_ninja_available()


ext_modules, cmdclass = native_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

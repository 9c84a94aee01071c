"""Instruction-set tiers of the native kernels: which builds exist, what each needs of the CPU, which one runs.

The extension is compiled once per tier (`tokenmill/_C_<tier>*.so`, setup.py) and `native.load()` loads the
best tier the running CPU has, so a build made on one machine neither crashes (SIGILL) nor silently runs at
AVX2 width on another. The tier decides the vector width of every kernel (ATen's `at::vec` is 512-bit under
AVX-512) and the integer dot product of the int8-activation kernels (VNNI's `vpdpbusd` or AVX2's
maddubs + madd). AMX is not a tier: oneDNN, which runs the float and int8 GEMMs, uses it by itself.

Standard library only: setup.py loads this file before tokenmill (or torch) is importable.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]  # as /proc/cpuinfo spells them; all must be present to run this tier


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})  # abm: LZCNT
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# Best first: the loader takes the first tier that was built and that the CPU runs.
TIERS: tuple[Tier, ...] = (
    Tier("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}),
    Tier("avx512", ("-march=x86-64-v4",), _V4),
    Tier("avx2_vnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}),
    Tier("avx2", ("-march=x86-64-v3",), _V3),
)
BY_NAME = {t.name: t for t in TIERS}
# A build for the build machine only (-march=native, or TOKENMILL_ARCH_FLAGS): non-x86 CPUs, old compilers.
NATIVE = "native"


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The running CPU's feature flags, or None where they cannot be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def runnable(flags: frozenset[str] | None) -> list[Tier]:
    """The tiers this CPU can run, best first (none when its flags are unknown)."""
    if flags is None:
        return []
    return [t for t in TIERS if t.cpu_flags <= flags]


def pick(built: list[str], flags: frozenset[str] | None, forced: str | None = None) -> tuple[str | None, str]:
    """The tier to load among `built` for a CPU with `flags`, and why; (None, reason) when none fits.
    `forced` (TOKENMILL_ISA) names a lower tier to load instead, e.g. to test or compare it."""
    ok = [t.name for t in runnable(flags)]
    if forced:
        if forced not in built:
            return None, f"TOKENMILL_ISA={forced} was not built (built: {', '.join(built) or 'none'})"
        if forced != NATIVE and forced not in ok:
            return None, f"TOKENMILL_ISA={forced} needs CPU features this CPU lacks"
        return forced, f"TOKENMILL_ISA={forced}"
    for name in ok:
        if name in built:
            return name, "the best tier built that this CPU runs"
    if NATIVE in built:
        return NATIVE, "built for the build machine (-march=native)"
    why = "its CPU flags could not be read" if flags is None else "this CPU lacks the features of every tier built"
    return None, f"no native kernel build fits ({why}; built: {', '.join(built) or 'none'})"


def build_tiers(request: str, flags: frozenset[str] | None) -> list[str]:
    """The tiers setup.py compiles. `auto`: the best tier the build machine runs, and AVX2 under it (so a copy
    on an AVX2-only CPU still has kernels, and the tests here run the AVX2 integer path too); `all`: every
    tier (a build to ship); else a comma list of tier names."""
    if request == "all":
        return [t.name for t in TIERS]
    if request != "auto":
        names = [n.strip() for n in request.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise ValueError(f"TOKENMILL_ISA_TIERS: unknown tier(s) {unknown}; known: {list(BY_NAME)}, auto, all")
        return names
    ok = [t.name for t in runnable(flags)]
    if not ok:
        return []
    return [ok[0]] + (["avx2"] if ok[0] != "avx2" and "avx2" in ok else [])


def forced() -> str | None:
    return os.environ.get("TOKENMILL_ISA") or None

"""Every module of tokenmill.layers and tokenmill.model imports on its own, first: no import cycle hides behind
the order in which the rest of the package happens to import them (mxfp4 once imported linear, which imports
the quantization package, which imports mxfp4)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import importlib, pkgutil, sys
import torch  # noqa: F401 - loaded once; only tokenmill's modules are dropped between imports
import tokenmill.layers, tokenmill.model
names = [m.name for pkg in (tokenmill.layers, tokenmill.model)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
failed = []
for name in names:
    for mod in [m for m in sys.modules if m == "tokenmill" or m.startswith("tokenmill.")]:
        del sys.modules[mod]
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - report every module that fails
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(len(names))
print("\n".join(failed))
"""


def test_each_module_imports_first():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    count, *failed = out.stdout.strip().splitlines()
    assert int(count) > 40
    assert not [f for f in failed if f], failed

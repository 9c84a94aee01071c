"""The prepared device check (issue 31, benchmarks/gpu_check.py) runs here in its CPU smoke mode, every section,
and writes its report: so it is known to run before a GPU is lent (where it runs for real)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    report = json.loads((out / "report.json").read_text())
    assert set(report) == {"env", "attention", "parity", "throughput", "serve", "roofline", "step_profile"}, \
        proc.stdout[-2000:]
    errors = {k: v["error"] for k, v in report.items() if "error" in v}
    assert not errors and proc.returncode == 0, errors or proc.stdout[-2000:]
    assert all(case["ok"] for case in report["attention"]["result"].values())
    assert all(r["same_tokens"] for r in report["parity"]["result"].values())
    assert report["serve"]["result"]["tok_s"] > 0 and report["roofline"]["result"]["gemm_tflops"] > 0
    assert (out / "report.md").read_text().startswith("# gpu_check report")
    assert report["step_profile"]["result"]["step_ms_under_cprofile"] > 0 and (out / "step_profile.txt").exists()

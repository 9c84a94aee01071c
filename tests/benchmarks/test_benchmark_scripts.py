"""The benchmark scripts that start servers: `--port` picks the first server's port, and Ctrl-C stops the script
and every server it started within 10 s (issue 50 item 8; benchmarks/_servers.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import free_port

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from _servers import descendants  # noqa: E402

# A script starts servers when it calls the harness's start_server, Popen, or runs `tokenmill ... serve`: found,
# not listed, so that a new benchmark cannot be left out.
STARTS_SERVERS = re.compile(r"start_server\(|Popen\(|[\"']serve[\"']")
SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if STARTS_SERVERS.search(p.read_text()))


def test_the_server_starting_benchmarks_are_found():
    assert {"slo", "soak", "routing", "fair_share"} <= set(SCRIPTS), SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_server_starting_benchmark_takes_a_port(script):
    """Each one's parser has `--port` (benchmarks/_servers.add_port_argument), main() installs the Ctrl-C handler
    with its value (_servers.install), and its servers take their ports from it (_servers.next_port)."""
    text = (REPO / "benchmarks" / f"{script}.py").read_text()
    assert "_servers.add_port_argument(" in text and re.search(r"_servers\.install\(\w+\.port\)", text), script
    assert "_servers.next_port()" in text, f"{script}: its servers' ports do not come from --port"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_stops_the_benchmark_and_its_server_within_10_s(tmp_path):
    """benchmarks/slo.py, the smallest run: once its server answers on --port, one SIGINT ends the script and
    leaves no process of it (the server, its engine core) within 10 s."""
    port = free_port()
    cmd = [sys.executable, str(REPO / "benchmarks" / "slo.py"), "--policies", "fcfs", "--port", str(port),
           "--interactive-requests", "4", "--batch-requests", "4", "--batch-input", "64", "--max-model-len", "512"]
    log = open(tmp_path / "slo.log", "w")
    bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                             env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert bench.poll() is None, (tmp_path / "slo.log").read_text()
            assert time.monotonic() < deadline, "the benchmark's server never answered on --port"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        below = descendants(bench.pid)
        assert below, "no server process under the benchmark"
        bench.send_signal(signal.SIGINT)
        start = time.monotonic()
        bench.wait(10)  # TimeoutExpired fails the test
        took = time.monotonic() - start
        deadline = start + 10
        while any(_alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in below if _alive(p)], (below, (tmp_path / "slo.log").read_text())
        assert took < 10
    finally:
        if bench.poll() is None:
            for pid in descendants(bench.pid):
                os.kill(pid, signal.SIGKILL)
            bench.kill()
            bench.wait(10)

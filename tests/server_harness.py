"""Start `tokenmill serve` in a subprocess on a free port, wait until it is healthy, read its metrics."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@contextmanager
def serve_in_thread(app, **config):
    """An ASGI app served by uvicorn in a thread of this process; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)

@dataclass
class LiveServer:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None = None

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """{'name{label="v",...}': value} for every tokenmill sample."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def metric(self, name: str) -> float:
        return self.metrics()[name]

    def wait_metric(self, name: str, value: float, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            got = self.metric(name)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_server(model: str | None, log_path: Path, *args: str, api_key: str | None = None,
                 timeout: float = 120.0, port: int | None = None, one_thread: bool = True,
                 repo: Path = REPO) -> LiveServer:
    """`tokenmill serve` of the checkout at `repo` (its PYTHONPATH and cwd) in a subprocess, healthy;
    `one_thread`: OMP_NUM_THREADS=1 (tests), else torch's default (benchmarks)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve"] + ([str(model)] if model else [])
    cmd += ["--port", str(port), "--disable-uvicorn-access-log", *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(repo))
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    env.pop("TOKENMILL_API_KEY", None)
    if api_key:
        env["TOKENMILL_API_KEY"] = api_key
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo)
    server = LiveServer(proc, f"http://127.0.0.1:{port}", log_path, api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url("/health"), timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise TimeoutError(f"server did not become healthy in {timeout} s:\n{server.log()}")


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of a process (engine cores, workers; not the resource
    tracker), oldest first."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for c in (task / "children").read_text().split():
            cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "spawn_main" in cmd:
                found.append(int(c))
    return sorted(found)

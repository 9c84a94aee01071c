"""How `tokenmill serve` starts and stops: its --help names only flags it takes, its start-up log names the KV
connector of a disaggregated prefill/decode instance, and SIGTERM or SIGINT to the server's whole process
group (what `systemctl stop`, `docker stop` and Ctrl-C in a terminal send) drains in-flight requests, logs
no error, exits 0 and removes what the server created (the disk KV tier's folder)."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_harness import REPO, free_port
from tiny import make_tiny_model

MODEL = "tiny"
# Slow enough (a few ms a token) that a long request is still streaming when the signal arrives.
SLOW = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4)
MAX_TOKENS = 300
DRAIN_TIMEOUT_S = 120.0  # far longer than the request needs: the drain lets it finish


# ---- --help ---------------------------------------------------------------------------------------------
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
# A flag of another command, named with it: "`bench serve --result-json`", "`generate --sampling-seed`".
OTHER_COMMAND_FLAG = re.compile(r"`(?:tokenmill )?([a-z][a-z ]*?) (--[a-z0-9][a-z0-9-]*)")


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """{"serve": parser, "bench serve": parser, ...}: every (sub)command of `tokenmill`."""
    from tokenmill.cli import build_parser

    found = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(p, f"{name} {sub}".strip())

    walk(build_parser(), "")
    return found


def help_text(parser: argparse.ArgumentParser, monkeypatch) -> str:
    # Wide enough that no flag is wrapped at one of its hyphens.
    monkeypatch.setenv("COLUMNS", "100000")
    return parser.format_help()


def unknown_flags(name: str, parsers: dict, text: str) -> list[str]:
    known = parsers[name]._option_string_actions
    named_elsewhere = set()
    bad = []
    for command, flag in OTHER_COMMAND_FLAG.findall(text):
        if command in parsers and command != name:
            named_elsewhere.add(flag)
            if flag not in parsers[command]._option_string_actions:
                bad.append(f"`{command} {flag}`")
    bad += [f for f in FLAG.findall(text) if f not in known and f not in named_elsewhere]
    return sorted(set(bad))


@pytest.mark.parametrize("command", sorted(n for n in all_parsers() if n))
def test_help_names_only_flags_the_command_takes(command, monkeypatch):
    """Every --flag in a command's --help is one of its own options, or named with the command that takes it
    (`serve --help` once said "See also --sampling-seed", a flag of generate and chat only)."""
    parsers = all_parsers()
    text = help_text(parsers[command], monkeypatch)
    assert unknown_flags(command, parsers, text) == []


def test_help_check_catches_a_foreign_flag():
    parsers = all_parsers()
    assert unknown_flags("serve", parsers, "Seed of the engine. See also --sampling-seed.") == ["--sampling-seed"]
    assert unknown_flags("serve", parsers, "A seed of its own (`generate --sampling-seed`).") == []
    assert unknown_flags("serve", parsers, "(`generate --no-such-flag`)") == ["`generate --no-such-flag`"]


# ---- the KV connector's start-up line -------------------------------------------------------------------
def test_kv_transfer_start_up_line_names_connector_and_role(tmp_path):
    from tokenmill.config import KVTransferConfig
    from tokenmill.serve.server import kv_transfer_summary

    producer = KVTransferConfig.parse({"kv_role": "kv_producer", "kv_connector": "SharedStorageConnector",
                                       "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    line = kv_transfer_summary(producer, "http://127.0.0.1:8001")
    assert line.startswith("KV connector: SharedStorageConnector, role: kv_producer;")
    assert str(tmp_path) in line and "http://127.0.0.1:8001/v1/kv_blocks" in line

    consumer = KVTransferConfig.parse({"kv_role": "kv_consumer", "kv_connector": "TCPConnector",
                                       "kv_connector_extra_config": {"shared_storage_path": str(tmp_path),
                                                                     "producers": ["http://prefill:8001"]}})
    line = kv_transfer_summary(consumer, "http://127.0.0.1:8002")
    assert line.startswith("KV connector: TCPConnector, role: kv_consumer;")
    assert "http://prefill:8001" in line and str(tmp_path) in line and "/v1/kv_blocks" not in line


# ---- a signal to the whole process group ----------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("shutdown") / "llama", "llama", **SLOW)


def start_in_own_group(model: Path, log_path: Path, *args: str, timeout: float = 180.0) -> tuple:
    """`tokenmill serve` as the leader of a new process group (a systemd unit's or a container's main process),
    once healthy: (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill", "serve", str(model), "--port", str(port),
           "--disable-uvicorn-access-log", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(REPO))
    env.pop("TOKENMILL_API_KEY", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    kill_group(proc)
    raise TimeoutError(f"server did not become healthy in {timeout} s:\n{log_path.read_text()}")


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def wait_group_gone(pgid: int, timeout: float) -> bool:
    """True once no process of the group is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_process_group_drains_and_cleans_up(sig, slow_model, tmp_path):
    kv_dir = tmp_path / "kv"
    log_path = tmp_path / "server.log"
    proc, base = start_in_own_group(
        slow_model, log_path, "--served-model-name", MODEL, "--kv-cache-memory-bytes", "16M",
        "--max-model-len", "512", "--kv-offload-bytes", "64K", "--kv-offload-dir", str(kv_dir),
        "--kv-offload-min-blocks", "1", "--drain-timeout", str(DRAIN_TIMEOUT_S))
    try:
        tier_dirs = [p.name for p in kv_dir.iterdir()]
        assert len(tier_dirs) == 1 and tier_dirs[0].startswith("tokenmill-kv-"), tier_dirs
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "stream": True}
        before, after = [], []
        with httpx.Client(base_url=base, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = (line.removeprefix("data: ") for line in r.iter_lines() if line)
                before.append(next(lines))  # the request is running
                os.killpg(proc.pid, sig)
                signalled = time.monotonic()
                after += lines  # ends when the stream does; each read waits at most the client's timeout
        assert after and after[-1] == "[DONE]"
        chunks = [json.loads(e) for e in before + after[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained: finished, not aborted
        assert "".join(c["choices"][0]["text"] for c in chunks)
        assert len(after) > 10  # the signal came mid-stream, and tokens kept coming: drained, not cut

        assert proc.wait(DRAIN_TIMEOUT_S - (time.monotonic() - signalled) + 30) == 0
        assert wait_group_gone(proc.pid, 30), "a process of the server's group outlived it"
        log = log_path.read_text()
        assert f"received {signal.Signals(sig).name}: draining" in log
        assert not [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line], log
        assert list(kv_dir.iterdir()) == [], "the disk KV tier's folder was left behind"
    finally:
        if proc.poll() is None or not wait_group_gone(proc.pid, 0.1):
            kill_group(proc)


# ---- the engine core process on its own -----------------------------------------------------------------
def start_core(model: Path, kv_dir: Path):
    """The engine-core process as the server starts it: (process, the server's end of its pipe)."""
    import multiprocessing as mp

    from tokenmill.engine.core_proc import core_process_main
    from tokenmill.engine_args import EngineArgs

    config = EngineArgs(model=str(model), max_model_len=256, kv_cache_memory_bytes=16 << 20,
                        kv_offload_bytes=64 << 10, kv_offload_dir=str(kv_dir),
                        kv_offload_min_blocks=1).create_engine_config()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=core_process_main, args=(config, child), name="tokenmill-engine-core")
    proc.start()
    child.close()
    return proc, conn


def receive(conn, kind: str, timeout: float):
    from tokenmill.engine.core_proc import load_frame

    deadline = time.monotonic() + timeout
    while conn.poll(max(deadline - time.monotonic(), 0)):
        for k, payload in load_frame(conn.recv_bytes()):
            if k == kind:
                return payload
    raise TimeoutError(f"no {kind!r} message in {timeout} s")


@pytest.mark.timeout(300)
def test_core_ignores_signals_and_cleans_up_when_its_server_is_gone(tmp_path):
    """The core leaves SIGTERM and SIGINT to its server; a server that dies without a word (SIGKILL) closes
    the pipe, and the core exits 0 and removes its disk tier's folder."""
    from tokenmill.engine.core_proc import dump_frame

    kv_dir = tmp_path / "kv"
    proc, conn = start_core(make_tiny_model(tmp_path / "m", "llama"), kv_dir)
    try:
        receive(conn, "ready", 180)
        assert [p.name.startswith("tokenmill-kv-") for p in kv_dir.iterdir()] == [True]
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGINT)
        conn.send_bytes(dump_frame([("utility", (1, "check_health", ()))]))
        assert receive(conn, "utility", 60) == (1, True, None)  # it took the signals and answers
        assert proc.is_alive()
        conn.close()  # the server is gone
        proc.join(60)
        assert proc.exitcode == 0
        assert list(kv_dir.iterdir()) == []
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@pytest.mark.timeout(300)
def test_core_still_starting_exits_when_its_server_is_gone(tmp_path):
    kv_dir = tmp_path / "kv"
    proc, conn = start_core(make_tiny_model(tmp_path / "m", "llama"), kv_dir)
    try:
        conn.close()  # stopped while the core loads
        proc.join(120)
        assert proc.exitcode == 0
        assert not kv_dir.exists() or list(kv_dir.iterdir()) == []
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)

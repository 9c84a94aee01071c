"""The `tokenmill` command line, run in-process on a tiny random model."""
from __future__ import annotations

from pathlib import Path
import io
import os
import subprocess
import sys

import pytest

from tiny import make_tiny_model
from tokenmill.cli import main, parse_bytes
from tokenmill.engine.engine import LLMEngine

GREEDY = ["--temperature", "0", "--max-tokens", "12", "--ignore-eos"]
# The default KV cache takes a share of free RAM; a small one keeps each engine start fast.
ENGINE = ["--max-model-len", "256", "--kv-cache-memory-bytes", "16M"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("cli-llama"), "llama"))


@pytest.fixture(scope="module")
def llm(model):
    from tokenmill.llm import LLM

    return LLM(model, max_model_len=256, kv_cache_memory_bytes=16 << 20)


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse: --help and usage errors
        return e.code


@pytest.fixture
def prompts(monkeypatch) -> list[list[int]]:
    """Records the prompt token ids of every request the engine is given."""
    seen: list[list[int]] = []
    original = LLMEngine.add_request

    def spy(self, request_id, prompt, params=None, **kw):
        group = original(self, request_id, prompt, params, **kw)
        seen.append(group.prompt_token_ids)
        return group

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    return seen


def test_generate_matches_llm_generate(model, llm, capsys):
    from tokenmill import SamplingParams

    expected = llm.generate("The quick brown", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert run(["generate", model, "--prompt", "The quick brown", *ENGINE, *GREEDY]) == 0
    out, err = capsys.readouterr()
    assert out == expected[0].outputs[0].text + "\n"
    assert "12 tokens" in err and "tok/s" in err


def test_generate_chat_quiet(model, llm, capsys):
    from tokenmill import SamplingParams

    expected = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=12))
    assert run(["generate", "--model", model, "--prompt", "Hello", "--chat", "--quiet", *ENGINE,
                "--temperature", "0", "--max-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert out == expected[0].outputs[0].text + "\n"
    assert err == ""


def test_generate_n(model, capsys):
    assert run(["generate", model, "--prompt", "Once upon", "-n", "2", "--sampling-seed", "1",
                "--max-tokens", "4", "-q", *ENGINE]) == 0
    out = capsys.readouterr().out
    assert "=== completion 0 ===" in out and "=== completion 1 ===" in out


def test_chat_repl_two_turns_reset_eof(model, tiny_tokenizer, prompts, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("first question\nsecond question\n/reset\nthird question\n"))
    assert run(["chat", model, "--system", "You are a fox.", *ENGINE, *GREEDY]) == 0
    out, err = capsys.readouterr()
    texts = [tiny_tokenizer.decode(p) for p in prompts]
    assert len(texts) == 3
    # The second prompt is the first one plus the streamed first answer and the second question.
    assert texts[1].startswith(texts[0]) and "second question" in texts[1]
    first_reply = texts[1][len(texts[0]):].split("<|im_end|>")[0]
    assert first_reply and out.startswith(first_reply + "\n")  # streamed, with no "> " prompt (stdin is no TTY)
    assert "first question" not in texts[2] and "You are a fox." in texts[2]  # /reset keeps the system prompt
    assert "conversation cleared" in err


def test_chat_once(model, llm, prompts, capsys):
    from tokenmill import SamplingParams

    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi there"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    prompts.clear()
    assert run(["chat", model, "--system", "S", "--once", "Hi there", "-q", *ENGINE, *GREEDY]) == 0
    assert capsys.readouterr().out == expected[0].outputs[0].text + "\n"
    assert prompts == [expected[0].prompt_token_ids]


def test_chat_ctrl_c_aborts_reply(model, monkeypatch, capsys):
    def interrupt(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(LLMEngine, "step", interrupt)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/exit\n"))
    assert run(["chat", model, *ENGINE, *GREEDY]) == 0
    assert "stopped" in capsys.readouterr().err


def test_bad_parameter(model, capsys):
    assert run(["generate", model, "--prompt", "x", "--temperature", "-1", *ENGINE]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "temperature" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_model(tmp_path, capsys):
    assert run(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not found" in err and len(err.strip().splitlines()) == 1


def test_help(capsys):
    assert run(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    for command in ("generate", "chat"):
        assert run([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--max-num-batched-tokens" in out and "--no-enable-prefix-caching" in out


def test_parse_bytes():
    assert parse_bytes("512M") == 512 * 2**20
    assert parse_bytes("2G") == 2 * 2**30
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("4096") == 4096


def test_python_m_help():
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "--help"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "chat" in proc.stdout and "generate" in proc.stdout

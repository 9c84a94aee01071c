import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")

"""`tokenmill serve` on the embedded SmolLM2-135M-Instruct answers a real question through the openai client."""
from __future__ import annotations

import openai
import pytest

from server_harness import start_server
from tokenmill.model.default import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    srv = start_server(None, tmp_path_factory.mktemp("real") / "server.log", "--max-model-len", "1024",
                       "--kv-cache-memory-bytes", "64M", timeout=240)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_capital_of_france(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120, max_retries=0)
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                              stream=True,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content

import os
import sys

# tests/ mirrors tokenmill/'s packages (tests/serve/, tests/core/, ...); the shared helpers (tiny.py, gguf_tiny.py,
# server_harness.py, ...) live here at the top, and a test may import another's fixtures by module name: every
# folder on the path, the top first.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _dir in sorted(d for d, _, _ in os.walk(_HERE) if "__pycache__" not in d)[::-1]:
    sys.path.insert(0, _dir)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One intra-op thread: the test models are tiny, and on a busy 2-core machine two OpenMP threads make
# every GEMM wait for the slower core (parity tests went from ~1 s to ~37 s under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton kernels (the triton_paged attention backend) run in Triton's interpreter on this CPU-only machine. Triton
# reads this when it is imported, which torch._dynamo does as soon as anything loads it: set before any import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The test models are tiny: one intra-op thread is as fast, and does not stall when the CPUs are shared.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

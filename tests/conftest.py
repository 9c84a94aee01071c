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


# `make test-fast` leaves these out (`-m "not integration"`); `make test` runs them. Each one drives tokenmill as a
# whole: a `tokenmill serve` process (or several), worker processes of tensor / pipeline / data / context
# parallelism, the CLI and benchmark scripts as subprocesses, the docs' examples against a live server. Every
# package keeps its unit tests in test-fast. Paths relative to tests/ (docs/testing.md).
INTEGRATION_FILES = {
    "bench/test_bench_e2e.py",
    "benchmarks/test_benchmark_scripts.py",
    "benchmarks/test_gpu_check.py",
    "cli/test_cli.py",
    "core/test_kv_connector.py",
    "engine/test_ipc.py",
    "executor/test_context_parallel.py",
    "executor/test_data_parallel.py",
    "executor/test_parallel.py",
    "serve/test_anthropic_messages.py",
    "serve/test_console_browser.py",
    "serve/test_console_routes.py",
    "serve/test_embeddings.py",
    "serve/test_request_bounds.py",
    "serve/test_responses_api.py",
    "serve/test_server.py",
    "serve/test_server_core_process.py",
    "serve/test_server_fuzz.py",
    "serve/test_server_hardening.py",
    "serve/test_server_limits.py",
    "serve/test_server_lora.py",
    "serve/test_server_offload.py",
    "serve/test_server_real_model.py",
    "serve/test_server_shutdown.py",
    "serve/test_slo_floor.py",
    "serve/test_tenant_security.py",
    "serve/test_tenants.py",
    "serve/test_usage.py",
    "structured_output/test_server_structured.py",
    "test_docs_examples.py",
    "test_fault_injection.py",
    "test_isa.py",
}


# Tests that compare a request's latency under an attack with a control: a busy neighbour (the other xdist worker)
# makes that comparison noise, so `make test` runs them after the parallel part, in one process, with nothing
# beside them (`-m alone`). A whole file, or file::test (the name without its parameters).
ALONE = {
    "engine/test_ipc.py::test_a_victim_keeps_its_latency_while_megabyte_requests_arrive",
    "serve/test_request_bounds.py::test_a_batch_of_prompts_with_a_large_logit_bias_keeps_health_responsive",
    "serve/test_request_bounds.py::test_echo_logprobs_attack_leaves_its_neighbour_alone",
    "serve/test_server_hardening.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = os.path.relpath(str(item.path), _HERE)
        if path in INTEGRATION_FILES:
            item.add_marker(pytest.mark.integration)
        if path in ALONE or f"{path}::{item.originalname}" in ALONE:
            item.add_marker(pytest.mark.alone)


def pytest_sessionstart(session):
    # a renamed or moved file must not fall out of `make test-fast`'s exclusion silently
    missing = sorted(f for f in INTEGRATION_FILES | {a.split("::")[0] for a in ALONE}
                     if not os.path.isfile(os.path.join(_HERE, f)))
    if missing:
        raise pytest.UsageError(f"tests/conftest.py INTEGRATION_FILES / ALONE name files that do not exist: {missing}")

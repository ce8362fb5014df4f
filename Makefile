# Two commands on a fresh machine: `make demo` and `make test` (both create .venv on first use).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q "torch==2.13.0"
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[dev,deepspeed,webui]"
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rlfactory train examples/quickstart/sft.yaml overwrite_output_dir=true

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src

docs: $(STAMP)
	$(BIN)/rlfactory config docs > docs/CONFIG.md

clean:
	rm -rf $(VENV) outputs .pytest_cache

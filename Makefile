# Quickstart: `make demo` trains a small model on Tiny Shakespeare; `make test` runs the test suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Corpora: $CONTINUUMLM_DATA if set; a sibling shared/data folder when present; else downloaded.
ifneq ($(wildcard ../shared/data/tinyshakespeare.txt),)
export CONTINUUMLM_DATA ?= $(abspath ../shared/data)
endif

.PHONY: install install-dev demo test test-slow test-hf-suite lint bench results clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Install torch only when none is importable, so a user's own (e.g. CUDA) build is kept.
# TORCH_INDEX: a package index to take it from (PyTorch's CPU wheel index, on a machine
# without a GPU: the CUDA build that the default index may give is several GB).
TORCH_INDEX ?=
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The demo's run folder is scratch: each `make demo` starts it afresh.
demo: $(VENV)/.installed
	rm -rf runs/demo
	$(BIN)/continuumlm train --config configs/shakespeare_char/demo.toml --out runs/demo
	$(BIN)/continuumlm eval --checkpoint runs/demo
	$(BIN)/continuumlm generate --checkpoint runs/demo --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 --top-k 40 --seed 1

# pytest-xdist: one worker per core (each test runs torch on one thread: tests/conftest.py);
# PYTEST_WORKERS=0 runs in this process
PYTEST_WORKERS ?= auto
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS)

test-slow: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -m slow -n $(PYTEST_WORKERS)

# transformers' own model tests (ModelTesterMixin, ConfigTester) against continuumlm.hf, in four
# configurations and with each attention mask of HF_SUITE_MASKS (ones, padded, random). The test
# files come from the installed transformers' source distribution, downloaded once into
# .cache/hf-suite/ (later runs are offline); prints passed/failed/skipped per configuration.
HF_SUITE_MASKS ?= ones,padded
test-hf-suite: $(VENV)/.installed-dev
	$(BIN)/python tests/hf_conformance/run.py --mask $(HF_SUITE_MASKS)

# The performance suite (ODE cost, memory, kernels, mixers, decoding, processes/compile, MFU).
bench: $(VENV)/.installed-dev
	$(BIN)/pip install -q -e ".[plot]"
	$(BIN)/continuumlm experiment bench --redo

# Every experiment behind docs/results.md, then the page and its figures. Runs whose JSON is in
# bench/results/ are skipped, so with the committed results this only re-renders; delete a JSON
# and its run folder (runs/bench/) to redo its run (the whole set from scratch takes several hours
# on 2 CPU cores).
results: $(VENV)/.installed-dev
	$(BIN)/pip install -q -e ".[plot]"
	$(BIN)/continuumlm experiment all

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests bench examples

clean:
	rm -rf runs/demo .pytest_cache

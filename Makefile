# Set-up is idempotent: each step leaves a stamp and is skipped when it is there.
PYTHON ?= python3
VENV   := .venv
BIN    := $(abspath $(VENV))/bin
STAMPS := $(VENV)/.stamps
PYTEST_ARGS ?=

export PATH := $(BIN):$(PATH)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup demo test pytest bazel-test bench clean

setup: $(STAMPS)/tfdist $(STAMPS)/system

# The virtual environment and tfdist with its CPU TensorFlow and test tools.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

$(STAMPS)/tfdist: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[cpu,test]"
	mkdir -p $(STAMPS) && touch $@

# Debian packages: Bazel for `bazel test //...`.
$(STAMPS)/system: | $(BIN)/python
	command -v bazel >/dev/null || { apt-get update -q && apt-get install -y -q bazel-bootstrap; }
	mkdir -p $(STAMPS) && touch $@

demo: setup
	tfdist train --config configs/default.yaml

test: setup
	$(MAKE) pytest
	$(MAKE) bazel-test

pytest:
	pytest $(PYTEST_ARGS)

bazel-test:
	bazel test //...

bench: setup
	OMP_NUM_THREADS=1 tfdist bench overhead --json results/overhead.json --repeats 9
	OMP_NUM_THREADS=1 tfdist bench pipeline --json results/pipeline.json --repeats 5
	OMP_NUM_THREADS=1 tfdist bench parameter_server --json results/parameter_server.json --repeats 5

clean:
	rm -rf $(VENV) bazel-* .pytest_cache

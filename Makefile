# Quickstart targets: each sets up a virtual environment from plain Python + pip, then runs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned to the CPU build found on the local disk when no torch is present; an
# existing torch >= 2.11 (e.g. a CUDA build) is kept.
install: $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade setuptools wheel
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[test]"

demo: install
	$(BIN)/python -m qtensor demo

# CUDA tests are deselected here and run on the GPU machine by benchmarks/gpu_check.sh.
test: install
	$(BIN)/python -m pytest -q -m "not cuda"

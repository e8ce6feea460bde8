# Quickstart targets: each sets up a virtual environment from plain Python + pip, then runs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned to the CPU build found on the local disk when no torch is present; an
# existing torch >= 2.11 (e.g. a CUDA build) is kept. The install is editable, so Python edits
# need none: it runs again only when the package metadata or the C++/CUDA sources change (the
# stamp file records the last one; `make install` forces it).
STAMP := $(VENV)/.qtensor-installed

$(STAMP): $(BIN)/python pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/*.h)
	$(BIN)/python -m pip install -q --upgrade setuptools wheel
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

install: $(BIN)/python
	rm -f $(STAMP)
	$(MAKE) $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m qtensor demo

# CUDA tests are deselected here and run on the GPU machine by benchmarks/gpu_check.sh.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not cuda"

# The two commands a new user runs: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: venv train test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so the project's `torch>=2.10` range never pulls a CUDA build.
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

venv: $(VENV)/.installed

train: venv
	$(VENV)/bin/forja train

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache

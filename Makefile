# The two commands a new user runs: `make train` and `make test`.
# `make gpu-check` is for a GPU machine (tests/gpu and bench/gpu.py, one table, under 9 minutes; see
# bench/gpu_check.py). It fails (exit 1) when a GPU test fails or is skipped, and exits 3 where no GPU is.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: venv train test cards gpu-check clean

# Two stamps: `make train` installs only what training needs (torch and the core dependencies,
# about 1 GB); `make test` adds the test extra (transformers, lm-eval, trackers: about 3 GB) on top.
# constraints.txt fixes the version of every package either installs (it adds none).
$(VENV)/.installed-train: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so the project's `torch>=2.10` range never pulls a CUDA build.
	$(PY) -m pip install --quiet --no-compile $(TORCH)
	$(EDITABLE) $(PY) -m pip install --quiet --no-compile -c constraints.txt -e .
	$(COMPILE)
	touch $@

# What is installed is byte-compiled once (25,000 files), on every core: pip compiles one file
# at a time (about 75 s here, 40 s on 2 cores). It is not skipped: where PYTHONDONTWRITEBYTECODE
# is set (as here) every process would compile every module it imports afresh, which made the
# suite 3 minutes slower. Files that are not Python 3.11 (a package's test data) fail to compile
# and stay as they are, as pip leaves them (-qq: not listed); compileall skips what is compiled.
SITE    = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
COMPILE = $(PY) -m compileall -qq -j 0 "$(SITE)" || true

# setuptools prints a boxed note on every editable install ("be careful with folders ... with the
# same name as your package"): no news to a clone's own install, and the only box it printed.
EDITABLE = PYTHONWARNINGS=ignore::UserWarning

$(VENV)/.installed-test: $(VENV)/.installed-train
	$(EDITABLE) $(PY) -m pip install --quiet --no-compile -c constraints.txt -e ".[test]"
	$(COMPILE)
	touch $@

venv: $(VENV)/.installed-train

train: $(VENV)/.installed-train
	$(VENV)/bin/forja train

# The linter first (ruff, [tool.ruff] in pyproject.toml: seconds), then three passes. The
# single-process tests leave a core idle much of the time (Python-bound steps, a subprocess
# importing torch), so they run TEST_WORKERS at a time, a test file per worker (its shared runs
# stay in one process). The serial tests (process groups of 2-4 ranks, one thread a rank, idle
# while ranks start and meet) then run two files at a time. Last, alone, the drills timed by
# sleeps, deadlines and signals (marked `alone`). One file at a time these two passes took
# 10 min 15 s here; split so, 6 min 53 s and 3 min 32 s in a clean clone's .ci/run (2026-12-07, evening).
# 3 on 2 cores: with 2 the pass kept 1.78 cores busy (subprocesses starting, a worker waiting on one).
TEST_WORKERS ?= 3
# Three workers' OpenMP teams (torch's intra-op threads, one per core each) share 2 cores. By
# default an idle OpenMP thread spins for a while before it sleeps, each process judging the
# cores its own: here the spinning took most of the CPU. PASSIVE lets idle threads sleep at once
# (the same threads and the same results): 4 model test files went from 151 s to 53 s at 3 workers.
TEST_ENV := OMP_WAIT_POLICY=PASSIVE

# Each pass also records the verification cards' evidence (tests/cards.py); the last line
# fails when a family's card has a cell no test filled (scripts/model_cards.py).
CARDS := .cards.jsonl

# The project's own modules are byte-compiled before the passes too (under a second): with
# PYTHONDONTWRITEBYTECODE set, every process the suite starts (a `forja` run, a rank) would
# otherwise compile every forja module it imports, about 0.3 s each time.
test: $(VENV)/.installed-test
	$(PY) -m ruff check .
	$(PY) -m compileall -qq -j 0 forja tests bench scripts
	rm -f $(CARDS)
	$(TEST_ENV) $(PY) -m pytest -q -m "not serial" -n $(TEST_WORKERS) --dist loadfile --cards=$(CARDS)
	$(TEST_ENV) $(PY) -m pytest -q -m "serial and not alone" -n 2 --dist loadfile --cards=$(CARDS)
	$(TEST_ENV) $(PY) -m pytest -q -m alone --cards=$(CARDS)
	$(PY) scripts/model_cards.py --results $(CARDS) --check

# The cards' table in docs/models.md, remade from the card tests alone (-m cards).
cards: $(VENV)/.installed-test
	$(PY) scripts/model_cards.py --run

# No venv target here: a GPU machine may reach no package registry, so this runs with the
# venv's python where there is one, else with the machine's own python3 (which holds torch).
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)

gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache

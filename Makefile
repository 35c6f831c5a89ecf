# `make demo` runs the main job (FSDP training on 8 simulated devices); `make test` runs lint and
# the whole test suite; `make specs` prints every strategy's specs; `make bench` runs the benchmark.
# Each sets up .venv on first use, so a fresh machine needs only python3, git and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo specs bench test lint docs docs-serve format clean

# The packages go in with uv (installed by pip from the index first): on a cold cache it set up
# .venv in 30 s where pip took 58 s, most of it unpacking wheels one at a time. Compiled to
# bytecode as pip does: without it, where PYTHONDONTWRITEBYTECODE is set, every process of the
# suite compiled jax and flax again on import (4.4 s against 1.8). uv reads its own
# configuration (UV_INDEX_URL, ...), not pip's, so where it cannot install them pip does.
UV := uv==0.13.9
INSTALL := -r requirements-dev.txt -e . -e integrations/flax

$(STAMP): pyproject.toml integrations/flax/pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(UV)" && $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode \
		$(INSTALL) || $(PY) -m pip install --quiet $(INSTALL)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/fsdp_training.py

specs: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/layouts.py --output-dir benchmarks/results
	$(PY) benchmarks/step.py --output-dir benchmarks/results
	$(PY) benchmarks/step.py --sections flax --allocator kept --output-dir benchmarks/results
	$(PY) benchmarks/remat.py --output-dir benchmarks/results
	$(PY) benchmarks/context.py --output-dir benchmarks/results --plot docs/images/context_memory.png
	$(PY) benchmarks/experts.py --output-dir benchmarks/results --plot docs/images/experts_routing.png

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# Two workers: a single pytest process keeps one of two cores busy, since most of a test is XLA
# compiling. worksteal balances the end of the run (a file's module fixtures may then run twice).
test: lint
	$(PY) -m pytest -n 2 --dist worksteal
	$(MAKE) docs

# Builds the site into site/, executing every tutorial notebook; fails on any warning or error.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site

# `make demo` and `make test` set everything up in ./.venv first (torch 2.13.0 CPU wheel first,
# so no CUDA build is pulled), then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean kvpress-env

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

demo: setup
	$(BIN)/python examples/demo.py

# Two workers, whole test files each (module fixtures, e.g. a loaded model, are built once); the
# slowest tests are listed at the end, to keep the suite near its ~15-minute budget.
test: setup
	$(BIN)/pytest -n 2 --dist loadfile --durations=25

# The core benchmarks, each writing its JSON (and PNG) to bench/results/. Long: see README. The
# others (real-model quality, serving, kernels, ...) each run by the command README quotes with its figures.
bench: setup
	for b in compile_overhead memory decode_speed generate_speed export quality; do \
		[ -f bench/$$b.py ] && $(BIN)/python bench/$$b.py || exit 1; \
	done

# kvpress (bench/kvpress_runner.py) needs transformers<5.3, the project pins a newer 5.x: its own
# venv, torch 2.13.0 CPU first, the project itself without its dependencies (for its task module).
KVPRESS_VENV := .venv-kvpress
kvpress-env: $(KVPRESS_VENV)/.installed

$(KVPRESS_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q --upgrade pip
	$(KVPRESS_VENV)/bin/pip install -q torch==2.13.0
	$(KVPRESS_VENV)/bin/pip install -q kvpress==0.5.5 'transformers>=4.56,<5.3' 'gguf>=0.10,<1' 'accelerate>=1.1,<2'
	$(KVPRESS_VENV)/bin/pip install -q --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# `make demo` and `make test` set everything up in ./.venv first (torch 2.13.0 CPU wheel first,
# so no CUDA build is pulled), then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/pytest

# Every benchmark in bench/, each writing its JSON (and PNG) to bench/results/. Long: see README.
bench: setup
	for b in compile_overhead memory decode_speed generate_speed export quality; do \
		[ -f bench/$$b.py ] && $(BIN)/python bench/$$b.py || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

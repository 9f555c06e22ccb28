# Two commands from a fresh clone: `make demo` runs the main job, `make test` the tests.
# Both create .venv on first use; torch==2.13.0 resolves to the CPU build on CPU machines.
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: demo test bench setup

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/zeropp demo

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(VENV)/bin/zeropp bench comm
	$(VENV)/bin/zeropp bench quant
	$(VENV)/bin/zeropp bench grad-error
	$(PYTHON) benchmarks/bench_fsdp2.py

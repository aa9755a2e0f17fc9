# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/goodput demo

test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=15

bench: $(STAMP)
	$(BIN)/python -m experiments.bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis

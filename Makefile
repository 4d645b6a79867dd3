# One-command entry points. `make demo` and `make test` each set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specserve-installed

.PHONY: setup models demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned so pip takes the local CPU wheel, not a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

models: $(STAMP)
	$(BIN)/specserve download

demo: models
	$(BIN)/specserve demo

test: models
	$(BIN)/python -m pytest

bench: models
	$(BIN)/specserve bench --suite seed-table

clean:
	rm -rf $(VENV) build *.egg-info

# One-command entry points. `make demo` and `make test` each set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specserve-installed

.PHONY: setup models browser demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned so pip takes the local CPU wheel, not a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

models: $(STAMP)
	$(BIN)/specserve download

# the page test drives a real headless Chromium (selenium comes with the test extra)
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    apt-get install -y -qq --no-install-recommends chromium chromium-driver; } || \
	  { echo "make: the page test needs Chromium and ChromeDriver (Debian: apt-get install chromium chromium-driver)"; exit 1; }

demo: models
	$(BIN)/specserve demo

test: models browser
	$(BIN)/python -m pytest

bench: models
	$(BIN)/specserve bench --suite seed-table

clean:
	rm -rf $(VENV) build *.egg-info

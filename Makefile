# One-command entry points. `make demo` and `make test` each set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specserve-installed
# torch comes first, as a CPU build from PyTorch's CPU index: PyPI's Linux wheel is a multi-GB
# CUDA build. Where that index cannot be reached within a few seconds (an offline mirror, a
# closed network), the same version comes from pip's configured index instead, with a note.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup models browser demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=5)" \
	    2>/dev/null; then \
	  echo "$(BIN)/pip install --index-url $(TORCH_INDEX) '$(TORCH)'"; \
	  $(BIN)/pip install --quiet --timeout 30 --retries 2 --index-url $(TORCH_INDEX) '$(TORCH)'; \
	else \
	  echo "make: $(TORCH_INDEX) cannot be reached: '$(TORCH)' from pip's configured index" \
	    "(on PyPI for Linux that is the large CUDA build)"; \
	  $(BIN)/pip install --quiet '$(TORCH)'; \
	fi
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

lint: $(STAMP)
	$(BIN)/ruff check

test: models browser lint
	$(BIN)/python -m pytest

bench: models
	$(BIN)/specserve bench --suite seed-table

clean:
	rm -rf $(VENV) build *.egg-info

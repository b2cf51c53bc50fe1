# Two-command set-up: `make run` then `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu clean

$(STAMP): pyproject.toml requirements-dev.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; set PYTHON=python3.x (3.10+)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/dsacache plan

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu"

# On a CUDA machine with torch and triton already installed (no venv needed there).
test-gpu:
	PYTHONPATH=src python3 -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build src/*.egg-info

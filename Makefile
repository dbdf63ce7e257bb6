# Two commands for a fresh machine: `make smoke` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: smoke test lint typecheck venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so pip takes the local CPU wheel instead of downloading a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

smoke: $(STAMP)
	$(BIN)/tessera smoke

lint: $(STAMP)
	$(BIN)/ruff check framework data_pipeline models launch tests bench

typecheck: $(STAMP)
	$(BIN)/mypy framework data_pipeline

test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest tests --durations=25

clean:
	rm -rf $(VENV) .cache runs

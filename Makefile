# Two entry points for users: `make demo` and `make test`. Both create (or reuse) .venv and
# install torch==2.13.0 first, so pip never pulls a multi-GB CUDA build of torch.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install plugins bench clean

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

plugins:
	cmake -S plugins -B build/plugins -DCMAKE_BUILD_TYPE=Release
	cmake --build build/plugins -j

bench: install
	$(BIN)/python tools/bench_ort.py

clean:
	rm -rf build demo_out

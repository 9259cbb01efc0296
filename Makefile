# Entry points (see README). The heavy lifting is CMake's; these targets set up what is missing,
# configure once, build, then run.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
# The interpreter whose extension module `make test` builds and tests (scripts/setup.sh installs
# its pinned build and test packages into .deps/).
PYTHON ?= python3
export PATH := $(PATH):/usr/local/cuda/bin
export PYTHON

PY_EXE = $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
PY_VER = $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PY_CMAKE_ARGS = -DTESSERA_BUILD_PYTHON=ON -DPython_EXECUTABLE=$(PY_EXE) \
  -DTESSERA_PYTEST_PATH=$(CURDIR)/.deps/pytest-$(PY_VER)

.PHONY: setup build run test bench clean

setup:
	./scripts/setup.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(PY_CMAKE_ARGS) $(CMAKE_ARGS)

# A build folder configured before the Python package existed gets it switched on once.
build: setup $(BUILD)/CMakeCache.txt
	@grep -q '^TESSERA_BUILD_PYTHON:BOOL=ON' $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(PY_CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

# The main job: tessera on the GPU it finds (or the CPU reference path without one).
run: build
	./$(BUILD)/tools/tessera run

# Every C++ suite and the Python (pytest) suite; GPU tests skip with a reason without a GPU.
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD)

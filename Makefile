# Entry points (see README). The heavy lifting is CMake's; these targets set up what is missing,
# configure once, build, then run.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: setup build run test bench clean

setup:
	./scripts/setup.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)

build: setup $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# The main job: tessera on the GPU it finds (or the CPU reference path without one).
run: build
	./$(BUILD)/tools/tessera run

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD)

# pdserve — the two commands a new user needs:
#   make demo   install dependencies, build, run the main job on the bundled model
#   make test   install dependencies, build, run every test
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build test demo bench format clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	@if [ ! -f $(BUILD)/build.ninja ]; then cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS); fi

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# The demo needs only the pdserve binary, not the tests and benchmarks.
demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target pdserve
	./scripts/demo.sh $(BUILD)

bench: build
	./scripts/bench.sh $(BUILD)

format:
	git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD)

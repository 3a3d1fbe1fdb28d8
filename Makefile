# ferry — the two commands a new machine needs: `make demo` and `make test`.
# Every target first installs missing Debian packages (scripts/deps.sh), then builds into build*/.
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all build demo test bench fuzz install clean format deps

all: build

deps:
	@scripts/deps.sh build

build: deps
	@cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null
	@cmake --build build -j $(JOBS)

# The main job, end to end (see README).
demo: build
	@scripts/demo.sh

# Every test: the suite, then again under ASan+UBSan, the threaded tests under TSan, a short
# fuzz run. Fails if anything fails.
test:
	@scripts/deps.sh test
	@scripts/test.sh

bench: build
	@scripts/deps.sh bench
	@build/ferry bench all

fuzz:
	@scripts/deps.sh test
	@scripts/fuzz.sh $${FUZZ_SECONDS:-60}

install: build
	@cmake --install build

format:
	@clang-format -i $$(git ls-files '*.c' '*.h')

clean:
	@rm -rf build build-*

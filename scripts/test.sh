#!/usr/bin/env bash
# `make test`: the cmocka/ctest suite three times — plain, ASan+UBSan, and the threaded tests
# under TSan — with the Python binding (installed into a venv with pip) and its pytest suite and
# examples after the plain one, then a short libFuzzer
# run of every fuzz target. Exits non-zero if anything fails.
#
# Skips: `make test` installs everything its tests use (scripts/deps.sh test), so a test that
# skips for a missing package or tool fails here instead (FERRY_TEST_STRICT=1, read by
# tests/testutil.c's tu_skip, tests/spin/run.sh and below for pytest and ctest). Only a reason
# that no install fixes may skip: pytest reasons matching $skip_ok, ctest tests matching
# $ctest_skip_ok.
set -uo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
failed=()
rm -f build*.ctest.log
export FERRY_TEST_STRICT=1
skip_ok=${FERRY_TEST_SKIP_OK:-'no GPU|no CUDA driver'}
ctest_skip_ok=${FERRY_CTEST_SKIP_OK:-'_gpu'}

# Configures and builds DIR with cmake FLAGS (both logged in DIR.log), then leaves the exit
# status in DIR/built.rc, which run_stage waits for.
build() { # build dir, cmake flags
  mkdir -p "$1"
  # shellcheck disable=SC2086
  { cmake -S . -B "$1" $2 && cmake --build "$1" -j "$jobs"; } >"$1.log" 2>&1
  echo $? >"$1/built.rc"
}

# The plain build first; the other stages' builds then run in the background, one after another,
# while the plain stage's tests and the python stage run (about half of the 2 cores idle on the
# clean VM, 2026-12-04): at the lowest CPU priority (SCHED_IDLE, else nice 19) they take only the
# cycles the tests leave idle, and a test's thread that wakes takes its CPU back at once. The fuzz
# targets' build and run go later, beside the sanitizer stages (about two thirds of the 2 cores
# idle under ASan, session 18). The wake-up counting cases (ctest label serial) of every build
# run at the end, once nothing runs beside them.
at_idle_priority() { # lowers the calling subshell's priority, which its children inherit
  chrt --idle -p 0 "$BASHPID" >/dev/null 2>&1 || renice -n 19 -p "$BASHPID" >/dev/null
}
background_builds() { # run with &
  at_idle_priority
  build build-noucx "-DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_WITH_UCX=OFF"
  build build-asan "-DCMAKE_BUILD_TYPE=Debug -DFERRY_SANITIZE=address,undefined"
  build build-tsan "-DCMAKE_BUILD_TYPE=Debug -DFERRY_SANITIZE=thread"
}
background_fuzz() { # run with &: the fuzz targets' build, then their short run, at the lowest
  # priority (its output in build-fuzz.run.log, its status in build-fuzz/run.rc)
  at_idle_priority
  [ -x scripts/fuzz.sh ] || return 0
  mkdir -p build-fuzz
  rm -f build-fuzz/run.rc
  scripts/fuzz.sh "${FERRY_FUZZ_SECONDS:-10}" >build-fuzz.run.log 2>&1 # or says why it cannot
  echo $? >build-fuzz/run.rc
}
wait_build() { # build dir: 0 once built, else its log's tail
  while [ ! -f "$1/built.rc" ]; do sleep 1; done
  [ "$(cat "$1/built.rc")" = 0 ] && return 0
  tail -40 "$1.log" 2>/dev/null
  return 1
}

run_stage() { # name, build dir, ctest log, ctest args[, a command that runs ctest]
  local name=$1 dir=$2 log=$3 args=$4 wrap=${5:-}
  echo "=== $name ==="
  if ! wait_build "$dir"; then
    failed+=("$name (build)")
    return
  fi
  # -j twice the cores: a busy test takes two slots, a case that mostly waits one (PROCESSORS,
  # tests/CMakeLists.txt), so that nproc busy tests run at a time with the waiting ones beside them
  # shellcheck disable=SC2086
  (cd "$dir" && $wrap ctest --output-on-failure -j $((2 * jobs)) $args) | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$name")
  check_ctest_skips "$name" "$log"
}

# Stages whose tests may run beside each other's (each "name|build dir|ctest log|ctest
# args|wrap", as run_stage's arguments), each build's tests one at a time: their output is shown
# stage by stage once all are done.
run_stages_side_by_side() {
  local spec name dir log args wrap pids=() specs=()
  for spec in "$@"; do
    IFS='|' read -r name dir log args wrap <<<"$spec"
    if ! wait_build "$dir"; then
      echo "=== $name ==="
      failed+=("$name (build)")
      continue
    fi
    # shellcheck disable=SC2086
    (cd "$dir" && $wrap ctest --output-on-failure $args) >"$log" 2>&1 &
    pids+=($!) specs+=("$spec")
  done
  for i in "${!pids[@]}"; do
    IFS='|' read -r name dir log args wrap <<<"${specs[$i]}"
    wait "${pids[$i]}"
    local rc=$?
    echo "=== $name ==="
    cat "$log"
    [ "$rc" -eq 0 ] || failed+=("$name")
    check_ctest_skips "$name" "$log"
  done
}

# ctest lists skipped tests as "NAME (Skipped)" (exit 77, SKIP_RETURN_CODE).
check_ctest_skips() { # stage name, ctest log
  local skipped
  skipped=$(sed -n 's/^[[:space:]]*[0-9]* - \([^ ]*\) (Skipped)$/\1/p' "$2" | grep -Ev "$ctest_skip_ok")
  if [ -n "$skipped" ]; then
    echo "$1: FAILED: skipped, though make test installs what they need: $skipped"
    failed+=("$1 (skipped: $skipped)")
  fi
}

# Adds up ctest's "N% tests passed, F tests failed out of T" lines of every stage.
tally() {
  cat build*.ctest.log 2>/dev/null |
    awk '/tests failed out of/ { f += $4; t += $NF } END { printf "%d passed, %d failed\n", t - f, f }'
}

# TSan's runtime cannot map its shadow under high-entropy ASLR on newer kernels; setarch -R
# turns randomization off for that run only.
tsan_wrap=""
if setarch -R true 2>/dev/null; then tsan_wrap="setarch -R"; fi

# intercept_tls_get_addr=0: LeakSanitizer's exit-time scan otherwise reads a stale dynamic-TLS
# range (gcc 12's libsanitizer) and crashes ("Tracer caught signal 11") in processes that loaded
# libraries with TLS at run time (the CUDA stand-in): cuda_refit_test's cases, one per process.
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:intercept_tls_get_addr=0
export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1

rm -f build*/built.rc
build build "-DCMAKE_BUILD_TYPE=RelWithDebInfo"
background_builds &
# The cases labelled serial (they count wake-ups, tests/CMakeLists.txt) wait until the
# background builds are done, below.
run_stage "suite" build build.ctest.log "-LE serial"
# The Python binding as users install it: a venv over Debian's python3 (--system-site-packages:
# numpy, torch and pytest come from Debian), `pip install` of python/ into it (its own build
# backend, no index), bundling build/'s libferry.so (ferry-lib=: the ctest pip_install checks the
# install's own build), then pytest and the examples with the venv's python, from outside the
# checkout's python/ so that the installed package is the one imported.
echo "=== python ==="
venv=$PWD/build/venv
py_ok=1
rm -rf "$venv"
if ! /usr/bin/python3 -m venv --system-site-packages "$venv" >build-python-venv.log 2>&1 ||
   ! "$venv/bin/python" -m pip install --no-deps --no-index --disable-pip-version-check \
       --config-settings=ferry-lib="$PWD/build/libferry.so" ./python >>build-python-venv.log 2>&1; then
  tail -20 build-python-venv.log
  echo "python: FAILED: the venv or pip install (scripts/deps.sh test installs python3-venv, python3-pip)"
  failed+=("python (venv/pip install)"); py_ok=0
elif ! "$venv/bin/python" -c "import pytest, xdist" 2>/dev/null; then
  echo "python: FAILED: python3 cannot import pytest and xdist (scripts/deps.sh test installs" \
    "python3-pytest, python3-pytest-xdist)"
  failed+=("python (no pytest)"); py_ok=0
fi
if [ "$py_ok" -eq 1 ]; then
  # -n: nproc pytest processes (pytest-xdist), each given whole files (--dist loadfile)
  (cd build && FERRY_LIB=$PWD/libferry.so FERRY_TEST_INSTALLED=1 "$venv/bin/python" -m pytest -q -rs \
    -n "$jobs" --dist loadfile -p no:cacheprovider --rootdir=.. --import-mode=importlib \
    ../python/tests) 2>&1 | tee build-python.log
  rc=${PIPESTATUS[0]} # 5 (no tests collected) fails like any other non-zero code
  [ "$rc" -eq 0 ] || failed+=("python (pytest exit $rc)")
  # -rs lists each skip as "SKIPPED [N] FILE:LINE: REASON"
  bad_skips=$(grep '^SKIPPED' build-python.log | grep -Ev "$skip_ok")
  if [ -n "$bad_skips" ]; then
    echo "python: FAILED: skipped, though make test installs what they need:"
    echo "$bad_skips"
    failed+=("python (skips)")
  fi
  # Count its tests in the tally, in ctest's words.
  tail -1 build-python.log | awk '{ for (i = 1; i < NF; i++) {
      if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^(failed|error)/) f += $i }
    printf "%d%% tests passed, %d tests failed out of %d\n", p + f ? 100 * p / (p + f) : 0, f, p + f }' >build-python.ctest.log
  # The examples, end to end with the venv's python (each starts its own other processes).
  examples=(examples/routing_replay.py examples/refit_torch.py examples/p2pstore_routing.py
    examples/refit_engine.py examples/refit_sharded.py)
  ex_pass=0 ex_fail=0
  for ex in "${examples[@]}"; do
    if FERRY_LIB=$PWD/build/libferry.so timeout -s KILL 180 "$venv/bin/python" "$ex"; then
      ex_pass=$((ex_pass + 1))
    else
      echo "python: FAILED: $ex"; ex_fail=$((ex_fail + 1)); failed+=("python ($ex)")
    fi
  done
  printf "%d%% tests passed, %d tests failed out of %d\n" $((100 * ex_pass / ${#examples[@]})) \
    "$ex_fail" "${#examples[@]}" >build-python-examples.ctest.log
fi
wait # the background builds
# Without UCX: the build, and the core and link tests (the ucx transport is optional); its one
# wake-up counting case runs alone (RUN_SERIAL), before the fuzz build starts.
run_stage "without ucx" build-noucx build-noucx.ctest.log \
  "-R ^(link_test|link_conformance_[a-z]+|core_test)/"
# The fuzz targets are built and then run for their FERRY_FUZZ_SECONDS each beside the sanitizer
# stages, at the lowest priority, in the cycles those stages leave idle (about two thirds of the
# 2 cores under ASan, session 18): each target fuzzes its whole time span with what the tests
# leave it (fewer runs a second than alone; `make fuzz` fuzzes long), and the run no longer
# adds its ~70 s at the end.
background_fuzz &
run_stage "asan+ubsan" build-asan build-asan.ctest.log "-LE serial"
run_stage "tsan (threaded tests)" build-tsan build-tsan.ctest.log "-L threaded -LE serial" "$tsan_wrap"
wait # the fuzz run: nothing runs beside the wake-up counting cases from here on
# The three builds' wake-up counting cases side by side: each build's ctest runs its cases one
# at a time (RUN_SERIAL), so at most three run at once, and they mostly sleep (an mq idle case
# counts over two 3 s windows). Side by side they counted what each counts alone (session 18,
# 6 runs: paced round trips 1-5 progress-thread wake-ups of the 20 allowed, mq idle 8-20 of 30,
# as alone), in 37 s instead of 101 s one build after another.
run_stages_side_by_side \
  "suite: the serial cases|build|build-serial.ctest.log|-L serial|" \
  "asan+ubsan: the serial cases|build-asan|build-asan-serial.ctest.log|-L serial|" \
  "tsan: the serial cases|build-tsan|build-tsan-serial.ctest.log|-L threaded -L serial|$tsan_wrap"
if [ -x scripts/fuzz.sh ]; then
  echo "=== fuzz (short, beside the sanitizer stages) ==="
  cat build-fuzz.run.log 2>/dev/null
  [ "$(cat build-fuzz/run.rc 2>/dev/null)" = 0 ] || failed+=("fuzz")
fi

# The last line counts the test runs of every stage.
if [ ${#failed[@]} -gt 0 ]; then
  echo "make test: FAILED: ${failed[*]}"
  echo "ferry: $(tally)"
  exit 1
fi
echo "make test: all stages passed"
echo "ferry: $(tally)"

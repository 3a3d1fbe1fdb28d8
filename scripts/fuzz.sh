#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan+UBSan) into build-fuzz/ and runs each one for
# SECONDS (default 60) from a seed corpus. `make fuzz` runs it long; `make test` runs it short.
# `fuzz.sh --build` only builds (scripts/test.sh builds them early, in the background).
# Each target is one single-threaded process: nproc of them run at a time, each for its whole
# SECONDS (the wall time of the run, not the fuzzing each target gets, is what this divides).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
jobs=$(nproc)
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DFERRY_FUZZ=ON -DFERRY_TESTS=OFF \
  >/dev/null
cmake --build build-fuzz -j "$jobs" >build-fuzz.log 2>&1 || { tail -30 build-fuzz.log; exit 1; }
[ "$seconds" = --build ] && exit 0

fuzz_one() { # binary: its log in build-fuzz/NAME.log, its exit status in build-fuzz/NAME.rc
  local bin=$1 name corpus rc=0
  name=$(basename "$bin")
  corpus=build-fuzz/corpus-$name
  mkdir -p "$corpus"
  cp -n fuzz/seeds/"$name"/* "$corpus"/ 2>/dev/null || true
  "$bin" -max_total_time="$seconds" -max_len=4096 -print_final_stats=0 "$corpus" \
    >"build-fuzz/$name.log" 2>&1 || rc=$?
  echo "$rc" >"build-fuzz/$name.rc"
}

bins=(build-fuzz/fuzz/*_fuzz)
echo "fuzz: ${#bins[@]} targets for ${seconds}s each, $jobs at a time"
for bin in "${bins[@]}"; do
  rm -f "build-fuzz/$(basename "$bin").rc"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  fuzz_one "$bin" &
done
wait
status=0
for bin in "${bins[@]}"; do
  name=$(basename "$bin")
  echo "fuzz: $name"
  if [ "$(cat "build-fuzz/$name.rc" 2>/dev/null)" != 0 ]; then
    tail -40 "build-fuzz/$name.log"
    status=1
  else
    grep -E '^#[0-9]+.*DONE' "build-fuzz/$name.log" | tail -1 || true
  fi
done
exit $status

#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan+UBSan) into build-fuzz/ and runs each one for
# SECONDS (default 60) from a seed corpus. `make fuzz` runs it long; `make test` runs it short.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DFERRY_FUZZ=ON -DFERRY_TESTS=OFF \
  >/dev/null
cmake --build build-fuzz -j "$(nproc)" >build-fuzz.log 2>&1 || { tail -30 build-fuzz.log; exit 1; }
status=0
for bin in build-fuzz/fuzz/*_fuzz; do
  name=$(basename "$bin")
  corpus=build-fuzz/corpus-$name
  mkdir -p "$corpus"
  cp -n fuzz/seeds/"$name"/* "$corpus"/ 2>/dev/null || true
  echo "fuzz: $name for ${seconds}s"
  if ! "$bin" -max_total_time="$seconds" -max_len=4096 -print_final_stats=0 "$corpus" \
      >"build-fuzz/$name.log" 2>&1; then
    tail -40 "build-fuzz/$name.log"
    status=1
  else
    grep -E '^#[0-9]+.*DONE' "build-fuzz/$name.log" | tail -1 || true
  fi
done
exit $status

#!/usr/bin/env bash
# `make demo`: the main job end to end. Until the store and refit land it runs the link
# benchmark: ferry's one-sided reads over shm and tcp against memcpy and plain sockets.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "ferry demo: one-sided reads between two processes, ferry vs the physical limits"
build/ferry bench link --max-size "${FERRY_DEMO_MAX_SIZE:-256M}"

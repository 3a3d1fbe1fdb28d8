#!/usr/bin/env bash
# `make demo`: the main job end to end — a trainer and two rollouts on this machine, three RL
# steps of control (clear/update), refit (weights v1..v3) and store (routing replay).
set -euo pipefail
cd "$(dirname "$0")/.."
exec build/ferry demo

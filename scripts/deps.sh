#!/usr/bin/env bash
# Installs the Debian packages ferry needs that are missing, and nothing else.
# Usage: scripts/deps.sh [build|test|bench|all]   (default: build)
# Quiet when everything is already there. Uses apt-get only; needs root (or sudo).
set -euo pipefail

# libssl-dev: TLS for rediss:// directories (hiredis 0.14 has none of its own)
build_pkgs=(cmake make gcc pkg-config libcmocka-dev libxxhash-dev libhiredis-dev
            libmicrohttpd-dev libucx-dev libjansson-dev libssl-dev)
# python3-prometheus-client: its text-format parser checks what /metrics serves (test_metrics.py)
# chromium: tests/status_page renders ferry serve's status page headless and checks its DOM
# python3-venv (the venv's pip, ensurepip), python3-pip: make test installs the Python package into
# venvs with `pip install ./python` (tests/pip_install): its own build backend runs CMake with the
# build packages above, nothing from an index (no setuptools, no wheel)
# etcd-server, etcd-client: tests/etcd/cluster.sh starts a three-member etcd on loopback for the
# etcd:// directory's tests (issue 36)
# libunistring-dev: tests/pkgconfig links a program statically through ferry.pc, and
# libmicrohttpd's own .pc then names gnutls' -lunistring (the only one of them without its -dev)
# openssl: tests/redis/certs.sh makes the test CA and certificates for the rediss:// tests (issue 36)
test_pkgs=(clang libclang-rt-14-dev spin redis-server iproute2 python3 python3-numpy python3-pytest
           python3-torch python3-venv python3-pip python3-prometheus-client chromium
           libunistring-dev etcd-server etcd-client openssl)
# python3-yaml: tests/k8s/check.py parses the Kubernetes examples in docs/k8s (issue 36)
test_pkgs+=(python3-yaml)
# python3-pytest-xdist: make test runs the Python tests in nproc processes (scripts/test.sh)
test_pkgs+=(python3-pytest-xdist)
# etcd-server: ferry bench directory starts one etcd member for its etcd:// rows (issue 36)
bench_pkgs=(python3-numpy python3-torch libnng-dev libzmq3-dev redis-server ucx-utils etcd-server)

want=("${build_pkgs[@]}")
case "${1:-build}" in
  build) ;;
  test) want+=("${test_pkgs[@]}") ;;
  bench) want+=("${test_pkgs[@]}" "${bench_pkgs[@]}") ;;
  all) want+=("${test_pkgs[@]}" "${bench_pkgs[@]}") ;;
  *) echo "usage: $0 [build|test|bench|all]" >&2; exit 2 ;;
esac

missing=()
for p in "${want[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
echo "deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

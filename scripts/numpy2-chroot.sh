#!/usr/bin/env bash
# The Python suite and examples under NumPy 2, without PyPI: Debian 12 has NumPy 1.24, Debian 13
# (trixie) NumPy 2.2 with Python 3.13. Builds a trixie chroot once (debootstrap, from the Debian
# mirror in this machine's apt sources; needs root and that mirror), puts this checkout's
# build/libferry.so, build/ferry, python/ and examples/ in it (built on Debian 12: glibc is
# backward compatible; the one library whose soname trixie lacks, libhiredis.so.0.14, is copied
# from this machine), and runs pytest and the three examples there.
# Usage: scripts/numpy2-chroot.sh [--torch]   (--torch: also python3-torch, ~120 MB download;
# without it the torch-only tests skip). The chroot stays in $FERRY_NUMPY2_ROOT
# (/tmp/ferry-numpy2) for the next run. Exit 0 when everything passed.
set -u
cd "$(dirname "$0")/.."
root=${FERRY_NUMPY2_ROOT:-/tmp/ferry-numpy2}
torch=0
[ "${1:-}" = "--torch" ] && torch=1
[ -e build/libferry.so ] && [ -x build/ferry ] || { echo "build first (make build)"; exit 2; }
mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
[ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null)
[ -n "$mirror" ] || { echo "no Debian mirror in this machine's apt sources"; exit 2; }
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  DEBIAN_FRONTEND=noninteractive TERM=dumb bash -c "$1"; }
cleanup() { for m in dev/shm dev proc; do umount -l "$root/$m" 2>/dev/null; done; }
trap cleanup EXIT
if [ ! -x "$root/usr/bin/python3" ]; then
  command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)"; exit 2; }
  debootstrap --variant=minbase --include=python3,python3-numpy,python3-pytest trixie "$root" \
    "$mirror" >"$root.log" 2>&1 || { echo "debootstrap failed (see $root.log)"; exit 2; }
fi
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/dev" || mount --rbind /dev "$root/dev"
mountpoint -q "$root/dev/shm" || mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null
pkgs="libxxhash0 libmicrohttpd12t64 libucx0 libjansson4 libnng1 libzmq5 python3-prometheus-client"
[ "$torch" -eq 1 ] && pkgs="$pkgs python3-torch"
in_root "dpkg -s $pkgs >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq \
  --no-install-recommends $pkgs; } >/tmp/apt.log 2>&1" || { echo "apt-get in the chroot failed"; exit 2; }
cp -L "$(ldd build/libferry.so | awk '/libhiredis/ {print $3}')" "$root/usr/local/lib/" && in_root ldconfig
rm -rf "$root/srv/ferry" && mkdir -p "$root/srv/ferry/build"
cp -L build/libferry.so build/ferry "$root/srv/ferry/build/"
cp -r python examples "$root/srv/ferry/"
find "$root/srv/ferry" -name __pycache__ -prune -exec rm -rf {} +
in_root 'cd /srv/ferry/build && export FERRY_LIB=/srv/ferry/build/libferry.so &&
  python3 -c "import sys, numpy; print(\"numpy\", numpy.__version__, \"python\", sys.version.split()[0])" &&
  { python3 -c "import torch; print(\"torch\", torch.__version__)" 2>/dev/null || echo "no torch"; } &&
  python3 -m pytest -q -rs -p no:cacheprovider ../python/tests; rc=$?
  ex="examples/routing_replay.py examples/p2pstore_routing.py"
  python3 -c "import torch" 2>/dev/null && ex="$ex examples/refit_torch.py"
  cd /srv/ferry && for ex in $ex; do
    PYTHONPATH=/srv/ferry/python timeout -s KILL 180 python3 "$ex" >/tmp/ex.log 2>&1 &&
      echo "$ex: ok" || { echo "$ex: FAILED"; tail -5 /tmp/ex.log; rc=1; }
  done; exit $rc'

#!/usr/bin/env bash
# Downloads, here on Debian 12 (with network), the .debs that building and testing ferry needs
# on a device machine (docs/GPU.md, "The device check"): a bare CUDA image with a compiler,
# CMake and python3 but no package registry and none of our libraries. They land in .gpu-debs/
# at the repository root (ignored by git), which the device tool carries beside the working tree
# (carry: [".gpu-debs"]); scripts/gpu-check.sh unpacks them there. Nothing is installed here.
#
# What is carried: the -dev and runtime packages of the build's REQUIRED pkg-config modules
# (xxhash, libmicrohttpd, hiredis, jansson, and cmocka for the tests), pkgconf, and every package
# those depend on, recursively, except the toolchain and C library (the image has a compiler,
# so it has them, and a Debian libc must never shadow the image's) and the gnutls extras that
# libgnutls28-dev pulls in but nothing of ours links (DANE, the OpenSSL shim, the C++ API).
# libgnutls28-dev and its -dev dependencies are carried for pkg-config only: libmicrohttpd.pc
# says "Requires.private: gnutls", and pkg-config refuses the module without gnutls.pc and the
# .pc files gnutls.pc requires. UCX (-DFERRY_WITH_UCX=OFF there) and the benchmarks' nng and
# ZeroMQ (found QUIET in bench/CMakeLists.txt) are optional and left out.
#
# Usage: scripts/gpu-debs.sh     (needs apt-get; runs `apt-get update` only when apt has no
#                                 package lists yet; no root needed otherwise)
set -euo pipefail

cd "$(dirname "$0")/.."
dest=.gpu-debs
limit_mib=20 # the device tool carries 64 MiB in all; the tree and this must fit well under it

roots=(libxxhash-dev libmicrohttpd-dev libhiredis-dev libssl-dev libjansson-dev libcmocka-dev
       pkgconf pkgconf-bin libpkgconf3 pkg-config)
# Never carried (see above). An alternative dependency ("a | b") follows its first choice only.
skip='^(libc6|libc6-dev|libc-dev-bin|linux-libc-dev|libcrypt1|libcrypt-dev|libnsl-dev|libnsl2|'
skip+='libtirpc-dev|libtirpc3|libtirpc-common|rpcsvc-proto|libgcc-s1|libstdc\+\+6|gcc-12-base|'
skip+='libgnutls-dane0|libgnutls-openssl27|libgnutlsxx30|libgmpxx4ldbl)$'

if ! command -v apt-get >/dev/null || ! command -v apt-cache >/dev/null; then
  echo "gpu-debs: needs apt-get and apt-cache (run it on Debian 12)" >&2
  exit 2
fi
if ! apt-cache show --no-all-versions libxxhash-dev >/dev/null 2>&1; then
  echo "gpu-debs: apt has no package lists; running apt-get update" >&2
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
fi

# Direct dependencies of the packages named, one name a line: Depends and Pre-Depends, the first
# choice of each alternative, a virtual name (<...>) replaced by the first package providing it.
deps_of() {
  apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
    --no-enhances "$@" |
    awk '/^[^ ]/ { in_alt = 0; want_provider = 0; next } # the next package'"'"'s own name
         /^ +\|?(Pre)?Depends: / {
           if (!in_alt) { if ($2 ~ /^</) want_provider = 1; else print $2 }
           in_alt = ($1 ~ /^\|/); next }
         /^    [^ ]/ && want_provider { print $1; want_provider = 0 }'
}

# The closure, a level at a time (one apt-cache call each).
declare -A seen=()
level=("${roots[@]}")
pkgs=()
while [[ ${#level[@]} -gt 0 ]]; do
  new=()
  for p in "${level[@]}"; do
    [[ -n ${seen[$p]:-} ]] && continue
    seen[$p]=1
    [[ $p =~ $skip ]] || new+=("$p")
  done
  [[ ${#new[@]} -gt 0 ]] || break
  pkgs+=("${new[@]}")
  mapfile -t level < <(deps_of "${new[@]}" | sort -u)
done

# Download into a temp dir, then replace .gpu-debs whole: a failed run leaves the old one intact.
tmp=$(mktemp -d)
# As root, apt downloads as the user _apt, which must be able to write there.
[[ $(id -u) -ne 0 ]] || chown _apt "$tmp" 2>/dev/null || true
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download -qq "${pkgs[@]}" >/dev/null) ||
  { echo "gpu-debs: apt-get download failed for: ${pkgs[*]}" >&2; exit 1; }
dpkg --print-architecture >"$tmp/ARCH"
printf '%s\n' "${pkgs[@]}" | sort >"$tmp/PACKAGES"
# which gpu-debs.sh made it: scripts/gpu-check.sh refuses a .gpu-debs made by another (stale)
sha256sum scripts/gpu-debs.sh | cut -c1-16 >"$tmp/MADE_BY"
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp"/*.deb "$tmp/ARCH" "$tmp/PACKAGES" "$tmp/MADE_BY" "$dest/"

n=$(find "$dest" -name '*.deb' | wc -l)
bytes=$(du -cb "$dest"/*.deb | tail -n1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu-debs: $n packages, $mib MiB in $dest/ ($(cat "$dest/ARCH")): ${pkgs[*]}"
if ((mib > limit_mib)); then
  echo "gpu-debs: $mib MiB is over the $limit_mib MiB this may take of the 64 MiB carry" >&2
  exit 1
fi

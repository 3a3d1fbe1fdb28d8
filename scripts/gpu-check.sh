#!/usr/bin/env bash
# The device check (docs/GPU.md, "The device check"): one command, run on a lent GPU machine from
# the repository root, that builds ferry there and runs what only a real GPU can tell us. That
# machine is a bare CUDA image (compiler, CMake, python3 with torch) with no package registry and
# no network, so the Debian 12 libraries ferry builds against come with the tree: .gpu-debs/,
# made here by scripts/gpu-debs.sh and carried by the device tool (carry: [".gpu-debs"]).
#
# Steps, each under its own timeout, all within BUDGET seconds (default 450: the tool's limit is
# 600 per command and the whole session has 15 minutes of device time):
#   unpack     every .deb into a prefix under /tmp (dpkg-deb, else ar + tar, else python3)
#   env        nvidia-smi, nvcc, python3/torch/numpy, glibc, uname into $OUT/env.txt
#   configure  RelWithDebInfo, UCX off, into build-gpu/ (pkg-config and CMake see the prefix);
#              warnings not fatal (FERRY_WERROR=OFF): the image's compiler is not Debian's gcc 12,
#              and a new warning there must not cost the session its one device run. Counted.
#   build      everything, -j$(nproc)
#   smoke      build-gpu/ferry --version: the carried libraries load at run time too; then
#              `ferry info` (its cuda: line) into $OUT/ferry-info.txt
#   ctest      the tests labelled `cuda`, FERRY_TEST_CUDA=driver (the real libcuda, no stand-in)
#   bench      `ferry bench gpu --json` and `python3 -m ferry.bench gpu --json`; the refit rows'
#              breakdowns (issue 37: where a push's time went) one line each into
#              refit-breakdown.txt and the summary; the group rows (row d) are bench gpu's own
#   cpu rows   `ferry bench store --no-baselines --pace 0` (its consumer-start and first rows, into
#              bench-store-first.txt) and, where `ip netns` works, `ferry bench refit
#              --group-only` (bench-refit-group.txt); GPU_CHECK_CPU_ROWS=0 leaves them out
# Results land in $OUT (default ./gpu-check-out): env.txt, unpack.txt, configure.log, build.log,
# ferry-info.txt, ctest.log, bench-gpu.json (+ .err), bench-gpu-python.json (+ .err),
# refit-breakdown.txt and summary.txt, the summary, which is also printed last. Exit status: 0 when the build and every
# test passed (skipped tests included), 1 when configure, build, smoke or a test failed, 2 when
# .gpu-debs is missing, stale (made by another scripts/gpu-debs.sh) or for another machine.
#
# Usage: scripts/gpu-check.sh        (OUT, BUDGET and PYTHON from the environment, all optional)
#
# No `set -e`: a failed step is recorded and the script goes on to the summary; each step decides
# whether the steps after it can run.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
root=$PWD
OUT=${OUT:-$root/gpu-check-out}
if ! mkdir -p "$OUT" || ! OUT=$(cd "$OUT" && pwd); then
  echo "gpu-check: cannot write OUT=$OUT" >&2
  exit 2
fi
BUDGET=${BUDGET:-450}
py=${PYTHON:-python3} # the image's, with torch and numpy
debs=$root/.gpu-debs
prefix=/tmp/ferry-gpu-deps # the unpacked packages (usr/...), redone on every run
rt=$prefix/rt              # runtime libraries the machine lacks: LD_LIBRARY_PATH
build=$root/build-gpu

# ---- the summary -----------------------------------------------------------------------------

steps=()
record() { # step status why
  steps+=("$(printf '%-10s %-8s %s' "$1" "$2" "$3")")
  printf '== %-10s %-8s %s\n' "$1" "$2" "$3"
}

summary() {
  {
    echo "---- gpu-check summary ($(date -u '+%F %T UTC'), ${SECONDS}s of ${BUDGET}s) ----"
    printf '%s\n' "${steps[@]}"
    echo "results: $OUT"
  } | tee "$OUT/summary.txt"
}

# Seconds a step may take: its own cap, or what is left of the budget (less a margin for the
# summary), whichever is smaller; 0 when nothing useful is left.
limit() {
  local left=$((BUDGET - SECONDS - 10))
  ((left > $1)) && left=$1
  ((left < 5)) && left=0
  echo "$left"
}

# The last meaningful line of a log, for the summary.
last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n1 | cut -c1-100; }

# ---- preflight -------------------------------------------------------------------------------

if ! compgen -G "$debs/*.deb" >/dev/null; then
  echo "gpu-check: no .gpu-debs/ here: run scripts/gpu-debs.sh here first and carry .gpu-debs" \
       "(the device tool's carry: [\".gpu-debs\"])" >&2
  exit 2
fi
case $(uname -m) in
  x86_64) arch=amd64 triplet=x86_64-linux-gnu ;;
  aarch64) arch=arm64 triplet=aarch64-linux-gnu ;;
  *) arch=$(uname -m) triplet=unknown ;;
esac
if [[ $(cat "$debs/ARCH" 2>/dev/null) != "$arch" ]]; then
  echo "gpu-check: .gpu-debs holds $(cat "$debs/ARCH" 2>/dev/null || echo '?') packages; this" \
       "machine is $arch" >&2
  exit 2
fi
# .gpu-debs/MADE_BY: the hash of the scripts/gpu-debs.sh that made it. Another one may carry other
# packages (libssl-dev came with rediss://, after the .gpu-debs of the first device runs).
made_by=$(sha256sum "$root/scripts/gpu-debs.sh" | cut -c1-16)
if [[ $(cat "$debs/MADE_BY" 2>/dev/null) != "$made_by" ]]; then
  echo "gpu-check: .gpu-debs is stale (not made by this tree's scripts/gpu-debs.sh, which may" \
       "carry other packages): run scripts/gpu-debs.sh here again (seconds), then carry it" >&2
  exit 2
fi

# ---- unpack ----------------------------------------------------------------------------------

# A .deb is an ar archive whose data.tar.* holds the files. dpkg-deb reads it best; an image
# without dpkg gets ar + tar; one without binutils gets this reader (python3 is always there).
py_unpack() { # deb dest
  timeout 60 "$py" - "$1" "$2" <<'EOF'
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
with open(deb, "rb") as f:
    blob = f.read()
if blob[:8] != b"!<arch>\n":
    sys.exit("%s: not an ar archive" % deb)
pos = 8
while pos + 60 <= len(blob):
    name = blob[pos:pos + 16].decode().strip().rstrip("/")
    size = int(blob[pos + 48:pos + 58].decode())
    body = blob[pos + 60:pos + 60 + size]
    pos += 60 + size + (size & 1)  # members start on even offsets
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as t:
            # Debian's own packages, fetched by apt: trusted (their symlinks may be absolute)
            if hasattr(tarfile, "fully_trusted_filter"):
                t.extractall(dest, filter="fully_trusted")
            else:
                t.extractall(dest)
        sys.exit(0)
sys.exit("%s: no data.tar member" % deb)
EOF
}

ar_unpack() { # deb dest
  local tmp member rc
  tmp=$(mktemp -d) || return 1
  member=$(cd "$tmp" && timeout 30 ar t "$1" | grep '^data\.tar') &&
    (cd "$tmp" && timeout 30 ar x "$1" "$member") &&
    timeout 60 tar -xf "$tmp/$member" -C "$2"
  rc=$?
  rm -rf "$tmp"
  return $rc
}

unpack_all() {
  local deb how=""
  rm -rf "$prefix" && mkdir -p "$prefix" "$rt" || return 1
  for deb in "$debs"/*.deb; do
    if command -v dpkg-deb >/dev/null && timeout 60 dpkg-deb -x "$deb" "$prefix"; then
      how=dpkg-deb
    elif command -v ar >/dev/null && ar_unpack "$deb" "$prefix" 2>/dev/null; then
      how=ar+tar
    elif py_unpack "$deb" "$prefix"; then
      how=python3
    else
      echo "cannot unpack $deb" >&2
      return 1
    fi
  done
  echo "$how"
}

# A shared library the machine already has (same file name, so the same soname: the same ABI)
# is used from the machine, newer and consistent with the rest of it; only the missing ones are
# linked into $rt. A Debian libc or libffi ahead of the image's would break its own programs.
link_missing_libs() {
  local have d f n=0
  have=$( (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null) | awk 'NR > 1 { print $1 }')
  for d in "$prefix/usr/lib/$triplet" "$prefix/lib/$triplet" "$prefix/usr/lib"; do
    for f in "$d"/lib*.so.*; do
      [[ -e $f ]] || continue
      f=${f##*/}
      grep -qxF "$f" <<<"$have" && continue
      [[ -e /usr/lib/$triplet/$f || -e /lib/$triplet/$f || -e /usr/lib64/$f ]] && continue
      [[ -e $rt/$f ]] || { ln -s "$d/$f" "$rt/$f" && n=$((n + 1)); }
    done
  done
  echo "$n"
}

t0=$SECONDS
if how=$(unpack_all 2>"$OUT/unpack.err"); then
  nlibs=$(link_missing_libs)
  ls "$rt" >"$OUT/unpack.txt" # the carried libraries this machine runs with
  ndebs=$(find "$debs" -name '*.deb' | wc -l)
  record unpack ok "$ndebs debs via $how, $nlibs libraries the machine lacks, $((SECONDS - t0))s"
  unpacked=1
else
  record unpack failed "$(last_line "$OUT/unpack.err")"
  unpacked=0
fi

# Everything below sees the prefix. Debian's .pc files say prefix=/usr (cmocka's even spell out
# -I/usr/include): PKG_CONFIG_SYSROOT_DIR makes pkgconf put the prefix before every such path.
pclib=$prefix/usr/lib/$triplet/pkgconfig:$prefix/usr/lib/pkgconfig:$prefix/usr/share/pkgconfig
export PKG_CONFIG_LIBDIR=$pclib PKG_CONFIG_PATH=$pclib PKG_CONFIG_SYSROOT_DIR=$prefix
export CMAKE_PREFIX_PATH=$prefix/usr
libs=$prefix/usr/lib/$triplet:$prefix/lib/$triplet:$prefix/usr/lib
export LIBRARY_PATH=$libs${LIBRARY_PATH:+:$LIBRARY_PATH}
export CPATH=$prefix/usr/include:$prefix/usr/include/$triplet${CPATH:+:$CPATH}
export LD_LIBRARY_PATH=$rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
pkgconf=$prefix/usr/bin/pkgconf

# ---- env -------------------------------------------------------------------------------------

env_report() {
  local t
  t=$(limit 60)
  echo "# gpu-check $(date -u '+%F %T UTC'), commit" \
       "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '? (no .git)')"
  echo "## uname -a"; uname -a
  echo "## os"; grep -h '^PRETTY_NAME=' /etc/os-release 2>/dev/null
  echo "## glibc"; ldd --version 2>&1 | head -n1
  echo "## nproc"; nproc
  echo "## nvidia-smi"
  if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi 2>&1
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
  else
    echo "not present"
  fi
  echo "## libcuda"
  (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null) | grep 'libcuda\.so' ||
    echo "not in the loader cache"
  echo "## nvcc --version"
  if command -v nvcc >/dev/null; then timeout 30 nvcc --version 2>&1
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then timeout 30 /usr/local/cuda/bin/nvcc --version 2>&1
  else echo "not present"; fi
  echo "## cc / cmake"; cc --version 2>&1 | head -n1; cmake --version 2>&1 | head -n1
  echo "## python3"
  timeout "$t" "$py" - <<'EOF' 2>&1 || echo "python3: failed"
import sys
print("python", sys.version.split()[0], sys.executable)
for mod in ("numpy", "torch"):
    try:
        m = __import__(mod)
    except Exception as e:
        print(mod, "not importable:", e)
        continue
    print(mod, m.__version__)
    if mod == "torch":
        print("torch cuda", m.version.cuda, "available", m.cuda.is_available(),
              m.cuda.get_device_name(0) if m.cuda.is_available() else "")
EOF
}

t0=$SECONDS
env_report >"$OUT/env.txt" 2>&1
gpu=$(grep -m1 -A1 '^name, driver_version' "$OUT/env.txt" | tail -n1)
[[ $gpu == name,* || -z $gpu ]] && gpu="no nvidia-smi GPU"
record env ok "$gpu; $((SECONDS - t0))s"

# ---- configure and build ---------------------------------------------------------------------

built=0
if ((unpacked)); then
  gen=()
  command -v ninja >/dev/null && [[ ! -f $build/Makefile ]] && gen=(-G Ninja)
  t=$(limit 120) t0=$SECONDS
  if ((t == 0)); then
    record configure skipped "no time left"
  elif timeout "$t" cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
       -DFERRY_WITH_UCX=OFF -DFERRY_WERROR=OFF -DPKG_CONFIG_EXECUTABLE="$pkgconf" \
       >"$OUT/configure.log" 2>&1; then
    record configure ok "$((SECONDS - t0))s"
    t=$(limit 300) t0=$SECONDS
    if ((t == 0)); then
      record build skipped "no time left"
    elif timeout "$t" cmake --build "$build" -j"$(nproc)" >"$OUT/build.log" 2>&1; then
      warnings=$(grep -c 'warning: ' "$OUT/build.log")
      record build ok "$((SECONDS - t0))s, $warnings compiler warnings (build.log)"
      built=1
    else
      rc=$?
      why=$(grep -m1 -E '(error|Error)[: ]' "$OUT/build.log" | cut -c1-60)
      record build failed "rc $rc after $((SECONDS - t0))s (limit ${t}s): $why"
      grep -m10 -B2 -E '(error|Error)[: ]' "$OUT/build.log" # -j interleaves: the first errors
      tail -n 5 "$OUT/build.log"
    fi
  else
    rc=$?
    why=$(grep -m1 -E 'Error|not found' "$OUT/configure.log" | cut -c1-80)
    record configure failed "rc $rc (limit ${t}s): $why"
    tail -n 20 "$OUT/configure.log"
    record build skipped "configure failed"
  fi
else
  record configure skipped "unpack failed"
  record build skipped "unpack failed"
fi

# ---- smoke: the binaries load with the carried libraries -------------------------------------

smoke_ok=0
if ((built)); then
  if v=$(timeout 20 "$build/ferry" --version 2>&1); then
    # what ferry itself makes of the driver (its `cuda:` line), beside env.txt's view
    timeout 20 "$build/ferry" info >"$OUT/ferry-info.txt" 2>&1
    cuda=$(grep -m1 '^cuda:' "$OUT/ferry-info.txt" | tr -s ' ' | cut -c1-70)
    record smoke ok "$v${cuda:+; $cuda}"
    smoke_ok=1
  else
    record smoke failed "ferry --version: $(tail -n1 <<<"$v" | cut -c1-90)"
  fi
else
  record smoke skipped "no build"
fi

# ---- the CUDA tests, against the real driver -------------------------------------------------

tests_ok=1
if ((built)); then
  t=$(limit 240) t0=$SECONDS
  if ((t == 0)); then
    record ctest skipped "no time left"
  else
    # -V: every test's own output in the log, so the skips show: cmocka's skip() and
    # tests/testutil.c's tu_skip ("SKIP no CUDA driver: ...") both pass the test. Counted below,
    # so "all passed" on a machine without a driver is visibly not a CUDA result.
    (cd "$build" && FERRY_TEST_CUDA=driver timeout "$t" ctest -L cuda -V --output-on-failure) \
      >"$OUT/ctest.log" 2>&1
    rc=$?
    cm_skipped=$(awk 'match($0, /SKIPPED \] [0-9]+ test\(s\), listed below/) {
                        n += substr($0, RSTART + 10) + 0 } END { print n + 0 }' "$OUT/ctest.log")
    tu_skipped=$(grep -cE '^([0-9]+: )?SKIP ' "$OUT/ctest.log")
    skip_why=$(grep -m1 -oE 'SKIP no CUDA driver.*' "$OUT/ctest.log" | cut -c6-60)
    if grep -q 'No tests were found' "$OUT/ctest.log"; then
      record ctest skipped "no test is labelled cuda (// ferry-test: cuda) in this tree"
    elif ((rc == 0)); then
      why=$(grep -m1 'tests passed' "$OUT/ctest.log")
      why+="; $cm_skipped cases skipped, $tu_skipped SKIP lines${skip_why:+ ($skip_why)}"
      record ctest ok "$why"
    else
      tests_ok=0
      why=$(grep -m1 'tests passed' "$OUT/ctest.log")
      ((rc == 124)) && why="timed out after ${t}s"
      record ctest failed "${why:-rc $rc}: ctest.log"
      grep -A20 'The following tests FAILED' "$OUT/ctest.log"
    fi
  fi
else
  record ctest skipped "no build"
fi

# ---- the GPU benchmarks (modes others are writing: absent is not a failure) -------------------

# bench name json-file cap command...
bench() {
  local name=$1 json=$2 t rc out why
  t=$(limit "$3")
  shift 3
  if ((t == 0)); then
    record "$name" skipped "no time left"
    return
  fi
  timeout "$t" "$@" >"$json" 2>"$json.err"
  rc=$?
  out=$(cat "$json.err" "$json")
  if grep -qi 'no CUDA driver' <<<"$out"; then # whatever its status: nothing was measured
    record "$name" skipped "$(grep -oim1 'no CUDA driver.*' <<<"$out" | cut -c1-70)"
  elif ((rc == 0)); then
    record "$name" ok "$(wc -l <"$json") lines in ${json##*/}"
  elif grep -qiE "unknown mode|invalid choice: 'gpu'" <<<"$out"; then
    record "$name" skipped "no gpu mode in this tree yet"
  elif why=$(grep -m1 -o "No module named '[^']*'" <<<"$out"); then
    record "$name" skipped "python3: $why"
  else
    ((rc == 124)) && why="timed out after ${t}s" || why="rc $rc: $(last_line "$json.err")"
    record "$name" failed "$why"
  fi
}

# Issue 37: each refit row's breakdown line (bench-gpu.json: "breakdown", the phases per timed
# push of the sender and the receiver) as one line of milliseconds, beside its ratio to the d2d
# copy of its case, into refit-breakdown.txt and the summary.
breakdown() {
  local json=$OUT/bench-gpu.json line
  [[ -s $json ]] || return 0
  if ! timeout 30 "$py" - "$json" >"$OUT/refit-breakdown.txt" 2>"$OUT/refit-breakdown.err" <<'EOF'
import json, sys
rows = []
for line in open(sys.argv[1]):
    try:
        rows.append(json.loads(line))
    except ValueError:
        pass
base = {r["case"]: r["median_s"] for r in rows if r.get("impl") == "d2d-copy"}
for r in rows:
    if "breakdown" not in r:
        continue
    ms = lambda k: "%.2f" % (r.get(k, 0) * 1e3)
    b = base.get(r["case"])
    ratio = " = %.2fx d2d" % (r["push_median_s"] / b) if b else ""
    print("%s %s %s ms%s | tx pack %s (%d copies, sync %s) slot %s read %s notify %s commit %s"
          " | rx wait %s copy %s (%d copies, sync %s) ack %s"
          % (r["case"], r["breakdown"], ms("push_median_s"), ratio, ms("tx_pack_s"),
             r.get("tx_copies", 0), ms("tx_copy_sync_s"), ms("tx_slot_wait_s"),
             ms("tx_read_wait_s"), ms("tx_notify_s"), ms("tx_commit_s"), ms("rx_wait_s"),
             ms("rx_copy_s"), r.get("rx_copies", 0), ms("rx_copy_sync_s"), ms("rx_ack_s")))
EOF
  then
    record breakdown failed "$(last_line "$OUT/refit-breakdown.err")"
    return 0
  fi
  while IFS= read -r line; do
    record breakdown ok "$line"
  done <"$OUT/refit-breakdown.txt"
}

if ((built && smoke_ok)); then
  # the refit rows at 8 GiB (seven variants, issue 37's experiments among them) and the group
  # rows (two rank processes through host memory, 2 GiB): more than a minute on an H200
  bench bench-c "$OUT/bench-gpu.json" 200 "$build/ferry" bench gpu --json
  breakdown
  bench bench-py "$OUT/bench-gpu-python.json" 120 \
    env PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" FERRY_LIB="$build/libferry.so" \
    "$py" -m ferry.bench gpu --json
else
  record bench-c skipped "no working build"
  record bench-py skipped "no working build"
fi

# ---- CPU rows a small VM cannot reach (issue 31's consumer start; the refit group rows) -------

# The store's consumer-start and first-get rows: on the 2-core PVM guest where ferry is built
# they never got a result; this machine has 16 cores and is no PVM guest.
cpu_rows() {
  local t
  t=$(limit 40)
  if ((t == 0)); then
    record store-1st skipped "no time left"
  else
    timeout "$t" "$build/ferry" bench store --no-baselines --pace 0 >"$OUT/bench-store.txt" 2>&1
    rc=$?
    grep -E 'consumer-start|first' "$OUT/bench-store.txt" >"$OUT/bench-store-first.txt"
    record store-1st "rc $rc" "$(wc -l <"$OUT/bench-store-first.txt") rows in bench-store-first.txt"
  fi
  # The M×N refit group rows need network namespaces (root, iproute2, tc): probe, skip if refused.
  # Row (d), two sender ranks on one GPU, is `ferry bench gpu`'s refit-group rows (no namespaces).
  if ! command -v ip >/dev/null; then
    record netns skipped "no ip(8) on this machine"
  elif ! ip netns add ferry-probe >"$OUT/netns.txt" 2>&1; then
    record netns skipped "ip netns add refused: $(last_line "$OUT/netns.txt")"
  else
    ip netns del ferry-probe
    t=$(limit 90)
    if ((t == 0)); then
      record refit-grp skipped "no time left"
    else
      timeout "$t" "$build/ferry" bench refit --group-only >"$OUT/bench-refit-group.txt" 2>&1
      rc=$?
      record refit-grp "rc $rc" "$(last_line "$OUT/bench-refit-group.txt")"
    fi
  fi
}
((built && smoke_ok)) && [[ ${GPU_CHECK_CPU_ROWS:-1} == 1 ]] && cpu_rows

summary
((built && smoke_ok && tests_ok)) || exit 1
exit 0

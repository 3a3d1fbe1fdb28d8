#!/usr/bin/env bash
# The device check (docs/GPU.md, "The device check"): one command, run on a lent GPU machine from
# the repository root, that builds ferry there and runs what only a real GPU can tell us. That
# machine is a bare CUDA image (compiler, CMake, python3 with torch) with no package registry and
# no network, so the Debian 12 libraries ferry builds against come with the tree: .gpu-debs/,
# made here by scripts/gpu-debs.sh and carried by the device tool (carry: [".gpu-debs"]).
#
# Steps, each under its own timeout (killed 5 s after it, should it ignore the first signal),
# all within BUDGET seconds (default 320: the device tool's run gets timeout_s 360, and the
# session's 15 minutes of device time leave room to run it twice):
#   unpack     every .deb into a prefix under /tmp (dpkg-deb, else ar + tar, else python3)
#   env        nvidia-smi, nvcc, python3/torch/numpy, glibc, uname into env.txt
#   configure  RelWithDebInfo, UCX off, into build-gpu/ (pkg-config and CMake see the prefix);
#              warnings not fatal (FERRY_WERROR=OFF): the image's compiler is not Debian's gcc 12,
#              and a new warning there must not cost the session its one device run. Counted.
#   build      everything, -j$(nproc)
#   smoke      build-gpu/ferry --version: the carried libraries load at run time too; then
#              `ferry info` (its cuda: line) into ferry-info.txt
#   ctest      the tests labelled `cuda`, FERRY_TEST_CUDA=driver (the real libcuda, no stand-in)
#   bench      `ferry bench gpu --json` and `python3 -m ferry.bench gpu --json`; the refit rows'
#              breakdowns (issue 37: where a push's time went) one line each into
#              refit-breakdown.txt and the summary; the group rows (row d) are bench gpu's own
#   cpu rows   `ferry bench store --no-baselines --pace 0` (its consumer-start and first rows, into
#              bench-store-first.txt) and, where `ip netns` works, `ferry bench refit
#              --group-only` (bench-refit-group.txt); GPU_CHECK_CPU_ROWS=0 leaves them out
# The device tool brings back at most 8 files of $OUT (default ./gpu-check-out), so $OUT holds
# only these: summary.txt (the summary, also printed last), env.txt, bench-gpu.json,
# bench-gpu-python.json, refit-breakdown.txt, bench-store-first.txt and logs.tgz (every log and
# .err file: unpack, configure, build, ferry-info, ctest, the benches'). The logs are written
# in a directory under /tmp (printed) and summary.txt and logs.tgz are rewritten after every
# step, so a run stopped from outside still brings back what it had done. Exit status: 0 when
# the build and every test passed (skipped tests included), 1 when configure, build, smoke or a
# test failed, 2 when .gpu-debs is missing, stale (made by another scripts/gpu-debs.sh) or for
# another machine.
#
# Rehearsal without a GPU (GPU_CHECK_STANDIN=1, docs/GPU.md): the same steps with the tests'
# stand-in driver (build-gpu/tests/libferry_cudastub.so, host memory) in place of libcuda: the
# cuda tests run on the stand-in, the benches with --quick. Its summary says "STAND-IN
# REHEARSAL: not GPU figures" first and last, and on every bench line: its timings are host
# memcpys. It checks the script, the carried packages and the benches end to end before the one
# device run; it measures nothing.
#
# Usage: scripts/gpu-check.sh        (OUT, BUDGET, PYTHON, GPU_CHECK_STANDIN and
#                                     GPU_CHECK_CPU_ROWS from the environment, all optional)
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
BUDGET=${BUDGET:-320}
py=${PYTHON:-python3} # the image's, with torch and numpy
debs=$root/.gpu-debs
prefix=/tmp/ferry-gpu-deps # the unpacked packages (usr/...), redone on every run
rt=$prefix/rt              # runtime libraries the machine lacks: LD_LIBRARY_PATH
build=$root/build-gpu
standin=0
[[ ${GPU_CHECK_STANDIN:-0} == 1 ]] && standin=1
# Every log: outside $OUT (the device tool brings back 8 files of it), packed into logs.tgz there.
if ! logs=$(mktemp -d /tmp/ferry-gpu-check.XXXXXX); then
  echo "gpu-check: cannot make a log directory under /tmp" >&2
  exit 2
fi
# what an earlier run left in $OUT (a device run's $OUT starts empty)
(cd "$OUT" && rm -f summary.txt env.txt bench-gpu.json bench-gpu-python.json refit-breakdown.txt \
  bench-store-first.txt logs.tgz)

# ---- the summary -----------------------------------------------------------------------------

steps=()
banner="STAND-IN REHEARSAL (tests/cudastub over host memory): not GPU figures"
summary_text() { # title
  if ((standin)); then echo "---- $banner ----"; fi
  echo "---- gpu-check $1 ($(date -u '+%F %T UTC'), ${SECONDS}s of ${BUDGET}s) ----"
  printf '%s\n' "${steps[@]}"
  echo "results: $OUT (logs: $logs)"
  if ((standin)); then echo "---- $banner ----"; fi
}

# After each step: summary.txt and logs.tgz as they stand, so that a run stopped from outside
# still brings back both.
record() { # step status why
  steps+=("$(printf '%-10s %-8s %s' "$1" "$2" "$3")")
  printf '== %-10s %-8s %s\n' "$1" "$2" "$3"
  summary_text "summary so far (the run stopped here if no final summary follows)" \
    >"$OUT/summary.txt"
  tar -czf "$OUT/logs.tgz" -C "$logs" . 2>/dev/null
}

summary() {
  summary_text summary | tee "$OUT/summary.txt"
  tar -czf "$OUT/logs.tgz" -C "$logs" . 2>/dev/null
}

# Stopped from outside (the device tool's timeout, ^C): the summary of what ran, then out.
# shellcheck disable=SC2317 # called by the trap below
stopped() {
  local last=start
  ((${#steps[@]})) && last=${steps[-1]}
  record stopped killed "SIGTERM or SIGINT after ${SECONDS}s, in the step after ${last%% *}"
  summary
  exit 124
}
trap stopped TERM INT

# Seconds a step may take: its own cap, or what is left of the budget (less a margin for the
# summary), whichever is smaller; 0 when nothing useful is left.
limit() {
  local left=$((BUDGET - SECONDS - 10))
  ((left > $1)) && left=$1
  ((left < 5)) && left=0
  echo "$left"
}

# timeout, with SIGKILL 5 s after the SIGTERM for a command that ignores it
tmo() { timeout -k 5 "$@"; }

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
  tmo 60 "$py" - "$1" "$2" <<'EOF'
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
  member=$(cd "$tmp" && tmo 30 ar t "$1" | grep '^data\.tar') &&
    (cd "$tmp" && tmo 30 ar x "$1" "$member") &&
    tmo 60 tar -xf "$tmp/$member" -C "$2"
  rc=$?
  rm -rf "$tmp"
  return $rc
}

unpack_all() {
  local deb how=""
  rm -rf "$prefix" && mkdir -p "$prefix" "$rt" || return 1
  for deb in "$debs"/*.deb; do
    if command -v dpkg-deb >/dev/null && tmo 60 dpkg-deb -x "$deb" "$prefix"; then
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
if how=$(unpack_all 2>"$logs/unpack.err"); then
  nlibs=$(link_missing_libs)
  ls "$rt" >"$logs/unpack.txt" # the carried libraries this machine runs with
  ndebs=$(find "$debs" -name '*.deb' | wc -l)
  record unpack ok "$ndebs debs via $how, $nlibs libraries the machine lacks, $((SECONDS - t0))s"
  unpacked=1
else
  record unpack failed "$(last_line "$logs/unpack.err")"
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
    tmo 30 nvidia-smi 2>&1
    tmo 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
  else
    echo "not present"
  fi
  echo "## libcuda"
  (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null) | grep 'libcuda\.so' ||
    echo "not in the loader cache"
  echo "## nvcc --version"
  if command -v nvcc >/dev/null; then tmo 30 nvcc --version 2>&1
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then tmo 30 /usr/local/cuda/bin/nvcc --version 2>&1
  else echo "not present"; fi
  echo "## cc / cmake"; cc --version 2>&1 | head -n1; cmake --version 2>&1 | head -n1
  echo "## python3"
  tmo "$t" "$py" - <<'EOF' 2>&1 || echo "python3: failed"
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
  elif tmo "$t" cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
       -DFERRY_WITH_UCX=OFF -DFERRY_WERROR=OFF -DPKG_CONFIG_EXECUTABLE="$pkgconf" \
       >"$logs/configure.log" 2>&1; then
    record configure ok "$((SECONDS - t0))s"
    t=$(limit 300) t0=$SECONDS
    if ((t == 0)); then
      record build skipped "no time left"
    elif tmo "$t" cmake --build "$build" -j"$(nproc)" >"$logs/build.log" 2>&1; then
      warnings=$(grep -c 'warning: ' "$logs/build.log")
      record build ok "$((SECONDS - t0))s, $warnings compiler warnings (build.log)"
      built=1
    else
      rc=$?
      why=$(grep -m1 -E '(error|Error)[: ]' "$logs/build.log" | cut -c1-60)
      record build failed "rc $rc after $((SECONDS - t0))s (limit ${t}s): $why"
      grep -m10 -B2 -E '(error|Error)[: ]' "$logs/build.log" # -j interleaves: the first errors
      tail -n 5 "$logs/build.log"
    fi
  else
    rc=$?
    why=$(grep -m1 -E 'Error|not found' "$logs/configure.log" | cut -c1-80)
    record configure failed "rc $rc (limit ${t}s): $why"
    tail -n 20 "$logs/configure.log"
    record build skipped "configure failed"
  fi
else
  record configure skipped "unpack failed"
  record build skipped "unpack failed"
fi

# ---- smoke: the binaries load with the carried libraries -------------------------------------

# A rehearsal: every step after the build loads the stand-in in place of libcuda.so.1.
stub=$build/tests/libferry_cudastub.so
((standin && built)) && export FERRY_CUDA_LIB=$stub

smoke_ok=0
if ((built)) && ((standin)) && [[ ! -f $stub ]]; then
  record smoke failed "GPU_CHECK_STANDIN=1, but the build made no $stub"
elif ((built)); then
  if v=$(tmo 20 "$build/ferry" --version 2>&1); then
    # what ferry itself makes of the driver (its `cuda:` line), beside env.txt's view
    tmo 20 "$build/ferry" info >"$logs/ferry-info.txt" 2>&1
    cuda=$(grep -m1 '^cuda:' "$logs/ferry-info.txt" | tr -s ' ' | cut -c1-70)
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
  # 120 s: 47 tests took 50 s serially on the 2-core stand-in rehearsal; one that hangs must
  # leave bench-c its turn (each case's own ctest TIMEOUT is 300 s, longer than this)
  t=$(limit 120) t0=$SECONDS
  jobs=$(nproc)
  ((jobs > 8)) && jobs=8 # tests run beside each other in `make test` too; one GPU, 8 contexts
  if ((t == 0)); then
    record ctest skipped "no time left"
  else
    # -V: every test's own output in the log, so the skips show: cmocka's skip() and
    # tests/testutil.c's tu_skip ("SKIP no CUDA driver: ...") both pass the test. Counted below,
    # so "all passed" on a machine without a driver is visibly not a CUDA result.
    # FERRY_TEST_CUDA=driver: the real libcuda; a rehearsal leaves the tests on their stand-in
    mode=driver
    ((standin)) && mode=stand-in
    (cd "$build" && FERRY_TEST_CUDA=$mode tmo "$t" ctest -L cuda -V -j"$jobs" --output-on-failure) \
      >"$logs/ctest.log" 2>&1
    rc=$?
    cm_skipped=$(awk 'match($0, /SKIPPED \] [0-9]+ test\(s\), listed below/) {
                        n += substr($0, RSTART + 10) + 0 } END { print n + 0 }' "$logs/ctest.log")
    tu_skipped=$(grep -cE '^([0-9]+: )?SKIP ' "$logs/ctest.log")
    skip_why=$(grep -m1 -oE 'SKIP no CUDA driver.*' "$logs/ctest.log" | cut -c6-60)
    if grep -q 'No tests were found' "$logs/ctest.log"; then
      record ctest skipped "no test is labelled cuda (// ferry-test: cuda) in this tree"
    elif ((rc == 0)); then
      why=$(grep -m1 'tests passed' "$logs/ctest.log")
      why+="; $cm_skipped cases skipped, $tu_skipped SKIP lines${skip_why:+ ($skip_why)}"
      why+="; $((SECONDS - t0))s"
      record ctest ok "$why"
    else
      tests_ok=0
      why=$(grep -m1 'tests passed' "$logs/ctest.log")
      ((rc == 124 || rc == 137)) && why="timed out after ${t}s"
      record ctest failed "${why:-rc $rc}: ctest.log, $((SECONDS - t0))s"
      grep -A20 'The following tests FAILED' "$logs/ctest.log"
    fi
  fi
else
  record ctest skipped "no build"
fi

# ---- the GPU benchmarks (modes others are writing: absent is not a failure) -------------------

# bench name json-file cap command...
bench() {
  local name=$1 json=$2 t rc out why t0=$SECONDS
  t=$(limit "$3")
  shift 3
  if ((t == 0)); then
    record "$name" skipped "no time left"
    return
  fi
  local err=$logs/${json##*/}.err
  tmo "$t" "$@" >"$json" 2>"$err"
  rc=$?
  out=$(cat "$err" "$json")
  if grep -qi 'no CUDA driver' <<<"$out"; then # whatever its status: nothing was measured
    record "$name" skipped "$(grep -oim1 'no CUDA driver.*' <<<"$out" | cut -c1-70)"
  elif grep -qE '"skipped": ?true' "$json"; then # the Python one's "torch.cuda is not available"
    why=$(grep -m1 -oE '"detail": ?"[^"]*"' "$json" | cut -d'"' -f4 | cut -c1-90)
    record "$name" skipped "${why:-its JSON says skipped}"
  elif ((rc == 0)); then
    why="$(wc -l <"$json") lines in ${json##*/}, $((SECONDS - t0))s"
    ((standin)) && why+=" (stand-in: not GPU figures)"
    record "$name" ok "$why"
  elif grep -qiE "unknown mode|invalid choice: 'gpu'" <<<"$out"; then
    record "$name" skipped "no gpu mode in this tree yet"
  elif why=$(grep -m1 -o "No module named '[^']*'" <<<"$out"); then
    record "$name" skipped "python3: $why"
  else
    why="rc $rc: $(last_line "$err")"
    ((rc == 124 || rc == 137)) && why="timed out after ${t}s"
    record "$name" failed "$why"
  fi
}

# Issue 37: each refit row's breakdown line (bench-gpu.json: "breakdown", the phases per timed
# push of the sender and the receiver) as one line of milliseconds, beside its ratio to the d2d
# copy of its case, into refit-breakdown.txt and the summary.
breakdown() {
  local json=$OUT/bench-gpu.json line
  [[ -s $json ]] || return 0
  if ! tmo 30 "$py" - "$json" >"$OUT/refit-breakdown.txt" 2>"$logs/refit-breakdown.err" <<'EOF'
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
    record breakdown failed "$(last_line "$logs/refit-breakdown.err")"
    return 0
  fi
  while IFS= read -r line; do
    ((standin)) && line="stand-in, not GPU figures: $line"
    record breakdown ok "$line"
  done <"$OUT/refit-breakdown.txt"
}

quick=()
((standin)) && quick=(--quick) # the stand-in copies through host memory: small sizes
if ((built && smoke_ok)); then
  # the refit rows at 8 GiB (seven variants, issue 37's experiments among them) and the group
  # rows (two rank processes through host memory, 2 GiB): more than a minute on an H200
  bench bench-c "$OUT/bench-gpu.json" 200 "$build/ferry" bench gpu --json "${quick[@]}"
  breakdown
  # unbuffered: a row printed before a timeout is in the file
  bench bench-py "$OUT/bench-gpu-python.json" 120 \
    env PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" FERRY_LIB="$build/libferry.so" \
    PYTHONUNBUFFERED=1 "$py" -m ferry.bench gpu --json "${quick[@]}"
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
    tmo "$t" "$build/ferry" bench store --no-baselines --pace 0 >"$logs/bench-store.txt" 2>&1
    rc=$?
    grep -E 'consumer-start|first' "$logs/bench-store.txt" >"$OUT/bench-store-first.txt"
    record store-1st "rc $rc" "$(wc -l <"$OUT/bench-store-first.txt") rows in bench-store-first.txt"
  fi
  # The M×N refit group rows need network namespaces (root, iproute2, tc): probe, skip if refused.
  # Row (d), two sender ranks on one GPU, is `ferry bench gpu`'s refit-group rows (no namespaces).
  if ((standin)); then
    record netns skipped "a rehearsal runs no namespaces (the H200 image has no ip(8))"
  elif ! command -v ip >/dev/null; then
    record netns skipped "no ip(8) on this machine"
  elif ! ip netns add ferry-probe >"$logs/netns.txt" 2>&1; then
    record netns skipped "ip netns add refused: $(last_line "$logs/netns.txt")"
  else
    ip netns del ferry-probe
    t=$(limit 90)
    if ((t == 0)); then
      record refit-grp skipped "no time left"
    else
      tmo "$t" "$build/ferry" bench refit --group-only >"$logs/bench-refit-group.txt" 2>&1
      rc=$?
      record refit-grp "rc $rc" "$(last_line "$logs/bench-refit-group.txt")"
    fi
  fi
}
((built && smoke_ok)) && [[ ${GPU_CHECK_CPU_ROWS:-1} == 1 ]] && cpu_rows

summary
((built && smoke_ok && tests_ok)) || exit 1
exit 0

#!/bin/sh
# Model-checks the control protocol (control.pml) with spin: a safety run (assertions and invalid
# end states, i.e. deadlocks) with 2 and 3 ranks, which must find no error; and the one-int32
# design it replaces (legacy.pml), in which spin must find the lost command. Exit 77 (ctest:
# skipped) when spin or a C compiler is missing, or 1 under `make test` (FERRY_TEST_STRICT=1),
# which installs both.
set -u
dir=${1:-$(dirname "$0")}
if ! command -v spin >/dev/null 2>&1 || ! command -v cc >/dev/null 2>&1; then
  echo "control_spin SKIPPED: spin (Debian package 'spin') or cc not installed"
  [ "${FERRY_TEST_STRICT:-}" = 1 ] && exit 1
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$dir/control.pml" "$dir/legacy.pml" "$work/" || exit 1
cd "$work" || exit 1

check() { # model, extra spin flags; prints pan's summary, returns pan's error count
  spin -a $2 "$1" >spin.out 2>&1 || { cat spin.out; return 99; }
  cc -O2 -DSAFETY -DCOLLAPSE -w -o pan pan.c || return 99
  ./pan -m1000000 >pan.out 2>&1
  grep -E "errors:|states, stored|invalid end|assertion violated|pan:" pan.out | head -8
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' pan.out)
  return "${errors:-99}"
}

status=0
for nr in 2 3; do
  echo "== control.pml, $nr ranks, 2 controllers (one may abort and crash)"
  check control.pml "-DNR=$nr"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAIL: spin found $rc error(s) in the control protocol"
    [ -f control.pml.trail ] && spin -t -p -DNR=$nr control.pml | tail -40
    status=1
  fi
  rm -f ./*.trail
done
echo "== legacy.pml (the one-int32 design): spin must find the lost command"
check legacy.pml ""
rc=$?
if [ "$rc" -eq 0 ] || [ "$rc" -eq 99 ]; then
  echo "FAIL: spin did not find the known lost-update bug in legacy.pml"
  status=1
else
  echo "ok: the lost command of the old design is found ($rc error)"
fi
exit $status

#!/bin/sh
# The fault-injection suite (ctest `faults`): one row per fault of docs/RELIABILITY.md. Each row
# runs its cases by name (FERRY_TEST_ONLY, tests/testutil.c; pytest's FILE::TEST for Python), each
# under `timeout`, and prints "row N: fault — promise — ok (X.Y s)". It fails if a case fails,
# runs no test (a renamed case), or hangs past its bound. The cases themselves assert the error,
# its bound in time, that the healthy parties go on and that nothing committed is lost or
# misreported; they also run in their own executables (this suite is the index, and a quick
# re-run of just the faults).
#
# usage: run.sh TESTS_DIR   (the build's tests/ folder; ctest passes FERRY_CLI, FERRY_LIB,
#                            FERRY_SOURCE_DIR)
set -u
bin=${1:?usage: run.sh TESTS_DIR}
src=${FERRY_SOURCE_DIR:?FERRY_SOURCE_DIR is not set (ctest sets it)}
bound=${FERRY_FAULT_CASE_S:-240} # a hang detector, not a timing assertion
py=/usr/bin/python3
log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed=0
total_t0=$(date +%s.%N)

# case EXE NAME: one cmocka case of tests/EXE.c, or py FILE::TEST (python/tests)
run_case() {
  if [ "$1" = py ]; then
    (cd "$src/python" && timeout -k 5 "$bound" "$py" -m pytest -q -p no:cacheprovider \
      "tests/$2") >"$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] && ! grep -q " passed" "$log" && rc=99
  else
    FERRY_TEST_ONLY=$2 timeout -k 5 "$bound" "$bin/$1" >"$log" 2>&1
    rc=$?
    [ $rc -eq 0 ] && ! grep -Eq '^\[  PASSED  \] [1-9][0-9]* test' "$log" && rc=99
  fi
  return $rc
}

# row N FAULT PROMISE EXE:CASE...
row() {
  n=$1 fault=$2 promise=$3
  shift 3
  t0=$(date +%s.%N)
  status=ok
  skipped=""
  for c in "$@"; do
    exe=${c%%:*} name=${c#*:}
    run_case "$exe" "$name"
    rc=$?
    if [ $rc -ne 0 ]; then
      case $rc in
      124 | 137) why="timed out after ${bound} s" ;;
      99) why="ran no test (renamed?)" ;;
      *) why="exit $rc" ;;
      esac
      status="FAILED: $exe $name $why"
      echo "---- $exe $name ----"
      tail -n 40 "$log"
      break
    fi
    if grep -q '^SKIP ' "$log"; then
      skipped="$skipped; $name: $(grep -m1 '^SKIP ' "$log" | cut -c6-)"
    fi
  done
  s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  [ -n "$skipped" ] && status="$status, part skipped${skipped}"
  echo "row $n: $fault — $promise — $status ($s s)"
  case $status in FAILED*) failed=$((failed + 1)) ;; esac
}

row 1 "shm ring indices/lengths forged by a peer" \
  "the link closes with a clear error, the process goes on" \
  link_test:test_shm_ring_corrupt link_test:test_shm_memfd_shrink \
  link_test:test_shm_segment_check control_test:test_hostile_cell
row 2 "a second Unix user on the host" "refused over shm and tcp (per-user secret)" \
  security_test:test_other_user_refused security_test:test_same_user_no_config
row 3 "listen on 0.0.0.0 without a token" "refused, one line on how to set one" \
  link_test:test_exposed_listen_needs_token security_test:test_exposed_needs_explicit_token
row 4 "a key with a NUL byte" "refused alike in C and Python, nothing stored" \
  py:test_store.py::test_key_rules_match_c
row 5 "refit receiver SIGSTOP mid-push" \
  "dropped alone, the healthy commit; it claims no version it lacks" \
  refit_test:test_receiver_stalled refit_test:test_receiver_stalled_chain
row 6 "refit sender SIGKILL mid-push" "receivers report torn, not their old version" \
  refit_test:test_sender_killed
# the issue's 20 s of mixed calls against both stopped directories (3 s in store_test alone)
export FERRY_STOP_MIX_MS=20000
row 7 "directory (ferry serve, Redis) SIGSTOP" \
  "every call (get, stat, exists, list, put, delete) returns within its timeout, naming its wait" \
  store_test:test_stopped_directory store_test:test_stopped_directory_mixed \
  store_test:test_close_stopped_directory
unset FERRY_STOP_MIX_MS
row 8 "tcp uploaders SIGSTOP mid-upload" "an unrelated upload still lands" \
  store_test:test_stalled_uploaders
row 9 "EMFILE at the listener" "accept backs off: no spin, no log flood, service resumes" \
  link_test:test_out_of_descriptors
row 10 "half-sent HTTP flood on ferry ctl serve" \
  "request deadline; a full server closes the oldest still sending; others served" \
  control_cli_test:test_http_flood
row 11 "files a killed process left in /dev/shm" "reclaimed by ferry gc / the next of that name" \
  control_cli_test:test_gc
row 12 "store owner SIGKILL during gets" \
  "gets fail clearly, never torn; the key goes when its lease lapses" \
  store_test:test_owner_killed
row 13 "store owner SIGSTOP" "its key times out (1 s), others served, whole after SIGCONT" \
  store_test:test_owner_stopped
row 14 "refit receiver SIGKILL mid-push" "the others commit; the restarted one catches up" \
  refit_test:test_receiver_killed refit_test:test_chain_receiver_killed
row 15 "refit sender SIGSTOP mid-push" "waits time out, no version claimed; resumed, lands whole" \
  refit_test:test_sender_stopped
row 16 "control rank SIGKILL" "requests fail at once naming the dead rank" \
  control_test:test_dead_rank_named control_test:test_rank_dies_mid_request
row 17 "control rank SIGSTOP" "the request times out naming it alone; after SIGCONT it recovers" \
  control_test:test_rank_stopped
row 18 "controller SIGKILL mid-request" "the ranks finish the command; the next controller goes on" \
  control_test:test_controller_killed_mid_request
row 19 "directory SIGKILL, restarted empty" "nodes register again and re-publish what they hold" \
  store_test:test_directory_restart
row 20 "Redis SIGKILL, restarted empty" \
  "calls fail clearly in their timeout, nothing misreported; keys re-published" \
  store_test:test_redis_killed
row 21 "link peer SIGKILL mid-read" "the read fails clearly, the reader goes on" \
  link_conformance_tcp:test_killed_mid_read link_conformance_shm:test_killed_mid_read
row 22 "mq subscriber SIGKILL" "dropped; the publisher goes on" \
  py:test_mq.py::test_killed_subscriber_is_dropped
row 24 "another user's links planted for a refit rendezvous" \
  "never followed: no file of the victim's written; a link under the name refused" \
  py:test_refit_rendezvous.py::test_planted_links_never_followed \
  py:test_refit_rendezvous.py::test_link_under_the_name_refused
row 25 "a FIFO, link or other user's file planted in FERRY_CTL_DIR" \
  "refused at once naming it, never waited on; ferry gc skips it" \
  py:test_refit_rendezvous.py::test_planted_fifo_refused_at_once \
  py:test_refit_rendezvous.py::test_other_users_file_refused \
  py:test_refit_rendezvous.py::test_gc_skips_planted_files control_test:test_planted_cell_files
row 26 "~70 connections trickling headers to ferry serve --http" \
  "health answered while they trickle; each closed at the request deadline" \
  security_test:test_metrics_slowloris security_test:test_metrics_reserved_slots
row 27 "~70 connections trickling headers to ferry ctl serve" \
  "health answered while they trickle; each closed at the request deadline" \
  control_cli_test:test_http_slowloris
row 28 "a hello whose node name holds a newline, ESC and BEL (no token)" \
  "refused (EPROTO) before the token; the log line quotes it escaped, no raw control byte" \
  link_test:test_hostile_node_name
row 29 "the Redis primary SIGKILLed behind Sentinel" \
  "calls fail clearly in their timeout, then go on against the promoted replica; records kept" \
  store_test:test_redis_sentinel_failover
row 30 "the etcd leader SIGKILLed mid-run (three members)" \
  "puts, gets, pushes go on after the election within their timeouts; nothing acked lost; leases kept" \
  etcd_fault_test:test_etcd_leader_killed etcd_fault_test:test_etcd_lease_election \
  etcd_client_test:test_etcd_renewal_beside_held_call
row 31 "two of three etcd members SIGSTOPped, then two SIGKILLed (quorum lost)" \
  "calls fail clearly within their timeout; after a SIGCONT or restart they succeed, nothing lost" \
  etcd_fault_test:test_etcd_quorum_lost etcd_client_test:test_etcd_late_put

total=$(awk -v a="$total_t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
if [ $failed -ne 0 ]; then
  echo "faults: $failed row(s) failed ($total s)"
  exit 1
fi
echo "faults: every row ok ($total s)"

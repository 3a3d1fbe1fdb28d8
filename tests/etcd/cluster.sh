#!/bin/sh
# A throwaway etcd cluster on loopback for the etcd:// directory tests (issue 36): N members
# (default 3), each on free client and peer ports with its own data dir under one temp dir.
#   cluster.sh start DIR [N]   starts the members, waits until the cluster answers, and writes
#                              DIR/endpoints (host:port,host:port,...) and DIR/mN.{pid,port}
#   cluster.sh kill DIR M      SIGKILLs member M (1-based); cluster.sh leader DIR prints the
#                              leader's member number
#   cluster.sh restart DIR M   starts member M again on its ports and data dir
#   cluster.sh pid DIR M       prints member M's pid while it runs (nothing once it died)
#   cluster.sh stop DIR        kills every member and removes DIR
# Needs etcd and etcdctl (Debian etcd-server, etcd-client; scripts/deps.sh test).
set -eu
cmd=${1:?usage: cluster.sh start|kill|restart|leader|stop DIR [N|M]}
dir=${2:?usage: cluster.sh CMD DIR}

free_ports() { # N free loopback ports
  python3 -c 'import socket,sys
s=[socket.socket() for _ in range(int(sys.argv[1]))]
[x.bind(("127.0.0.1",0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))' "$1"
}

launch() { # member number: uses DIR/cluster (initial-cluster) and DIR/mN.ports
  m=$1
  set -- $(cat "$dir/m$m.ports")
  etcd --name "m$m" --data-dir "$dir/m$m.data" \
    --listen-client-urls "http://127.0.0.1:$1" --advertise-client-urls "http://127.0.0.1:$1" \
    --listen-peer-urls "http://127.0.0.1:$2" --initial-advertise-peer-urls "http://127.0.0.1:$2" \
    --initial-cluster "$(cat "$dir/cluster")" --initial-cluster-state new \
    --initial-cluster-token ferry-test --heartbeat-interval 50 --election-timeout 500 \
    >"$dir/m$m.log" 2>&1 &
  echo $! >"$dir/m$m.pid"
}

# The pid of member M while it is this cluster's etcd (its command line names DIR/mM.data), else
# nothing: a member that died leaves its pid to be reused (pid_max can be 32768, and make test
# starts thousands of processes), and a kill by the stale number once hit another test's etcd.
member_pid() {
  pid=$(cat "$dir/m$1.pid" 2>/dev/null) || return 0
  if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "--data-dir $dir/m$1.data "; then
    echo "$pid"
  fi
}

case $cmd in
start)
  n=${3:-3}
  mkdir -p "$dir"
  ports=$(free_ports $((2 * n)))
  cluster="" endpoints="" i=1
  for p in $ports; do
    if [ $((i % 2)) -eq 1 ]; then c=$p; else
      m=$((i / 2))
      echo "$c $p" >"$dir/m$m.ports"
      cluster="$cluster${cluster:+,}m$m=http://127.0.0.1:$p"
      endpoints="$endpoints${endpoints:+,}127.0.0.1:$c"
    fi
    i=$((i + 1))
  done
  echo "$cluster" >"$dir/cluster"
  echo "$endpoints" >"$dir/endpoints"
  m=1
  while [ $m -le "$n" ]; do launch $m; m=$((m + 1)); done
  t=0
  until etcdctl --endpoints "$endpoints" --dial-timeout 1s endpoint health >/dev/null 2>&1; do
    t=$((t + 1))
    [ $t -le 100 ] || { echo "etcd cluster in $dir did not come up; see $dir/m*.log" >&2; exit 1; }
    sleep 0.1
  done
  cat "$dir/endpoints" ;;
kill)
  pid=$(member_pid "${3:?member}")
  [ -z "$pid" ] || kill -9 "$pid" 2>/dev/null || true ;;
pid) member_pid "${3:?member}" ;;
restart) launch "${3:?member}" ;;
leader)
  addr=$(etcdctl --endpoints "$(cat "$dir/endpoints")" --dial-timeout 1s -w simple \
    endpoint status 2>/dev/null | awk -F', ' '$5 == "true" {print $1}' | head -1)
  for f in "$dir"/m*.ports; do
    [ "127.0.0.1:$(cut -d' ' -f1 "$f")" = "$addr" ] && basename "$f" .ports | tr -d m
  done ;;
stop)
  for f in "$dir"/m*.pid; do
    [ -e "$f" ] || continue
    pid=$(member_pid "$(basename "$f" .pid | tr -d m)")
    [ -z "$pid" ] || kill -9 "$pid" 2>/dev/null || true
  done
  rm -rf "$dir" ;;
*) echo "usage: cluster.sh start|kill|restart|leader|pid|stop DIR [N|M]" >&2; exit 2 ;;
esac

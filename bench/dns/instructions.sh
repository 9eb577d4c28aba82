#!/usr/bin/env bash
# Instructions per answered DNS query (issue 47.4): a figure that does not
# move with the machine's load, for when peak-qps rounds disagree. Goal:
# the agent's resolver at most 0.7 of dnsmasq's.
#
# Each server runs under `valgrind --tool=callgrind` on loopback, answering
# `web.internal` (A, one record): the agent's resolver crate as the agent
# serves it (dns/examples/serve.rs: the same DnsServer, table and
# listener; the agent around it does no work per query) on 127.0.0.1:10063,
# and dnsmasq on 127.0.0.1:10064. dnsperf sends SMALL and then LARGE
# queries at a bounded rate, each to a fresh server; the instructions of
# the difference over the answers of the difference are the cost of one
# query, start-up and idle work cancelling out. Syscalls per query come the
# same way from `strace -c -f`.
#
# Root not needed. Traffic stays on loopback. About 3 minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

SMALL=${SMALL:-2000}
LARGE=${LARGE:-12000}
RATE=${RATE:-400}        # queries per second: what a server under valgrind keeps up with
DNSMASQ=/usr/sbin/dnsmasq
need=()
command -v valgrind >/dev/null || need+=(valgrind)
command -v strace >/dev/null || need+=(strace)
command -v dnsperf >/dev/null || need+=(dnsperf)
command -v dig >/dev/null || need+=(dnsutils)
[ -x "$DNSMASQ" ] || need+=(dnsmasq-base)
if [ ${#need[@]} -gt 0 ]; then
  echo "bench/dns/instructions: installing ${need[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
# shellcheck source=/dev/null
source scripts/need-cargo.sh
cargo build --release -q -p zattera-dns --example serve
SERVE=$CARGO_TARGET_DIR/release/examples/serve

work=$(mktemp -d /tmp/zt-bench-dnsi.XXXXXX)
server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill -INT "$server_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
printf 'web.internal A\n' >"$work/queries"

server_argv() { # name
  case $1 in
    agent) echo "$SERVE --listen 127.0.0.1 --port 10063 --project bench --env production" ;;
    # -u root: dnsmasq would drop to nobody, who cannot write the tool's output.
    dnsmasq) echo "$DNSMASQ -k -u root --no-resolv --no-hosts --conf-file=/dev/null --pid-file= --bind-interfaces \
      --listen-address=127.0.0.1 --port=10064 --host-record=web.internal,10.97.0.1" ;;
  esac
}
port_of() { case $1 in agent) echo 10063 ;; dnsmasq) echo 10064 ;; esac; }
# Both stop cleanly on these, so the tool writes its totals.
stop_signal() { case $1 in agent) echo INT ;; dnsmasq) echo TERM ;; esac; }

# Runs server $1 under tool $2 (callgrind | strace), sends $3 queries;
# prints "<answered> <instructions or syscalls>".
one_run() { # name tool count
  local name=$1 tool=$2 n=$3 port out answered
  port=$(port_of "$name")
  out="$work/$name-$tool-$n"
  case $tool in
    callgrind) valgrind --tool=callgrind --callgrind-out-file="$out" $(server_argv "$name") >/dev/null 2>&1 & ;;
    strace) strace -f -c -o "$out" $(server_argv "$name") >/dev/null 2>&1 & ;;
  esac
  server_pid=$!
  for _ in $(seq 300); do
    dig +short +time=1 +tries=1 -p "$port" @127.0.0.1 web.internal 2>/dev/null | grep -q . && break
    sleep 0.2
  done
  answered=$(dnsperf -s 127.0.0.1 -p "$port" -d "$work/queries" -n "$n" -c 1 -q 50 -Q "$RATE" -t 5 2>&1 |
    awk '/Queries completed/ {print $3}')
  # valgrind runs in the server's process; strace is the traced server's parent.
  local target=$server_pid
  [ "$tool" = strace ] && target=$(pgrep -P "$server_pid" | head -n 1)
  kill -"$(stop_signal "$name")" "$target" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
  case $tool in
    callgrind) echo "$answered $(awk '/^(summary|totals):/ {print $2; exit}' "$out")" ;;
    strace) echo "$answered $(awk '/ total$/ {print $4; exit}' "$out")" ;;
  esac
}

echo "== instructions and syscalls per answered query ($SMALL and $LARGE queries at $RATE/s, difference)"
declare -A per
for tool in callgrind strace; do
  for name in agent dnsmasq; do
    read -r a1 i1 <<<"$(one_run "$name" "$tool" "$SMALL")"
    read -r a2 i2 <<<"$(one_run "$name" "$tool" "$LARGE")"
    per[$name-$tool]=$(awk -v a1="$a1" -v a2="$a2" -v i1="$i1" -v i2="$i2" \
      'BEGIN {printf "%.1f", (a2 > a1) ? (i2 - i1) / (a2 - a1) : 0}')
    printf '%-8s %-9s answered %6s / %6s  total %14s / %14s  per query %10s\n' \
      "$name" "$tool" "$a1" "$a2" "$i1" "$i2" "${per[$name-$tool]}"
  done
done
awk -v a="${per[agent-callgrind]}" -v d="${per[dnsmasq-callgrind]}" \
    -v sa="${per[agent-strace]}" -v sd="${per[dnsmasq-strace]}" 'BEGIN {
  r = d ? a / d : 0
  printf "instructions per query: agent %.0f, dnsmasq %.0f, ratio %.2f (goal <= 0.7: %s)\n", a, d, r, (r <= 0.7) ? "met" : "MISSED"
  printf "syscalls per query: agent %.2f, dnsmasq %.2f\n", sa, sd
  printf "ROW dns | instructions per answered query (callgrind) | %.0f | dnsmasq | %.0f | %.2f | <= 0.7 | %s\n", a, d, r, (r <= 0.7) ? "met" : "MISSED" > "/dev/stderr"
}'

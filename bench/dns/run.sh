#!/usr/bin/env bash
# DNS benchmark (issue 5): dnsperf against zattera-dns, dnsmasq and
# aardvark-dns, one after the other, each serving the same internal name
# (web.internal -> 10.97.0.1) on its own loopback address, same query set.
# Prints peak qps, the ratios, p99 latency at 80 % of our peak, and our
# resident memory with 10,000 names. Everything stays on 127.77.60.x and
# every run is bounded in time (about two minutes in all).
#
# Needs: dnsperf, dnsmasq (dnsmasq-base), aardvark-dns, cargo. Run as any
# user (high port); on 2 cores the client shares the machine with the server.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

DURATION=${DURATION:-6}      # seconds per peak measurement
RUNS=${RUNS:-3}              # peak runs per server, median taken
LAT_DURATION=${LAT_DURATION:-5}
PORT=10053
OURS=127.77.60.1
DNSMASQ_IP=127.77.60.2
AARDVARK_IP=127.77.60.3
BIG=127.77.60.4
AARDVARK=/usr/lib/podman/aardvark-dns
DNSMASQ=/usr/sbin/dnsmasq

missing=()
command -v dnsperf >/dev/null || missing+=(dnsperf)
[ -x "$DNSMASQ" ] || missing+=(dnsmasq-base)
[ -x "$AARDVARK" ] || missing+=(aardvark-dns)
command -v cargo >/dev/null || missing+=(cargo)
if [ ${#missing[@]} -gt 0 ]; then
  echo "bench/dns: missing ${missing[*]} (apt-get install dnsperf dnsmasq-base aardvark-dns)" >&2
  exit 2
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
cargo build --release -q -p zattera-dns --example serve
SERVE=$CARGO_TARGET_DIR/release/examples/serve

work=$(mktemp -d /tmp/ztd-bench.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/aardvark/aardvark.pid" ] && kill "$(cat "$work/aardvark/aardvark.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "web.internal A" > "$work/queries"

# Waits (at most 5 s) until $1 answers web.internal.
wait_up() {
  for _ in $(seq 50); do
    if dig @"$1" -p "$PORT" +tries=1 +time=1 +short web.internal 2>/dev/null | grep -q 10.97.0.1; then
      return 0
    fi
    sleep 0.1
  done
  echo "bench/dns: nothing answers on $1:$PORT" >&2
  exit 1
}

start_serve() { # ip names outfile
  "$SERVE" --listen "$1" --port "$PORT" --names "$2" --project bench --env production >"$3" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do grep -q '^ready' "$3" && return 0; sleep 0.1; done
  echo "bench/dns: serve did not start: $(cat "$3")" >&2
  exit 1
}

start_serve "$OURS" 0 "$work/ours.out"
"$DNSMASQ" -k --no-resolv --no-hosts --conf-file=/dev/null --pid-file= --bind-interfaces \
  --listen-address="$DNSMASQ_IP" --port="$PORT" --host-record=web.internal,10.97.0.1 \
  >/dev/null 2>&1 &
pids+=($!)
mkdir "$work/aardvark"
printf '%s\nbench0000001 10.97.0.1  web.internal\n' "$AARDVARK_IP" >"$work/aardvark/benchnet"
"$AARDVARK" --config "$work/aardvark" -p "$PORT" run >/dev/null 2>&1 # forks and returns
for ip in "$OURS" "$DNSMASQ_IP" "$AARDVARK_IP"; do wait_up "$ip"; done

# Peak: 8 client sockets, up to 200 queries in flight, one client thread;
# the median of $RUNS runs, since two cores make single runs noisy.
peak_once() {
  dnsperf -s "$1" -p "$PORT" -d "$work/queries" -l "$DURATION" -c 8 -q 200 -T 1 2>&1 |
    awk '/Queries per second/ {print int($4)}'
}
peak() {
  for _ in $(seq "$RUNS"); do peak_once "$1"; done | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'
}
# p99 latency (ms) at a fixed rate, from every response's latency.
p99_at() {
  dnsperf -s "$1" -p "$PORT" -d "$work/queries" -l "$LAT_DURATION" -c 8 -q 200 -T 1 -Q "$2" -v 2>&1 |
    awk '/^> /{print $NF}' | sort -g |
    awk '{v[NR]=$1} END {if (NR == 0) {print "n/a"} else {i=int(NR*0.99); if (i < 1) i=1; printf "%.3f\n", v[i]*1000}}'
}

echo "== peak qps, median of $RUNS runs of ${DURATION}s, same machine, same query (web.internal A)"
ours=$(peak "$OURS");            echo "zattera-dns   $ours"
dnsmasq=$(peak "$DNSMASQ_IP");   echo "dnsmasq       $dnsmasq"
aardvark=$(peak "$AARDVARK_IP"); echo "aardvark-dns  $aardvark"

rate=$((ours * 8 / 10))
echo "== p99 latency at $rate qps (80 % of our peak), ${LAT_DURATION}s; dnsperf -v costs the client CPU here"
ours_p99=$(p99_at "$OURS" "$rate");             echo "zattera-dns   ${ours_p99} ms"
dnsmasq_p99=$(p99_at "$DNSMASQ_IP" "$rate");    echo "dnsmasq       ${dnsmasq_p99} ms"
echo "== p99 latency at 10000 qps (client and server not starved), ${LAT_DURATION}s"
echo "zattera-dns   $(p99_at "$OURS" 10000) ms"
echo "dnsmasq       $(p99_at "$DNSMASQ_IP" 10000) ms"
echo "aardvark-dns  $(p99_at "$AARDVARK_IP" 10000) ms"

start_serve "$BIG" 10000 "$work/big.out"
base_rss=$(sed -n 's/.*rss_kib=\([0-9]*\).*/\1/p' "$work/ours.out")
big_rss=$(sed -n 's/.*rss_kib=\([0-9]*\).*/\1/p' "$work/big.out")
echo "== resident memory: ${base_rss} KiB with 1 name, ${big_rss} KiB with 10,001 names"

echo "== ratios (goal: >= 1.0x dnsmasq, >= 2.0x aardvark-dns, p99 <= 1 ms)"
awk -v o="$ours" -v d="$dnsmasq" -v a="$aardvark" -v p="$ours_p99" 'BEGIN {
  rd = (d > 0) ? o / d : 0; ra = (a > 0) ? o / a : 0
  printf "vs dnsmasq      %.2fx  %s\n", rd, (rd >= 1.0) ? "met" : "MISSED"
  printf "vs aardvark-dns %.2fx  %s\n", ra, (ra >= 2.0) ? "met" : "MISSED"
  printf "p99             %s ms  %s\n", p, (p != "n/a" && p <= 1.0) ? "met" : "MISSED"
}'

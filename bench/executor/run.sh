#!/usr/bin/env bash
# Executor benchmarks (issue 6), against the rig's containerd:
#
#  1. cold converge of 1, 20 and 50 replicas (image already present): the
#     real `zattera-agent run --manifests DIR` binary, timed from its spawn
#     until `status --json` shows every instance RUNNING or HEALTHY, vs the
#     same number of sequential `ctr run -d --cni` with the CNI bridge and
#     host-local plugins (Debian's containernetworking-plugins), timed from
#     the first ctr to the last one's return. Both run `/bin/sh -c 'sleep …'`
#     from the busybox test image, each container in its own network
#     namespace on a bridge with a 10.201.x.0/24 subnet. Goal ratio <= 0.4 at 50
#     (issue 20). Round 1 of each count also samples the growth curve: the
#     agent's RSS, CPU per steady pass and pass time (`CURVE` lines).
#  1b. assignment to RUNNING of one more instance (each 1-replica round): with
#     the agent and its environment's bridge up, a second app's manifest is
#     added; the agent's own account of that bring-up (its debug log, target
#     zattera::bringup: pull check, volumes, netns + veth, spec, snapshot +
#     container record, task create = shim + runc create + log shim, runc
#     start) against one `ctr run -d --cni` (the 1-replica ctr rounds). It
#     starts when the executor hands the assignment to its worker, so the
#     manifest watch's 200 ms debounce is not in it. Goal ratio <= 0.6.
#  2. with 50 instances running: the agent's resident memory (VmRSS) and its
#     CPU over IDLE_SECS (default 60) seconds of idling, from /proc/<pid>/stat
#     utime+stime. Goals <= 30 MiB and <= 1 % of a core.
#
# ctr 1.6 reads its CNI configuration only from /etc/cni/net.d and
# /opt/cni/bin and caches results in /var/lib/cni, with no flag to change
# that; so ctr runs in a private mount namespace (unshare -m) where /etc,
# /opt and /var/lib are overlays onto a temp dir: the host's /etc, /opt and
# /var/lib are never written. The CNI network has no ipMasq (that would
# add iptables chains to the host's tables), so the peer does a little less
# than the agent, which also writes its nftables table.
#
# Everything is ours and removed on exit, also on failure: containerd
# namespaces zt-bench-ex-{agent,ctr}-<pid>, bridges ztbn* (agent, slots
# 120-139 of 10.201.x) and ztbc0 (ctr, 10.201.140.0/24), the agent's nft table,
# temp dirs. Root only; no traffic leaves the host. Roughly 5 minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

COUNTS=${COUNTS:-"1 20 50"}
ROUNDS=${ROUNDS:-3}          # converge rounds per count and peer (median)
IDLE_SECS=${IDLE_SECS:-60}
GROWTH_SECS=${GROWTH_SECS:-12}  # window of each growth-curve sample
RIG_DIR=${ZATTERA_RIG_DIR:-/var/lib/zattera-rig}
SOCK=${ZATTERA_TEST_CONTAINERD:-/run/zattera-rig/containerd/containerd.sock}
IMAGE=docker.io/zattera/busybox:test
TAG=$$
NS_AGENT=zt-bench-ex-agent-$TAG
NS_CTR=zt-bench-ex-ctr-$TAG
PREFIX=ztbn                  # the agent's bridges and veths
CTR_BRIDGE=ztbc0             # ctr's CNI bridge (not under the agent's prefix)
CTR_SUBNET=10.201.140.0/24
NFT_TABLE=zattera_${NS_AGENT//-/_}
CNI_BIN=/usr/lib/cni

if [ "$(id -u)" != 0 ]; then
  echo "bench/executor: must run as root" >&2
  exit 2
fi
[ -x "$CNI_BIN/bridge" ] || {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containernetworking-plugins >/dev/null
}
command -v cargo >/dev/null || export PATH="$HOME/.cargo/bin:$PATH"
bash scripts/rig.sh >/dev/null # idempotent: containerd on $SOCK, test images

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
# AGENT=PATH measures another build (an older commit's, to compare);
# AGENT_ARGS adds `run` flags (e.g. --shim-group-size 1).
read -r -a AGENT_ARGS <<<"${AGENT_ARGS:-}"
if [ -z "${AGENT:-}" ]; then
  cargo build --release -q -p zattera-agent --bin zattera-agent
  AGENT=$CARGO_TARGET_DIR/release/zattera-agent
fi

work=$(mktemp -d /tmp/zt-bench-ex.XXXXXX)
agent_pid=
# shellcheck source=bench/lib/peers.sh
. bench/lib/peers.sh
trap cleanup EXIT INT TERM

# The image, present in both namespaces before anything is timed.
"$AGENT" --containerd-address "$SOCK" --namespace "$NS_AGENT" image import "$RIG_DIR/images/busybox-oci.tar" >/dev/null
ctr_ -n "$NS_CTR" images import "$RIG_DIR/images/busybox-oci.tar" >/dev/null

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# PROFILE=DIR: the first round of each count above 1 also runs under perf
# (bench/lib/profile.sh); those rounds' times include perf's cost.
PROFILE=${PROFILE:-}
# shellcheck source=bench/lib/profile.sh
. bench/lib/profile.sh
# Host CPU ticks: "busy idle", from /proc/stat.
host_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6}' /proc/stat; }
# Host CPU between two host_ticks samples: "<% of all cores> <busy ms>".
host_util() {
  echo "$1 $2" | awk -v hz="$HZ" '{b = $3 - $1; i = $4 - $2; printf "%.0f%% %d", (b + i) ? 100 * b / (b + i) : 0, b * 1000 / hz}'
}
proc_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# CPU time of every thread of a process in ns (schedstat: finer than ticks).
proc_cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%.0f", s}'; } # not %d: mawk caps it at 2^31
HZ=$(getconf CLK_TCK)
CONTAINERD_PID=$(cat "${ZATTERA_RIG_RUN:-/run/zattera-rig}/containerd.pid" 2>/dev/null || echo 0)
# CPU ms of the runc shims of namespace $1 (with the runc runs they reaped),
# and of the log shims they started: "<shims ms> <log shims ms>".
shim_ms() {
  local p shims=0 logs=0 t
  for p in /proc/[0-9]*; do
    [ -r "$p/cmdline" ] || continue
    case "$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)" in
      *containerd-shim-runc-v2*"-namespace $1 "*)
        t=$(awk '{print $14 + $15 + $16 + $17}' "$p/stat" 2>/dev/null || echo 0); shims=$((shims + t)) ;;
      *"zattera-log $work/"*)
        [ "$1" = "$NS_AGENT" ] || continue
        t=$(awk '{print $14 + $15}' "$p/stat" 2>/dev/null || echo 0); logs=$((logs + t)) ;;
    esac
  done
  echo "$((shims * 1000 / HZ)) $((logs * 1000 / HZ))"
}

# Number of instances RUNNING or HEALTHY, from the agent's admin socket.
up_count() {
  "$AGENT" --run-dir "$1" status --json 2>/dev/null | grep -cE '"state": "(RUNNING|HEALTHY)"' || true
}

manifest() { # replicas
  cat <<EOF
[app]
name = "bench"
project = "ztbench"

[build]
type = "image"
image = "$IMAGE"

[env.production]
replicas = $1
command = "sleep 100000"
stop_grace = "1s"
EOF
}

# Growth curve point (round 1 of each count): with $1 instances up and the
# start-up settled, the agent's VmRSS, and over GROWTH_SECS its CPU and the
# steady passes it logged (target zattera::pass): CPU per pass and the
# pass's own p50 time.
growth_sample() { # n dir
  local c0 c1 w0 w1 l0 rss
  sleep 3
  l0=$(wc -l <"$2/agent.log")
  c0=$(proc_cpu_ns "$agent_pid")
  w0=$(date +%s%N)
  sleep "$GROWTH_SECS"
  c1=$(proc_cpu_ns "$agent_pid")
  w1=$(date +%s%N)
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$agent_pid/status")
  # All of the agent's CPU in the window (passes, probes, status, DNS), in
  # ms per second of wall time and, divided over the window's passes, per pass.
  tail -n +"$((l0 + 1))" "$2/agent.log" | sed 's/\x1b\[[0-9;]*m//g' | sed -n 's/.*reconcile pass.*elapsed_us=\([0-9]*\).*/\1/p; s/.*elapsed_us=\([0-9]*\).*reconcile pass.*/\1/p' \
    | sort -n | awk -v n="$1" -v rss="$rss" -v c="$((c1 - c0))" -v w="$((w1 - w0))" '
      {v[NR] = $1}
      END {
        p50 = NR ? v[int((NR + 1) / 2)] : 0
        printf "%d %d %d %.2f %.2f %d\n", n, rss, NR, NR ? c / 1e6 / NR : 0, c / 1e6 / (w / 1e9), p50
      }' >>"$work/growth"
}

# 1b: one more instance into a running agent; appends its bring-up phases
# (microseconds, from the agent's log: the last bring-up, as the first
# app's instance is up and stays up) to $work/start-one.
start_one() { # dir
  local deadline line task
  [ ! -e "${PROFILE:-/nonexistent}/assign.txt" ] && trace_start assign
  manifest 1 | sed 's/^name = "bench"/name = "benchx"/' >"$1/manifests/extra.toml"
  deadline=$(($(now_ms) + 30000))
  until [ "$(up_count "$1/run")" -eq 2 ]; do
    [ "$(now_ms)" -gt "$deadline" ] && { echo "bench/executor: the extra instance did not start" >&2; tail -n 20 "$1/agent.log" >&2; exit 1; }
    sleep 0.05
  done
  trace_stop
  line=$(sed 's/\x1b\[[0-9;]*m//g' "$1/agent.log" | grep 'brought up' | tail -1)
  task=$(sed 's/\x1b\[[0-9;]*m//g' "$1/agent.log" | grep 'task started' | tail -1)
  field() { sed -n "s/.*[ ,]$1=\([0-9]*\).*/\1/p" <<<"$2"; }
  echo "$(field total_us "$line") $(field pull_check_us "$line") $(field volumes_us "$line") $(field network_us "$line")" \
    "$(field spec_us "$line") $(field create_us "$line") $(field task_create_us "$task") $(field task_start_us "$task")" >>"$work/start-one"
  rm -f "$1/manifests/extra.toml"
  deadline=$(($(now_ms) + 30000))
  until [ "$(up_count "$1/run")" -eq 1 ]; do
    [ "$(now_ms)" -gt "$deadline" ] && { echo "bench/executor: the extra instance did not go" >&2; exit 1; }
    sleep 0.1
  done
}

# One agent round: spawn, converge, optionally measure idle, converge to
# nothing, stop. Prints the converge time in ms.
agent_round() { # replicas round measure_idle
  local n=$1 dir="$work/agent-$1-$2" t0 t1 up=0 h0 h1 d0 d1 poll=0.1
  [ "$n" -eq 1 ] && poll=0.02
  mkdir -p "$dir/manifests" "$dir/run" "$dir/data"
  manifest "$n" >"$dir/manifests/bench.toml"
  [ "$n" -gt 1 ] && [ "$2" -eq 1 ] && profile_start "agent-$n"
  d0=$(proc_ticks "$CONTAINERD_PID")
  h0=$(host_ticks)
  t0=$(now_ms)
  RUST_LOG=info,zattera::pass=debug,zattera::bringup=debug \
  "$AGENT" --containerd-address "$SOCK" --namespace "$NS_AGENT" --run-dir "$dir/run" --data-dir "$dir/data" \
    run --manifests "$dir/manifests" --bridge-prefix "$PREFIX" --subnet-pool 120-139 "${AGENT_ARGS[@]}" >"$dir/agent.log" 2>&1 &
  agent_pid=$!
  local deadline=$((t0 + 180000))
  while :; do
    up=$(up_count "$dir/run")
    [ "$up" -eq "$n" ] && break
    if [ "$(now_ms)" -gt "$deadline" ] || ! kill -0 "$agent_pid" 2>/dev/null; then
      echo "bench/executor: agent reached $up/$n running; log tail:" >&2
      tail -n 20 "$dir/agent.log" >&2
      exit 1
    fi
    sleep "$poll"
  done
  t1=$(now_ms)
  h1=$(host_ticks)
  d1=$(proc_ticks "$CONTAINERD_PID")
  profile_stop
  echo $((t1 - t0)) >"$dir/converge_ms"
  diag agent "$n" "$2" "$h0" "$h1" $(((d1 - d0) * 1000 / HZ)) "$(shim_ms "$NS_AGENT")" $(($(proc_ticks "$agent_pid") * 1000 / HZ))
  [ "$2" -eq 1 ] && growth_sample "$n" "$dir"
  [ "$n" -eq 1 ] && start_one "$dir"
  if [ "$3" = yes ]; then
    sleep 5 # let the start-up work (first health/status passes) settle
    rss=$(awk '/^VmRSS/ {print $2}' "/proc/$agent_pid/status")
    hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$agent_pid/status")
    threads=$(awk '/^Threads/ {print $2}' "/proc/$agent_pid/status")
    tck=$(getconf CLK_TCK)
    c0=$(awk '{print $14 + $15}' "/proc/$agent_pid/stat")
    w0=$(date +%s%N)
    sleep "$IDLE_SECS"
    c1=$(awk '{print $14 + $15}' "/proc/$agent_pid/stat")
    w1=$(date +%s%N)
    echo "$rss $hwm $threads $(awk -v c=$((c1 - c0)) -v t="$tck" -v w=$((w1 - w0)) 'BEGIN {printf "%.3f", 100 * (c / t) / (w / 1e9)}') $((c1 - c0))" >"$work/idle"
    [ "$(up_count "$dir/run")" -eq "$n" ] || echo "bench/executor: warning: not all $n instances up after the idle minute" >&2
  fi
  # Converge to nothing through the agent itself, then stop it.
  rm -f "$dir/manifests/bench.toml"
  for _ in $(seq 600); do
    [ -z "$(ctr_ -n "$NS_AGENT" containers ls -q)" ] && break
    sleep 0.1
  done
  stop_agent
  [ -n "${KEEP_LOGS:-}" ] && cp "$dir/agent.log" "$KEEP_LOGS/agent-$n-$2.log"
  purge_containers "$NS_AGENT" # in case the agent left any
  nft delete table inet "$NFT_TABLE" 2>/dev/null || true
  for l in /sys/class/net/"$PREFIX"*; do [ -e "$l" ] && ip link del "$(basename "$l")" 2>/dev/null; done
  umount_under "$dir"
  cat "$dir/converge_ms"
}

# The ctr side runs in a private mount namespace (see the header).
cat >"$work/ctr-inner.sh" <<'INNER'
set -euo pipefail
W=$1 N=$2 ROUND=$3
for d in etc opt var; do mkdir -p "$W/ov/$d-up" "$W/ov/$d-work"; done
mkdir -p "$W/ov/rig"
# /var/lib is overlaid for /var/lib/cni; containerd's own root (the rig's)
# is bound back so that ctr's client-side rootfs mounts still see it.
mount --bind "$RIG_DIR" "$W/ov/rig"
mount -t overlay zt-bench-etc -o "lowerdir=/etc,upperdir=$W/ov/etc-up,workdir=$W/ov/etc-work" /etc
mount -t overlay zt-bench-opt -o "lowerdir=/opt,upperdir=$W/ov/opt-up,workdir=$W/ov/opt-work" /opt
mount -t overlay zt-bench-var -o "lowerdir=/var/lib,upperdir=$W/ov/var-up,workdir=$W/ov/var-work" /var/lib
mount --bind "$W/ov/rig" "$RIG_DIR"
mkdir -p /etc/cni/net.d /opt/cni
ln -sfn "$CNI_BIN" /opt/cni/bin
cat >/etc/cni/net.d/10-zt-bench.conflist <<JSON
{"cniVersion": "1.0.0", "name": "zt-bench", "plugins": [{"type": "bridge", "bridge": "$CTR_BRIDGE",
 "isGateway": true, "ipMasq": false,
 "ipam": {"type": "host-local", "ranges": [[{"subnet": "$CTR_SUBNET"}]], "dataDir": "$W/ipam"}}]}
JSON
t0=$(date +%s%N)
for i in $(seq "$N"); do
  ctr --address "$SOCK" -n "$NS_CTR" run -d --cni "$IMAGE" "c$ROUND-$i" /bin/sh -c 'sleep 100000' >/dev/null
done
t1=$(date +%s%N)
echo $(((t1 - t0) / 1000000))
INNER

ctr_round() { # replicas round
  local n=$1 ms ips h0 h1 d0 d1
  rm -rf "$work/ipam"
  [ "$n" -gt 1 ] && [ "$2" -eq 1 ] && profile_start "ctr-$n"
  d0=$(proc_ticks "$CONTAINERD_PID")
  h0=$(host_ticks)
  ms=$(RIG_DIR=$RIG_DIR CNI_BIN=$CNI_BIN CTR_BRIDGE=$CTR_BRIDGE CTR_SUBNET=$CTR_SUBNET SOCK=$SOCK NS_CTR=$NS_CTR IMAGE=$IMAGE \
    unshare -m --propagation private bash "$work/ctr-inner.sh" "$work" "$n" "$2")
  h1=$(host_ticks)
  d1=$(proc_ticks "$CONTAINERD_PID")
  profile_stop
  diag ctr "$n" "$2" "$h0" "$h1" $(((d1 - d0) * 1000 / HZ)) "$(shim_ms "$NS_CTR")" -
  # Every container got an address from the CNI bridge network.
  ips=$(find "$work/ipam/zt-bench" -name '10.201.*' | wc -l)
  [ "$ips" -eq "$n" ] || { echo "bench/executor: ctr --cni gave $ips addresses for $n containers" >&2; exit 1; }
  [ "$(ctr_ -n "$NS_CTR" tasks ls | grep -c RUNNING)" -eq "$n" ] || { echo "bench/executor: not all ctr tasks running" >&2; exit 1; }
  purge_containers "$NS_CTR"
  rm -rf "$work/ov"
  echo "$ms"
}

# One line of the CPU breakdown of a converge.
diag() { # peer n round h0 h1 containerd_ms "shims_ms logshims_ms" agent_ms
  local shims logs
  read -r shims logs <<<"$7"
  read -r pct busy <<<"$(host_util "$4" "$5")"
  printf '   %-6s %4s %5s %8s %10s %11s %10s %10s %9s\n' "$1" "$2" "$3" "$pct" "$busy" "$6" "$shims" \
    "$([ "$1" = agent ] && echo "$logs" || echo -)" "$8" >>"$work/diag"
}

median() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }

: >"$work/growth"
: >"$work/curves"
: >"$work/start-one"
echo "== cold converge, image present; $ROUNDS rounds per count, peers alternating"
for n in $COUNTS; do
  : >"$work/a-$n"
  : >"$work/c-$n"
  for r in $(seq "$ROUNDS"); do
    idle=no
    [ "$n" -eq 50 ] && [ "$r" -eq 1 ] && idle=yes
    if [ $((r % 2)) -eq 1 ]; then
      a=$(agent_round "$n" "$r" "$idle"); c=$(ctr_round "$n" "$r")
    else
      c=$(ctr_round "$n" "$r"); a=$(agent_round "$n" "$r" "$idle")
    fi
    echo "$a" >>"$work/a-$n"
    echo "$c" >>"$work/c-$n"
    echo "   $n replicas, round $r: agent $a ms, ctr run -d --cni x$n $c ms"
  done
done
ip link del "$CTR_BRIDGE" 2>/dev/null || true

echo
printf '%-9s %16s %16s %8s %s\n' replicas "agent p50 ms" "ctr --cni p50 ms" ratio goal
for n in $COUNTS; do
  a=$(median <"$work/a-$n")
  c=$(median <"$work/c-$n")
  awk -v n="$n" -v a="$a" -v c="$c" 'BEGIN {
    r = a / c
    g = (n == 50) ? ((r <= 0.4) ? "met (<= 0.4)" : "MISSED (<= 0.4)") : "-"
    printf "%-9s %16d %16d %8.2f %s\n", n, a, c, r, g
  }'
done
echo
echo "growth (round 1 of each count, ${GROWTH_SECS}s window after start-up settled):"
printf '   %9s %10s %7s %16s %14s %14s\n' instances "RSS KiB" passes "CPU ms per pass" "CPU ms per s" "pass p50 us"
while read -r n rss passes cpp cps p50; do
  printf '   %9s %10s %7s %16s %14s %14s\n' "$n" "$rss" "$passes" "$cpp" "$cps" "$p50"
  echo "CURVE agent_rss_kib $n $rss KiB" >>"$work/curves"
  echo "CURVE agent_cpu_ms_per_pass $n $cpp ms" >>"$work/curves"
  echo "CURVE agent_cpu_ms_per_s $n $cps ms" >>"$work/curves"
  echo "CURVE pass_p50_us $n $p50 us" >>"$work/curves"
done <"$work/growth"
for n in $COUNTS; do
  a=$(median <"$work/a-$n"); c=$(median <"$work/c-$n")
  echo "CURVE converge_ms $n $a ms" >>"$work/curves"
  echo "CURVE converge_ms_ctr $n $c ms" >>"$work/curves"
  awk -v n="$n" -v a="$a" -v c="$c" 'BEGIN {
    r = a / c; goal = (n == 50) ? "<= 0.4" : "-"
    v = (n == 50) ? ((r <= 0.4) ? "met" : "MISSED") : "-"
    printf "ROW executor | cold converge of %d replicas, ms | %d | ctr run -d --cni, sequential | %d | %.2f | %s | %s\n", n, a, c, r, goal, v
  }'
done
if [ -s "$work/start-one" ] && [ -s "$work/c-1" ]; then
  echo
  echo "assignment to RUNNING of one more instance, agent and bridge up (the agent's log; ms, median of $(wc -l <"$work/start-one") rounds):"
  col() { awk -v c="$1" '{print $c}' "$work/start-one" | median; }
  total=$(col 1)
  awk -v t="$total" -v p="$(col 2)" -v v="$(col 3)" -v n="$(col 4)" -v s="$(col 5)" -v c="$(col 6)" -v tc="$(col 7)" -v ts="$(col 8)" 'BEGIN {
    printf "   total %.1f = pull check %.1f + volumes %.1f + netns and veth %.1f + spec %.1f + snapshot and record %.1f", t/1000, p/1000, v/1000, n/1000, s/1000, c/1000
    printf " + task create (shim, runc create, log shim) %.1f + runc start %.1f (medians of each; they need not add up)\n", tc/1000, ts/1000
  }'
  c1=$(median <"$work/c-1")
  awk -v a="$total" -v c="$c1" 'BEGIN {
    r = a / 1000 / c
    printf "ROW executor | assignment to RUNNING, one container, p50 ms | %.1f | ctr run -d --cni | %d | %.2f | <= 0.6 | %s\n", a / 1000, c, r, (r <= 0.6) ? "met" : "MISSED"
  }'
fi
cat "$work/curves"
echo
echo "CPU during each converge (ms of CPU time; host = all $(nproc) cores busy, from /proc/stat):"
printf '   %-6s %4s %5s %8s %10s %11s %10s %10s %9s\n' peer n round host% host_ms containerd runc-shims log-shims agent
cat "$work/diag"
if [ -s "$work/idle" ]; then
  read -r rss hwm threads cpu ticks <"$work/idle"
  echo
  awk -v r="$rss" -v h="$hwm" -v t="$threads" 'BEGIN {
    printf "agent VmRSS with 50 instances: %.1f MiB (peak VmHWM %.1f MiB, %d threads)  goal <= 30 MiB: %s\n",
      r / 1024, h / 1024, t, (r / 1024 <= 30) ? "met" : "MISSED"
  }'
  awk -v c="$cpu" -v k="$ticks" -v s="$IDLE_SECS" 'BEGIN {
    printf "agent CPU idle over %d s with 50 instances: %.2f %% of a core (%d ticks)  goal <= 1 %%: %s\n",
      s, c, k, (c <= 1.0) ? "met" : "MISSED"
  }'
fi

#!/usr/bin/env bash
# Density (issue 47): what each instance costs the node beyond its own
# processes, as deployed, against sequential `ctr run -d --cni` containers
# measured in the same run.
#
# For each count in COUNTS (default 1 10 50 100 200): the release agent
# (`zattera-agent run --manifests DIR`, real bridges, DNS, log shims) brings
# up that many replicas of a sleeping busybox; once all are RUNNING and
# SETTLE seconds have passed, the node's memory is read per group from
# /proc/<pid>/smaps_rollup (PSS: shared pages divided among their users,
# so N shims do not count their common code N times; RSS beside it):
#   agent       the agent process
#   containerd  its growth over the same daemon with nothing of ours running
#   shims       every containerd-shim-runc-v2 of the run's namespace
#   log shims   every `zattera-log` process of the run (the agent only)
# and the same groups' CPU over WINDOW seconds of steady state. The agent
# counts by its growth over itself with nothing to run (`agent-idle`). The peer is
# the same count of `ctr run -d --cni` containers (CNI bridge + host-local,
# in a private mount namespace as bench/executor does; no log shim: ctr
# keeps no output). The container processes themselves (`sleep`) are in
# neither. Goal: node memory per instance (the four groups / N) <= 4 MiB at
# 200 instances.
#
# Everything is ours and removed on exit, also on failure: containerd
# namespaces zt-bench-dn-{agent,ctr}-<pid>, bridges ztdn* (agent, slots
# 120-139 of 10.201.x) and ztdc0 (ctr, 10.201.140.0/24), the agent's nft
# table, temp dirs. Root only; no traffic leaves the host. About 10 minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

COUNTS=${COUNTS:-"1 10 50 100 200"}
SETTLE=${SETTLE:-10}
WINDOW=${WINDOW:-20}
SHIM_EACH=${SHIM_EACH:-yes} # no: skip the rounds with a shim per container
RIG_DIR=${ZATTERA_RIG_DIR:-/var/lib/zattera-rig}
SOCK=${ZATTERA_TEST_CONTAINERD:-/run/zattera-rig/containerd/containerd.sock}
IMAGE=docker.io/zattera/busybox:test
TAG=$$
NS_AGENT=zt-bench-dn-agent-$TAG
NS_CTR=zt-bench-dn-ctr-$TAG
PREFIX=ztdn
CTR_BRIDGE=ztdc0
CTR_SUBNET=10.201.140.0/24
NFT_TABLE=zattera_${NS_AGENT//-/_}
CNI_BIN=/usr/lib/cni

if [ "$(id -u)" != 0 ]; then
  echo "bench/density: must run as root" >&2
  exit 2
fi
[ -x "$CNI_BIN/bridge" ] || {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containernetworking-plugins >/dev/null
}
command -v cargo >/dev/null || export PATH="$HOME/.cargo/bin:$PATH"
bash scripts/rig.sh >/dev/null

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
cargo build --release -q -p zattera-agent --bin zattera-agent
AGENT=$CARGO_TARGET_DIR/release/zattera-agent
CONTAINERD_PID=$(cat "${ZATTERA_RIG_RUN:-/run/zattera-rig}/containerd.pid")
HZ=$(getconf CLK_TCK)

work=$(mktemp -d /tmp/zt-bench-dn.XXXXXX)
agent_pid=
# shellcheck source=bench/lib/peers.sh
. bench/lib/peers.sh
trap cleanup EXIT INT TERM

"$AGENT" --containerd-address "$SOCK" --namespace "$NS_AGENT" image import "$RIG_DIR/images/busybox-oci.tar" >/dev/null
ctr_ -n "$NS_CTR" images import "$RIG_DIR/images/busybox-oci.tar" >/dev/null

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# The pids of one group: agent, containerd, shims (of namespace $2), logs.
pids_of() { # group ns
  case $1 in
    agent) echo "$agent_pid" ;;
    containerd) echo "$CONTAINERD_PID" ;;
    shims | logs)
      local p cmd
      for p in /proc/[0-9]*; do
        cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
        case "$1:$cmd" in
          shims:*containerd-shim-runc-v2*"-namespace $2 "*) echo "${p#/proc/}" ;;
          logs:*"zattera-log $work/"*) echo "${p#/proc/}" ;;
        esac
      done
      ;;
  esac
}
# "<PSS KiB> <RSS KiB>" summed over pids.
memory_of() {
  local pss=0 rss=0 p a b
  for p in "$@"; do
    read -r a b < <(awk '/^Pss:/ {p = $2} /^Rss:/ {r = $2} END {print p + 0, r + 0}' "/proc/$p/smaps_rollup" 2>/dev/null || echo "0 0")
    pss=$((pss + a)); rss=$((rss + b))
  done
  echo "$pss $rss"
}
ticks_of() {
  local t=0 p x
  for p in "$@"; do
    x=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
    t=$((t + x))
  done
  echo "$t"
}

# One measurement with $2 instances of peer $1 up: a line
# "peer n group pss_kib rss_kib cpu_ms_per_s" per group into $work/rows.
measure() { # peer n ns containerd_pss_base containerd_rss_base
  local peer=$1 n=$2 ns=$3 g pids t0 t1 w0 w1 pss rss
  sleep "$SETTLE"
  declare -A before
  for g in agent containerd shims logs; do
    [ "$peer" = ctr ] && { [ "$g" = agent ] || [ "$g" = logs ]; } && continue
    pids=$(pids_of "$g" "$ns" | tr '\n' ' ')
    before[$g]="$(ticks_of $pids)"
  done
  w0=$(now_ms)
  sleep "$WINDOW"
  w1=$(now_ms)
  for g in agent containerd shims logs; do
    [ "$peer" = ctr ] && { [ "$g" = agent ] || [ "$g" = logs ]; } && continue
    pids=$(pids_of "$g" "$ns" | tr '\n' ' ')
    t1=$(ticks_of $pids)
    read -r pss rss <<<"$(memory_of $pids)"
    if [ "$g" = containerd ]; then
      pss=$((pss - $4)); rss=$((rss - $5))
    fi
    awk -v p="$peer" -v n="$n" -v g="$g" -v pss="$pss" -v rss="$rss" -v t=$((t1 - ${before[$g]})) -v hz="$HZ" -v w=$((w1 - w0)) \
      -v count="$(echo "$pids" | wc -w)" 'BEGIN {
        printf "%s %d %s %d %d %.2f %d\n", p, n, g, pss, rss, 1000 * t / hz / (w / 1000), count
      }' >>"$work/rows"
  done
}

up_count() {
  "$AGENT" --run-dir "$1" status --json 2>/dev/null | grep -cE '"state": "(RUNNING|HEALTHY)"' || true
}

manifest() {
  cat <<EOF
[app]
name = "dense"
project = "ztdense"

[build]
type = "image"
image = "$IMAGE"

[env.production]
replicas = $1
command = "sleep 100000"
stop_grace = "1s"
EOF
}

agent_round() { # n peer [run flags...]
  local n=$1 peer=$2 dir="$work/$2-$1" deadline base t0
  shift 2
  mkdir -p "$dir/manifests" "$dir/run" "$dir/data"
  base=$(memory_of "$CONTAINERD_PID")
  "$AGENT" --containerd-address "$SOCK" --namespace "$NS_AGENT" --run-dir "$dir/run" --data-dir "$dir/data" \
    run --manifests "$dir/manifests" --bridge-prefix "$PREFIX" --subnet-pool 120-139 "$@" >"$dir/agent.log" 2>&1 &
  agent_pid=$!
  # The agent with nothing to run: its growth is measured against this.
  sleep 3
  echo "$peer $n agent-idle $(memory_of "$agent_pid") 0 1" >>"$work/rows"
  manifest "$n" >"$dir/manifests/dense.toml"
  t0=$(now_ms)
  deadline=$(($(now_ms) + 600000))
  until [ "$(up_count "$dir/run")" -eq "$n" ]; do
    if [ "$(now_ms)" -gt "$deadline" ] || ! kill -0 "$agent_pid" 2>/dev/null; then
      echo "bench/density: the agent did not bring $n up; log tail:" >&2
      tail -n 20 "$dir/agent.log" >&2
      exit 1
    fi
    sleep 0.5
  done
  # Polled every 0.5 s: a coarse converge time (bench/executor times it).
  echo "$peer $n up_ms $(($(now_ms) - t0))" >>"$work/up"
  measure "$peer" "$n" "$NS_AGENT" $base
  rm -f "$dir/manifests/dense.toml"
  for _ in $(seq 1200); do
    [ -z "$(ctr_ -n "$NS_AGENT" containers ls -q)" ] && break
    sleep 0.1
  done
  stop_agent
  purge_containers "$NS_AGENT"
  nft delete table inet "$NFT_TABLE" 2>/dev/null || true
  for l in /sys/class/net/"$PREFIX"*; do [ -e "$l" ] && ip link del "$(basename "$l")" 2>/dev/null; done
  umount_under "$dir"
}

cat >"$work/ctr-inner.sh" <<'INNER'
set -euo pipefail
W=$1 N=$2
for d in etc opt var; do mkdir -p "$W/ov/$d-up" "$W/ov/$d-work"; done
mkdir -p "$W/ov/rig"
mount --bind "$RIG_DIR" "$W/ov/rig"
mount -t overlay zt-bench-etc -o "lowerdir=/etc,upperdir=$W/ov/etc-up,workdir=$W/ov/etc-work" /etc
mount -t overlay zt-bench-opt -o "lowerdir=/opt,upperdir=$W/ov/opt-up,workdir=$W/ov/opt-work" /opt
mount -t overlay zt-bench-var -o "lowerdir=/var/lib,upperdir=$W/ov/var-up,workdir=$W/ov/var-work" /var/lib
mount --bind "$W/ov/rig" "$RIG_DIR"
mkdir -p /etc/cni/net.d /opt/cni
ln -sfn "$CNI_BIN" /opt/cni/bin
cat >/etc/cni/net.d/10-zt-dense.conflist <<JSON
{"cniVersion": "1.0.0", "name": "zt-dense", "plugins": [{"type": "bridge", "bridge": "$CTR_BRIDGE",
 "isGateway": true, "ipMasq": false,
 "ipam": {"type": "host-local", "ranges": [[{"subnet": "$CTR_SUBNET"}]], "dataDir": "$W/ipam"}}]}
JSON
for i in $(seq "$N"); do
  ctr --address "$SOCK" -n "$NS_CTR" run -d --cni "$IMAGE" "d$i" /bin/sh -c 'sleep 100000' >/dev/null
done
INNER

ctr_round() { # n
  local n=$1 base
  rm -rf "$work/ipam" "$work/ov"
  base=$(memory_of "$CONTAINERD_PID")
  RIG_DIR=$RIG_DIR CNI_BIN=$CNI_BIN CTR_BRIDGE=$CTR_BRIDGE CTR_SUBNET=$CTR_SUBNET SOCK=$SOCK NS_CTR=$NS_CTR IMAGE=$IMAGE \
    unshare -m --propagation private bash "$work/ctr-inner.sh" "$work" "$n"
  [ "$(ctr_ -n "$NS_CTR" tasks ls | grep -c RUNNING)" -eq "$n" ] || { echo "bench/density: not all ctr tasks run" >&2; exit 1; }
  measure ctr "$n" "$NS_CTR" $base
  purge_containers "$NS_CTR"
  ip link del "$CTR_BRIDGE" 2>/dev/null || true
}

: >"$work/rows"
: >"$work/up"
for n in $COUNTS; do
  echo "== $n instances" >&2
  agent_round "$n" agent
  [ "$SHIM_EACH" = no ] || agent_round "$n" agent-1 --shim-group-size 1
  ctr_round "$n"
done

echo "node memory and steady CPU per group (PSS and RSS in MiB; CPU in ms per second; containerd: growth over its idle self)"
printf '%-6s %5s %-11s %6s %9s %9s %9s\n' peer n group procs "PSS MiB" "RSS MiB" "CPU ms/s"
awk '{printf "%-6s %5d %-11s %6d %9.1f %9.1f %9.2f\n", $1, $2, $3, $7, $4 / 1024, $5 / 1024, $6}' "$work/rows"
echo
echo "time from the manifest to all RUNNING (polled every 0.5 s), ms:"
sort -k2,2n -k1,1 "$work/up"
echo
echo "per instance (shims, log shims, and the agent's and containerd's growth, summed and divided by n; PSS, MiB);"
echo "agent: shims shared per environment (the default group size); agent-1: --shim-group-size 1:"
printf '%5s %12s %12s %12s %8s %s\n' n agent agent-1 ctr ratio goal
awk '
  $3 == "agent-idle" {pss[$1" "$2] -= $4; next}
  {pss[$1" "$2] += $4; cpu[$1" "$2] += $6; ns[$2] = 1}
  END {
    for (n in ns) {
      a = pss["agent " n] / 1024 / n; a1 = pss["agent-1 " n] / 1024 / n; c = pss["ctr " n] / 1024 / n
      each = (("agent-1 " n) in cpu) ? sprintf("%.2f", a1) : "-"
      goal = (n == 200) ? ((a <= 4) ? "met (<= 4 MiB)" : "MISSED (<= 4 MiB)") : "-"
      printf "%5d %12.2f %12s %12.2f %8.2f %s\n", n, a, each, c, c ? a / c : 0, goal
      printf "CURVE node_pss_mib_per_instance %d %.2f MiB\n", n, a > "/dev/stderr"
      if (each != "-") printf "CURVE node_pss_mib_per_instance_shim_each %d %.2f MiB\n", n, a1 > "/dev/stderr"
      printf "CURVE node_pss_mib_per_instance_ctr %d %.2f MiB\n", n, c > "/dev/stderr"
      printf "CURVE node_cpu_ms_per_s %d %.2f ms\n", n, cpu["agent " n] > "/dev/stderr"
      if (n == 200) printf "ROW density | node memory per instance at 200 (PSS), MiB | %.2f | ctr run -d --cni | %.2f | %.2f | <= 4 MiB | %s\n", a, c, c ? a / c : 0, (a <= 4) ? "met" : "MISSED" > "/dev/stderr"
    }
  }' "$work/rows" 2>&1 | sort -n -k1,1

#!/usr/bin/env bash
# Metrics benchmark (issue 17): the time and the agent CPU of one /metrics
# scrape with 100 instances running. The packaged (release) agent binary,
# standalone, against the rig's containerd, 100 replicas of a sleeper on one
# bridge it makes; SCRAPES (default 50) scrapes by curl from loopback after
# the sampler's first round. CPU per scrape is the agent's utime+stime over
# the scrapes less the same wall time idle, divided by the count.
#
# Ours and removed on exit, also on failure: containerd namespace
# zt-bench-metrics-<pid>, bridge prefix ztbm (slot 236 of 10.201.x), the
# agent's nft table, temp dirs. Root; no traffic leaves the host; bounded
# (bring-up waits at most 5 minutes). Results: bench/metrics/results/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

INSTANCES=${INSTANCES:-100}
SCRAPES=${SCRAPES:-50}
SOCK=${ZATTERA_TEST_CONTAINERD:-/run/zattera-rig/containerd/containerd.sock}
IMAGES=${ZATTERA_RIG_DIR:-/var/lib/zattera-rig}/images
NS=zt-bench-metrics-$$
PORT=${PORT:-19464}

if [ "$(id -u)" != 0 ]; then
  echo "bench/metrics: run as root (bridges, nft, containerd)" >&2
  exit 2
fi
[ -S "$SOCK" ] || eval "$(scripts/rig.sh)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
cargo build --release -q --bin zattera-agent
AGENT=$CARGO_TARGET_DIR/release/zattera-agent

# shellcheck source=bench/standalone.sh
. bench/standalone.sh
work=$(mktemp -d /tmp/ztbm.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi
  remove_standalone "$NS" ztbm "$work"
}
trap cleanup EXIT

g=(--config /dev/null --containerd-address "$SOCK" --namespace "$NS" --data-dir "$work/data" --run-dir "$work/run")
"$AGENT" "${g[@]}" image import "$IMAGES/busybox-oci.tar" >/dev/null
mkdir -p "$work/manifests"
cat > "$work/manifests/sleep.toml" <<TOML
[app]
name = "sleep"
project = "bench"
[build]
type = "image"
image = "docker.io/zattera/busybox:test"
[env.prod]
command = "sleep 1000000"
replicas = $INSTANCES
TOML
"$AGENT" "${g[@]}" run --manifests "$work/manifests" --bridge-prefix ztbm --subnet-pool 236-236 \
  --metrics-listen "127.0.0.1:$PORT" --host-shutdown-check none 2>"$work/agent.log" &
pid=$!
deadline=$((SECONDS + 300))
until [ "$("$AGENT" "${g[@]}" status --json 2>/dev/null \
        | python3 -c 'import json,sys; print(sum(a["state"] in ("RUNNING","HEALTHY") for a in json.load(sys.stdin)["assignments"]))' 2>/dev/null)" = "$INSTANCES" ]; do
  if [ $SECONDS -gt $deadline ]; then echo "bench/metrics: $INSTANCES instances not up in 5 minutes" >&2; tail "$work/agent.log" >&2; exit 1; fi
  sleep 2
done
sleep 20   # the sampler's next round: per-instance series exist

cpu() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
hz=$(getconf CLK_TCK)
times=$work/times
t0=$SECONDS
c0=$(cpu)
for _ in $(seq "$SCRAPES"); do
  curl -s -o "$work/scrape" -w '%{time_total}\n' "http://127.0.0.1:$PORT/metrics" >> "$times"
done
c1=$(cpu)
wall=$((SECONDS - t0 + 1))
sleep "$wall"
c2=$(cpu)
python3 - "$times" "$work/scrape" "$c0" "$c1" "$c2" "$hz" "$SCRAPES" "$INSTANCES" <<'PY' | tee "$work/result.json"
import json, sys
times = sorted(float(x) * 1000 for x in open(sys.argv[1]))
text = open(sys.argv[2]).read()
c0, c1, c2, hz, n, inst = (float(v) for v in sys.argv[3:9])
busy = (c1 - c0) / hz * 1000
idle = (c2 - c1) / hz * 1000
print(json.dumps({
    "instances": int(inst), "scrapes": int(n),
    "scrape_ms_p50": round(times[len(times) // 2], 2),
    "scrape_ms_p99": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
    "agent_cpu_ms_per_scrape": round(max(busy - idle, 0) / n, 2),
    "bytes_per_scrape": len(text),
    "series": sum(1 for l in text.splitlines() if l and not l.startswith("#")),
}, indent=1))
PY
mkdir -p bench/metrics/results
cp "$work/result.json" "bench/metrics/results/$(date -u +%Y-%m-%dT%H%M).json"

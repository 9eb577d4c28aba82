#!/usr/bin/env bash
# The standalone demo: sets up containerd, builds the agent, imports the demo
# image and runs the agent on examples/: two web replicas (HTTP health check,
# port 8080 on 127.0.0.1) and a client that finds them as web.internal.
# As root, from a clone of the repository. Run it again to restart the agent;
# the containers it already runs are adopted, not restarted.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

eval "$(ZATTERA_RIG_S3=0 scripts/rig.sh)" # the demo needs no S3 server
. scripts/need-cargo.sh

echo "== building zattera-agent and zattera-netns"
cargo build --workspace --bins
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
agent="$target_dir/debug/zattera-agent"
netns="$target_dir/debug/zattera-netns"
# Another namespace lets a second demo run beside this one (its cgroups are
# /zattera/<namespace>): scripts/fresh-check.sh does that.
ns=${ZATTERA_DEMO_NAMESPACE:-zattera-demo}
run=/run/$ns
data=/var/lib/$ns
sock="$ZATTERA_TEST_CONTAINERD"
common=(--containerd-address "$sock" --namespace "$ns" --run-dir "$run" --data-dir "$data")
mkdir -p "$run" "$data"

echo "== importing the demo image into containerd namespace '$ns'"
"$agent" "${common[@]}" image import "$ZATTERA_TEST_IMAGES/busybox-oci.tar"

if [ -s "$run/demo.pid" ] && kill -0 "$(cat "$run/demo.pid")" 2>/dev/null; then
  echo "== stopping the previous demo agent (its containers keep running)"
  kill "$(cat "$run/demo.pid")"
  sleep 1
fi

echo "== starting the agent on examples/ (log: $data/agent.log)"
setsid nohup "$agent" "${common[@]}" run --manifests "$PWD/examples" --subnet-pool 100-119 \
  >>"$data/agent.log" 2>&1 < /dev/null &
echo $! > "$run/demo.pid"

echo "== waiting for every instance to be HEALTHY"
healthy=no
for _ in $(seq 1 90); do
  if "$agent" --run-dir "$run" status --json 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)
a = s["assignments"]
sys.exit(0 if len(a) == 3 and all(x["state"] == "HEALTHY" for x in a) else 1)' 2>/dev/null; then
    healthy=yes
    break
  fi
  sleep 1
done
"$agent" --run-dir "$run" status
if [ "$healthy" != yes ]; then
  echo "demo: not everything became HEALTHY within 90 s; see $data/agent.log" >&2
  tail -n 20 "$data/agent.log" >&2
  exit 1
fi

echo "== the published port, from the host"
curl -fsS http://127.0.0.1:8080/whoami.txt

echo "== the client reaching web.internal through its gateway's DNS"
client_log=$(ls "$data"/logs/demo-client-production-0-*.log | head -n 1)
for _ in $(seq 1 15); do
  grep -q 'served by' "$client_log" && break
  sleep 1
done
grep -E 'Name:|Address: 10\.201\.[0-9]+\.[0-9]+$|served by' "$client_log" | tail -n 4

cat <<NEXT

The agent keeps running (pid $(cat "$run/demo.pid")). Try:
  $agent --run-dir $run status            # or: status --json
  curl http://127.0.0.1:8080/whoami.txt
  $netns ls                                # bridges, namespaces, published ports
  tail -f $client_log                      # CRI-format container log
  \$EDITOR examples/web.toml               # e.g. replicas = 3: converges without a restart
  kill \$(cat $run/demo.pid)                # stop the agent; containers keep running
NEXT

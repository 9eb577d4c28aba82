#!/usr/bin/env bash
# bench/build: the same Dockerfile (a COPY of 50 MiB of files and a RUN)
# built by the agent's pipeline (`zattera-agent build`, the real binary as
# an operator runs it: context copied into its scratch, the build, the
# image loaded into containerd, ready to deploy) and by `buildah bud`
# directly, in the same run, cold (empty storage) and with the layer cache.
# Ratio = agent / buildah (goal <= 1.05). With BUILDKITD=/path/to/buildkitd
# (buildctl beside it) the same for BuildKit: the agent's native client
# against `buildctl build` on the same daemon, the agent's own, `FROM` a
# loopback registry. Then builds as control runs them (benches/build_api.rs):
# RunBuild through the node API of a running agent against the same CLIs.
# Results: bench/build/results/.
#
# As root, with the rig up (scripts/rig.sh) and buildah installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RUNS=${RUNS:-5}
SOCK=${ZATTERA_TEST_CONTAINERD:-/run/zattera-rig/containerd/containerd.sock}
NS=zt-bench-build
work=$(mktemp -d /var/tmp/zt-bench-build.XXXX)
cleanup() {
  [ -f "$work/rundir/buildkit/buildkitd.pid" ] && kill "$(cat "$work/rundir/buildkit/buildkitd.pid")" 2>/dev/null
  [ -n "${registry_pid:-}" ] && kill "$registry_pid" 2>/dev/null
  sleep 1
  rm -rf "$work"
}
trap cleanup EXIT
need=()
for p in hyperfine buildah skopeo docker-registry; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
cargo build --release --locked --bin zattera-agent >&2
agent=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/zattera-agent

# The base: the rig's busybox, through buildah's own oci-archive transport.
ctx=$work/ctx
mkdir -p "$ctx/files"
for i in $(seq 1 50); do head -c 1048576 /dev/urandom > "$ctx/files/f$i.bin"; done
cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM oci-archive:/var/lib/zattera-rig/images/busybox-oci.tar
COPY files /data
RUN find /data -type f | wc -l > /count && sha256sum /data/f1.bin > /sum
DOCKERFILE

store=$work/buildah
bud() { buildah --root "$store/root" --runroot "$store/run" --storage-driver overlay \
  bud --isolation oci --runtime runc --network host --layers -t localhost/bench/app:1 "$ctx" >/dev/null 2>&1; }
# The same end to end by hand: bud, export, containerd's own import.
bud_load() { bud && buildah --root "$store/root" --runroot "$store/run" --storage-driver overlay \
  push --disable-compression localhost/bench/app:1 "oci-archive:$work/by-hand.tar:zattera.local/bench/hand:1" >/dev/null 2>&1 &&
  ctr -a "$SOCK" -n "$NS" images import "$work/by-hand.tar" >/dev/null 2>&1; }
agent_build() { "$agent" --containerd-address "$SOCK" --namespace "$NS" --data-dir "$work/data" \
  --run-dir "$work/rundir" build "$ctx" -t zattera.local/bench/app:1 >/dev/null 2>&1; }
export -f bud bud_load agent_build
export store ctx agent SOCK NS work

out=bench/build/results/$(date -u +%Y-%m-%dT%H%M).json
mkdir -p bench/build/results
hyperfine -S bash --runs "$RUNS" --export-json "$work/cold.json" \
  --prepare "rm -rf $store $work/data/buildah" \
  -n buildah-cold 'bud' -n buildah-load-cold 'bud_load' -n agent-cold 'agent_build' >&2
hyperfine -S bash --runs "$RUNS" --warmup 1 --export-json "$work/warm.json" \
  -n buildah-cached 'bud' -n buildah-load-cached 'bud_load' -n agent-cached 'agent_build' >&2
files=("$work/cold.json" "$work/warm.json")
if [ -n "${BUILDKITD:-}" ]; then
  buildctl=$(dirname "$BUILDKITD")/buildctl
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  printf 'version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
    "$work/registry" "$port" > "$work/registry.yml"
  docker-registry serve "$work/registry.yml" >/dev/null 2>&1 & registry_pid=$!
  sleep 1
  skopeo copy -q --dest-tls-verify=false oci-archive:/var/lib/zattera-rig/images/busybox-oci.tar \
    "docker://127.0.0.1:$port/base/busybox:1"
  bkctx=$work/bkctx
  cp -r "$ctx" "$bkctx"
  sed -i "1s|.*|FROM 127.0.0.1:$port/base/busybox:1|" "$bkctx/Dockerfile"
  printf 'build-backend = "buildkit"\nbuildkitd-binary = "%s"\n' "$BUILDKITD" > "$work/agent.toml"
  bk_agent() { "$agent" --config "$work/agent.toml" --containerd-address "$SOCK" --namespace "$NS" \
    --data-dir "$work/data" --run-dir "$work/rundir" build "$bkctx" -t zattera.local/bench/bk:1 >/dev/null 2>&1; }
  bk_ctl() { "$buildctl" --addr "unix://$work/rundir/buildkit/buildkitd.sock" build --frontend dockerfile.v0 \
    --local context="$bkctx" --local dockerfile="$bkctx" \
    --output type=image,name=zattera.local/bench/bkctl:1,push=false,unpack=true >/dev/null 2>&1; }
  bk_prune() { "$buildctl" --addr "unix://$work/rundir/buildkit/buildkitd.sock" prune --all >/dev/null 2>&1; }
  export -f bk_agent bk_ctl bk_prune
  export bkctx buildctl
  bk_agent # starts the agent's buildkitd
  hyperfine -S bash --runs "$RUNS" --export-json "$work/bkcold.json" --prepare 'bk_prune' \
    -n buildctl-cold 'bk_ctl' -n agent-bk-cold 'bk_agent' >&2
  hyperfine -S bash --runs "$RUNS" --warmup 1 --export-json "$work/bkwarm.json" \
    -n buildctl-cached 'bk_ctl' -n agent-bk-cached 'bk_agent' >&2
  files+=("$work/bkcold.json" "$work/bkwarm.json")
fi
python3 - "$out" "${files[@]}" <<'PY'
import json, sys
res = {}
for f in sys.argv[2:]:
    for r in json.load(open(f))["results"]:
        res[r["command"]] = {"median_s": r["median"], "mean_s": r["mean"], "stddev_s": r["stddev"]}
doc = {"results": res, "goal": 1.05}
for agent, peer, key in [("agent-cold", "buildah-cold", "buildah_cold"), ("agent-cached", "buildah-cached", "buildah_cached"),
                         ("agent-cold", "buildah-load-cold", "buildah_load_cold"), ("agent-cached", "buildah-load-cached", "buildah_load_cached"),
                         ("agent-bk-cold", "buildctl-cold", "buildkit_cold"), ("agent-bk-cached", "buildctl-cached", "buildkit_cached")]:
    if agent in res and peer in res:
        doc["ratio_" + key] = res[agent]["median_s"] / res[peer]["median_s"]
json.dump(doc, open(sys.argv[1], "w"), indent=2)
print(json.dumps(doc, indent=2))
PY

# Builds as control runs them: RunBuild through a running agent's node API.
echo "== RunBuild through the node API (benches/build_api.rs)" >&2
api_out=bench/build/results/$(date -u +%Y-%m-%dT%H%M)-api.txt
ZATTERA_TEST_AGENT_BIN=$agent BUILDKITD=${BUILDKITD:-} RUNS=$RUNS \
  cargo bench -q --locked -p zattera-agent --bench build_api 2>/dev/null | tee "$api_out"

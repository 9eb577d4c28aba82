#!/usr/bin/env bash
# bench/build: the same Dockerfile (a COPY of 50 MiB of files and a RUN)
# built by the agent's pipeline (`zattera-agent build`, the real binary as
# an operator runs it: context copied into its scratch, the build, the
# image loaded into containerd, ready to deploy) and by `buildah bud`
# directly, in the same run, cold (empty storage) and with the layer cache.
# Ratio = agent / buildah (goal <= 1.05). Results: bench/build/results/.
#
# As root, with the rig up (scripts/rig.sh) and buildah installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RUNS=${RUNS:-5}
SOCK=${ZATTERA_TEST_CONTAINERD:-/run/zattera-rig/containerd/containerd.sock}
NS=zt-bench-build
work=$(mktemp -d /var/tmp/zt-bench-build.XXXX)
trap 'rm -rf "$work"; ctr -a "$SOCK" -n "$NS" images rm zattera.local/bench/app:1 >/dev/null 2>&1 || true' EXIT
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
  bud --isolation oci --network host --layers -t localhost/bench/app:1 "$ctx" >/dev/null 2>&1; }
agent_build() { "$agent" --containerd-address "$SOCK" --namespace "$NS" --data-dir "$work/data" \
  --run-dir "$work/rundir" build "$ctx" -t zattera.local/bench/app:1 >/dev/null 2>&1; }
export -f bud agent_build
export store ctx agent SOCK NS work

out=bench/build/results/$(date -u +%Y-%m-%dT%H%M).json
mkdir -p bench/build/results
hyperfine --runs "$RUNS" --export-json "$work/cold.json" \
  --prepare "rm -rf $store $work/data/buildah" \
  -n buildah-cold 'bash -c bud' -n agent-cold 'bash -c agent_build' >&2
hyperfine --runs "$RUNS" --warmup 1 --export-json "$work/warm.json" \
  -n buildah-cached 'bash -c bud' -n agent-cached 'bash -c agent_build' >&2
python3 - "$work/cold.json" "$work/warm.json" "$out" <<'PY'
import json, sys
res = {}
for f in sys.argv[1:3]:
    for r in json.load(open(f))["results"]:
        res[r["command"]] = {"median_s": r["median"], "mean_s": r["mean"], "stddev_s": r["stddev"]}
ratio = lambda kind: res[f"agent-{kind}"]["median_s"] / res[f"buildah-{kind}"]["median_s"]
doc = {"results": res, "ratio_cold": ratio("cold"), "ratio_cached": ratio("cached"), "goal": 1.05}
json.dump(doc, open(sys.argv[3], "w"), indent=2)
print(json.dumps(doc, indent=2))
PY

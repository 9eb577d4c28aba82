#!/usr/bin/env bash
# Runtime benchmarks (issue 3), against the rig's containerd, each peer
# measured in the same run, interleaved round by round:
#
#  1. create-to-running of one container: the agent's library path
#     (get_local + containers::create + containers::start with the log shim)
#     vs `ctr run -d`, same busybox test image, and vs the floor: bare
#     `runc run -d` of the agent's own spec on the image unpacked into a
#     directory; ROUNDS rounds (default 20); the Rust bench target
#     benches/runtime.rs.
#  2. pull + unpack of a ~100 MiB image (busybox + 5 layers of 20 MiB random
#     data, gzip) from a local docker-registry on 127.0.0.1:
#     `zattera-agent image pull` vs `ctr image pull --plain-http` (which
#     unpacks), PULL_ROUNDS rounds (default 4), each into a fresh containerd
#     namespace; both start cold: the image's blobs are checked to be absent
#     from containerd's content store (all namespaces share it) before every
#     pull, and removed (image rm --sync, GC) after it.
#
# Root only. Traffic stays on 127.0.0.1. Everything it makes (namespaces
# zt-bench-*-<pid>, the registry, temp files) is removed on exit, also on
# failure. About 3 minutes after the build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ROUNDS=${ROUNDS:-20}
PULL_ROUNDS=${PULL_ROUNDS:-5}
RIG_DIR=${ZATTERA_RIG_DIR:-/var/lib/zattera-rig}
SOCK=${ZATTERA_TEST_CONTAINERD:-/run/zattera-rig/containerd/containerd.sock}
BLOBS="$RIG_DIR/containerd/io.containerd.content.v1.content/blobs/sha256"
TAG=$$

if [ "$(id -u)" != 0 ]; then
  echo "bench/runtime: must run as root" >&2
  exit 2
fi
need=()
for p in docker-registry skopeo python3 curl; do
  command -v "$p" >/dev/null || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null || export PATH="$HOME/.cargo/bin:$PATH"
bash scripts/rig.sh >/dev/null # idempotent: containerd on $SOCK, test images

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
cargo build --release -q -p zattera-agent --bin zattera-agent
AGENT=$CARGO_TARGET_DIR/release/zattera-agent

work=$(mktemp -d /tmp/zt-bench-rt.XXXXXX)
reg_pid=
ctr_() { ctr --address "$SOCK" "$@"; }
cleanup() {
  set +e
  [ -n "$reg_pid" ] && kill "$reg_pid" 2>/dev/null && wait "$reg_pid" 2>/dev/null
  for ns in $(ctr_ namespaces ls -q 2>/dev/null | grep -E "^zt-bench-pull-(agent|ctr)-$TAG-"); do
    for img in $(ctr_ -n "$ns" images ls -q); do ctr_ -n "$ns" images rm --sync "$img" >/dev/null; done
    for l in $(ctr_ -n "$ns" leases ls -q); do ctr_ -n "$ns" leases rm --sync "$l" >/dev/null; done
    ctr_ namespaces rm "$ns" >/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# PROFILE=DIR: the first pull of each tool runs under perf
# (bench/lib/profile.sh), and DIR gets the agent's pull timeline.
# shellcheck source=bench/lib/profile.sh
. bench/lib/profile.sh

median() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
p90() { sort -n | awk '{v[NR]=$1} END {i=int(NR*0.9+0.999); if (i<1) i=1; print v[i]}'; }

# ---- 1. create-to-running -----------------------------------------------------
# ROUNDS=0 skips it (the pull alone).
: >"$work/create.out"
if [ "$ROUNDS" -gt 0 ]; then
  echo "== 1. create-to-running (cargo bench --bench runtime, ROUNDS=$ROUNDS)"
  ROUNDS=$ROUNDS ZATTERA_TEST_CONTAINERD=$SOCK ZATTERA_TEST_IMAGES=$RIG_DIR/images timeout 600 \
    cargo bench -q -p zattera-agent --bench runtime 2>&1 | tee "$work/create.out" | grep -v '^RESULT'
fi
create_r50=$(sed -n 's/^RESULT create_p50_ratio=\([0-9.]*\).*/\1/p' "$work/create.out")
create_r90=$(sed -n 's/.*create_p90_ratio=\([0-9.]*\).*/\1/p' "$work/create.out")

# ---- 2. pull + unpack ---------------------------------------------------------
echo "== 2. pull + unpack of a ~100 MiB, 6-layer image from docker-registry on 127.0.0.1 ($PULL_ROUNDS rounds each)"
python3 bench/runtime/mkbig.py "$RIG_DIR/images/busybox-oci.tar" "$work/big.tar"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$work/registry.yml" <<EOF
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: $work/registry
http:
  addr: 127.0.0.1:$port
EOF
docker-registry serve "$work/registry.yml" >"$work/registry.log" 2>&1 &
reg_pid=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/v2/" >/dev/null && break; sleep 0.1; done
REF=127.0.0.1:$port/zt-bench/big:v1
skopeo copy --quiet --insecure-policy --dest-tls-verify=false "oci-archive:$work/big.tar:big" "docker://$REF"
# The layer digests: absent from the content store before every pull.
mapfile -t DIGESTS < <(curl -sf -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
  "http://127.0.0.1:$port/v2/zt-bench/big/manifests/v1" |
  python3 -c 'import json,sys; m=json.load(sys.stdin); [print(l["digest"].split(":")[1]) for l in m["layers"]+[m["config"]]]')
[ ${#DIGESTS[@]} -eq 7 ] || { echo "bench/runtime: unexpected manifest (${#DIGESTS[@]} blobs)" >&2; exit 1; }

assert_cold() { # namespace
  local d
  for d in "${DIGESTS[@]}"; do
    if [ -e "$BLOBS/$d" ]; then echo "bench/runtime: blob $d still in the content store" >&2; exit 1; fi
  done
  [ -z "$(ctr_ -n "$1" content ls -q)" ] || { echo "bench/runtime: $1 has content" >&2; exit 1; }
}
purge() { # namespace
  ctr_ -n "$1" images rm --sync "$REF" >/dev/null 2>&1 || true
  for l in $(ctr_ -n "$1" leases ls -q); do ctr_ -n "$1" leases rm --sync "$l" >/dev/null; done
  for _ in $(seq 50); do
    [ -z "$(ctr_ -n "$1" snapshots ls | tail -n +2)" ] && [ -z "$(ctr_ -n "$1" content ls -q)" ] && break
    sleep 0.1
  done
  ctr_ namespaces rm "$1" >/dev/null
}
pull_once() { # tool round -> prints ms
  local ns="zt-bench-pull-$1-$TAG-$2" t0 t1 snaps
  assert_cold "$ns"
  [ "$2" -eq 1 ] && profile_start "pull-$1"
  t0=$(date +%s%N)
  if [ "$1" = agent ]; then
    RUST_LOG=warn,zattera::pull=debug "$AGENT" --containerd-address "$SOCK" --namespace "$ns" image pull "$REF" >"$work/pull.log" 2>&1
  else
    ctr_ -n "$ns" images pull --plain-http "$REF" >"$work/pull.log" 2>&1
  fi || { echo "bench/runtime: $1 pull failed: $(tail -3 "$work/pull.log")" >&2; exit 1; }
  t1=$(date +%s%N)
  profile_stop
  [ -n "${PROFILE:-}" ] && [ "$2" -eq 1 ] && [ "$1" = agent ] && sed 's/\x1b\[[0-9;]*m//g' "$work/pull.log" >"$PROFILE/pull-agent-timeline.txt"
  snaps=$(ctr_ -n "$ns" snapshots ls | tail -n +2 | grep -c Committed || true)
  [ "$snaps" -eq 6 ] || { echo "bench/runtime: $1 left $snaps committed snapshots, want 6 (unpacked)" >&2; exit 1; }
  purge "$ns"
  echo $(((t1 - t0) / 1000000))
}
: >"$work/pull-agent"
: >"$work/pull-ctr"
for r in $(seq "$PULL_ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="agent ctr"; else order="ctr agent"; fi
  for tool in $order; do
    ms=$(pull_once "$tool" "$r")
    echo "$ms" >>"$work/pull-$tool"
    echo "   round $r $tool: $ms ms"
  done
done
assert_cold "zt-bench-pull-after-$TAG"
printf '%-34s %9s %9s %9s\n' "" "p50 ms" "p90 ms" "max ms"
for tool in agent ctr; do
  printf '%-34s %9s %9s %9s\n' "$([ $tool = agent ] && echo 'zattera-agent image pull' || echo 'ctr image pull --plain-http')" \
    "$(median <"$work/pull-$tool")" "$(p90 <"$work/pull-$tool")" "$(sort -n "$work/pull-$tool" | tail -1)"
done
pull_r50=$(awk -v a="$(median <"$work/pull-agent")" -v c="$(median <"$work/pull-ctr")" 'BEGIN {printf "%.3f", a / c}')
pull_r90=$(awk -v a="$(p90 <"$work/pull-agent")" -v c="$(p90 <"$work/pull-ctr")" 'BEGIN {printf "%.3f", a / c}')

echo
echo "== summary (ratio agent / ctr in this run; goal <= 1.0)"
printf '%-28s %8s %8s %s\n' benchmark "p50" "p90" goal
printf '%-28s %8s %8s %s\n' create-to-running "${create_r50:-n/a}" "${create_r90:-n/a}" \
  "$(awk -v r="${create_r50:-9}" 'BEGIN {print (r <= 1.0) ? "met" : "MISSED"}')"
printf '%-28s %8s %8s %s\n' "pull+unpack ~100 MiB" "$pull_r50" "$pull_r90" \
  "$(awk -v r="$pull_r50" 'BEGIN {print (r <= 1.0) ? "met" : "MISSED"}')"
create_a=$(sed -n 's/^RESULT .*agent_p50_ms=\([0-9.]*\).*/\1/p' "$work/create.out")
create_c=$(sed -n 's/^RESULT .*ctr_p50_ms=\([0-9.]*\).*/\1/p' "$work/create.out")
runc_ms=$(sed -n 's/^RESULT .*runc_p50_ms=\([0-9.]*\).*/\1/p' "$work/create.out")
runc_r=$(sed -n 's/^RESULT .*runc_p50_ratio=\([0-9.]*\).*/\1/p' "$work/create.out")
echo "ROW runtime | create to running, one container, p50 ms | ${create_a:-n/a} | ctr run -d | ${create_c:-n/a} | ${create_r50:-n/a} | <= 1.0 | $(awk -v r="${create_r50:-9}" 'BEGIN {print (r <= 1.0) ? "met" : "MISSED"}')"
echo "ROW runtime | create to running, one container, p50 ms | ${create_a:-n/a} | bare runc run -d, same spec (floor) | ${runc_ms:-n/a} | ${runc_r:-n/a} | - | -"
echo "ROW runtime | pull + unpack ~100 MiB, 6 layers, p50 ms | $(median <"$work/pull-agent") | ctr image pull | $(median <"$work/pull-ctr") | $pull_r50 | <= 0.8 | $(awk -v r="$pull_r50" 'BEGIN {print (r <= 0.8) ? "met" : "MISSED"}')"

#!/usr/bin/env bash
# The standalone demo: sets up containerd, builds the agent, imports the demo
# image into the agent's containerd namespace and shows it running.
# As root, from a clone of the repository.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

eval "$(scripts/rig.sh)"
. scripts/need-cargo.sh

echo "== building zattera-agent"
cargo build --bins
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
agent="$target_dir/debug/zattera-agent"
ns=zattera-demo
sock="$ZATTERA_TEST_CONTAINERD"

echo "== importing the demo image into containerd namespace '$ns'"
"$agent" --containerd-address "$sock" --namespace "$ns" image import "$ZATTERA_TEST_IMAGES/busybox-oci.tar"

echo "== what containerd now has"
ctr --address "$sock" -n "$ns" images ls
ctr --address "$sock" -n "$ns" snapshots ls

echo "== running it once with ctr, from the rootfs the agent unpacked"
ctr --address "$sock" -n "$ns" run --rm docker.io/zattera/busybox:test "demo-$$" \
  sh -c 'echo "hello from $(hostname): $(cat /var/www/index.html)"'

cat <<NEXT

Next:
  $agent --containerd-address $sock --namespace $ns image import FILE --name REF
  ctr --address $sock -n $ns images ls
  $agent --help
NEXT

#!/usr/bin/env bash
# Control-plane benchmarks (issue 7):
#
#  1. apply of a 1,000-assignment AssignmentSet with nothing to change
#     (benches/apply.rs; pure CPU, no root): decode + compare + store, and
#     the executor's full no-op pass, against prost decoding alone.
#  3. a pushed set of 1,000 assignments where 10 change
#     (benches/control_converge.rs; root): the real binary, its containerd
#     calls counted by a gRPC proxy, the pass times from its debug log.
#  2. agent CPU with the control stream open and 50 instances
#     (benches/control_cpu.rs; root, the rig's containerd): the real binary
#     under the test control plane, which re-pushes the set every 2 s;
#     containerd's CPU in the same window is the peer.
#
# AGENT=PATH runs 2 and 3 against another agent binary (the code before a
# change), to compare in the same session.
#
# Traffic stays on loopback and on the benches' own bridges (ztbq,
# 10.201.141.0/24; ztbv, 10.201.142-145.0/24). Everything it makes is removed at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ "$(id -u)" != 0 ]; then
    echo "bench/control/run.sh: run as root (containers, bridges, nftables)" >&2
    exit 1
fi
bash scripts/rig.sh >/dev/null
# shellcheck source=/dev/null
source scripts/need-cargo.sh
echo "== apply of 1,000 assignments"
cargo bench -p zattera-agent --bench apply
echo "== agent CPU with the stream open and 50 instances (IDLE_SECS=${IDLE_SECS:-60})"
cargo bench -p zattera-agent --bench control_cpu
echo "== a pushed set of ${ASSIGNMENTS:-1000} assignments where ${CHANGED:-10} change"
cargo bench -p zattera-agent --bench control_converge

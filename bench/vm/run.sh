#!/usr/bin/env bash
# VM benchmark (issue 43.5): the mesh between two real Debian guests (kernel
# WireGuard, then the userspace backend, against their plain virtio path)
# and boot to all HEALTHY after a reboot with 1 and 20 instances (against
# the guest's own boot to multi-user). Ratios only: under TCG absolute
# figures mean little. See README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ "$(id -u)" != 0 ]; then
  echo "bench/vm: run as root (namespaces, tap devices, qemu)" >&2
  exit 2
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
ls dist/zattera-agent_*_amd64.deb >/dev/null 2>&1 || bash scripts/package.sh
exec python3 scripts/vm/bench.py

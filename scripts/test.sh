#!/usr/bin/env bash
# Runs every test, unit and integration, against the real components
# (containerd, runc, overlayfs). As root, from a clone of the repository.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

eval "$(scripts/rig.sh)"
. scripts/need-cargo.sh

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  cargo test --workspace --no-fail-fast
fi

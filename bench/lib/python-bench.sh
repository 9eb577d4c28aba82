#!/usr/bin/env bash
# Runs bench/<name>/<name>.py against the release agent: root, the rig
# started, the agent built (bench/wake, bench/scale). Usage: python-bench.sh NAME
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
name=$1
if [ "$(id -u)" != 0 ]; then
  echo "bench/$name: must run as root" >&2
  exit 2
fi
command -v cargo >/dev/null || export PATH="$HOME/.cargo/bin:$PATH"
eval "$(bash scripts/rig.sh)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
# The log shim as the packages install it (beside the agent), not the
# agent binary run as one.
cargo build --release -q -p zattera-agent --bin zattera-agent --bin zattera-logshim
export AGENT=$CARGO_TARGET_DIR/release/zattera-agent
exec python3 "bench/$name/$name.py"

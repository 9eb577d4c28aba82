#!/usr/bin/env bash
# Log shim benchmark (issue 17): lines per second through the packaged
# agent binary's log shim (started as containerd's runc shim starts it,
# fd 3/4/5) into rotated, zstd-compressed CRI files, against `cat` writing
# the same stream to a file, same run, same disk; zero loss checked on every
# run; and the shim's CPU per MiB. Bounded: LINES lines (default 2,000,000,
# 200 MiB) × RUNS (default 3) each, about a minute in all.
#
# Needs: cargo, python3, zstd (apt-get install zstd). Any user.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

LINES=${LINES:-2000000}
RUNS=${RUNS:-3}
command -v zstd >/dev/null || { echo "bench/logs: missing zstd (apt-get install zstd)" >&2; exit 2; }

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
cargo build --release -q --bin zattera-agent
AGENT=$CARGO_TARGET_DIR/release/zattera-agent

work=$(mktemp -d /var/tmp/ztlogs-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p bench/logs/results
report=bench/logs/results/$(date -u +%Y-%m-%dT%H%M).json
uptime
python3 bench/logs/measure.py "$AGENT" "$work" "$LINES" "$RUNS" "$report"
echo "figures: $report"

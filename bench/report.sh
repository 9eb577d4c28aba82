#!/usr/bin/env bash
# One report for every benchmark (issue 20): runs each bench/<name>/run.sh
# (and the netns cargo bench) with bounded sizes, one after another, and
# writes bench/results/<date>.md (one ratio table, growth curves as SVG,
# the machine's load) with each run's raw output in bench/results/<date>/.
#
#   bash bench/report.sh                 # every benchmark, about 90 minutes
#   bash bench/report.sh dns executor    # only these
#
# Root (the benchmarks make bridges, namespaces and containers); installs
# what a benchmark needs through its own script. See bench/README.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$(id -u)" != 0 ]; then
  echo "bench/report: run as root" >&2
  exit 2
fi
eval "$(scripts/rig.sh)"
# shellcheck source=/dev/null
. scripts/need-cargo.sh
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
cargo build --release -q --bin zattera-agent
exec python3 bench/report.py "$@"

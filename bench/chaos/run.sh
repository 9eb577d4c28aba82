#!/usr/bin/env bash
# Chaos, long form (issue 19): the CI chaos test (tests/chaos) run with 500
# faults and then a one-hour soak, an app replaced every 30 s, sampling the
# agent's RSS, open descriptors, task count and nft rule count every minute.
# Same code, same invariants after every fault and every soak edit; only the
# sizes differ. The figures go to bench/chaos/results/<date>-seed<N>.json.
#
# Bounded: FAULTS faults (default 500), then SOAK_SECS (default 3600), and
# the whole run is killed after LIMIT_SECS (default 3 h). Its own bridge
# prefix and subnets (PREFIX=ztfb, POOL=60-69), so CI's chaos test can run
# beside it. Root, with the rig
# (scripts/rig.sh) up. Traffic stays on the bridges the run makes.
#
#   bench/chaos/run.sh                  # 500 faults + 1 h, seed 19
#   SEED=random bench/chaos/run.sh      # a fresh seed, printed
#   FAULTS=100 SOAK_SECS=600 bench/chaos/run.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

FAULTS=${FAULTS:-500}
SOAK_SECS=${SOAK_SECS:-3600}
SEED=${SEED:-19}
LIMIT_SECS=${LIMIT_SECS:-10800}

if [ "$(id -u)" != 0 ]; then
  echo "bench/chaos: run as root (namespaces, bridges, nft)" >&2
  exit 2
fi
eval "$(scripts/rig.sh)"

mkdir -p bench/chaos/results
stamp=$(date -u +%Y-%m-%dT%H%M)
report=$PWD/bench/chaos/results/$stamp-seed$SEED.json
log=$PWD/bench/chaos/results/$stamp-seed$SEED.log
uptime > "$log"

cargo build --tests -q --test chaos
ZATTERA_CHAOS_SEED=$SEED ZATTERA_CHAOS_FAULTS=$FAULTS ZATTERA_CHAOS_SOAK_SECS=$SOAK_SECS \
ZATTERA_CHAOS_REPORT=$report ZATTERA_CHAOS_PREFIX=${PREFIX:-ztfb} ZATTERA_CHAOS_POOL=${POOL:-60-69} \
  timeout --kill-after=60 "$LIMIT_SECS" \
  cargo test -q --test chaos faults_in_any_order -- --nocapture 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
uptime >> "$log"
echo "figures: $report"
exit "$status"

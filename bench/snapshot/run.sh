#!/usr/bin/env bash
# Snapshot benchmark (issue 16): zattera-agent's snapshot engine against
# restic 0.14 (Debian's package), both backing up the same generated tree
# (mktree.py, TREE_MIB MiB, default 512) to the same S3 server, in one run:
#
#   first snapshot    agent: `volume snapshot --path TREE`;  restic: `backup TREE`
#   unchanged         the same again, nothing changed in between (the agent
#                     reuses its last walk when a metadata scan finds every
#                     header, inode and ctime equal; restic skips files whose
#                     size, mtime, ctime and inode match its parent snapshot)
#   restore           agent: `volume restore`;  restic: `restore latest`
#
# Each step's wall time and peak RSS come from wait4(2) (measure.py); the
# throughput is the tree's bytes over the wall time; the dedup ratio is the
# tree's bytes over what the bucket holds after the first snapshot (every
# object: chunks and manifest; restic's packs, index, keys, config,
# snapshot). Both restores are checked byte for byte against the tree.
#
# The S3 server is moto from the rig's venv, started on loopback for this
# run only (BENCH_S3_PORT, default 9566) and stopped at the end, so the
# rig's server keeps no gigabyte of benchmark objects in memory. Page cache
# is warm for both tools (the tree was just written). Root only; nothing
# leaves the host; everything is removed on exit. Roughly 5 minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

TREE_MIB=${TREE_MIB:-512}
PORT=${BENCH_S3_PORT:-9566}
RIG_DIR=${ZATTERA_RIG_DIR:-/var/lib/zattera-rig}
VENV=$RIG_DIR/s3-venv
HERE=bench/snapshot

if [ "$(id -u)" != 0 ]; then
  echo "bench/snapshot: must run as root" >&2
  exit 2
fi
command -v restic >/dev/null || {
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends restic >/dev/null
}
command -v cargo >/dev/null || export PATH="$HOME/.cargo/bin:$PATH"
bash scripts/rig.sh >/dev/null # idempotent: the S3 venv (moto, boto3)

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
cargo build --release -q -p zattera-agent --bin zattera-agent
AGENT=$CARGO_TARGET_DIR/release/zattera-agent

work=$(mktemp -d /var/tmp/zt-bench-snap.XXXXXX)
moto_pid=
cleanup() {
  [ -z "$moto_pid" ] || kill "$moto_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

setsid "$VENV/bin/moto_server" -H 127.0.0.1 -p "$PORT" >"$work/moto.log" 2>&1 </dev/null &
moto_pid=$!
for _ in $(seq 1 100); do
  curl -fsS -o /dev/null "http://127.0.0.1:$PORT/moto-api/data.json" 2>/dev/null && break
  sleep 0.1
done

python3 "$HERE/mktree.py" "$work/tree" "$TREE_MIB" >&2
# The agent remembers a full walk only when its newest ctime is 2 s older
# than the walk's start (file times come from a coarse clock); restic has no
# such rule. A tree that has just been written is too fresh, so let it age.
sleep 3
TREE_BYTES=$(find "$work/tree" -type f -printf '%s\n' | awk '{s+=$1} END {print s}')
FILES=$(find "$work/tree" -type f | wc -l)

head -c 32 /dev/urandom >"$work/key"
cat >"$work/agent.toml" <<TOML
endpoint = "http://127.0.0.1:$PORT"
bucket = "bench-agent"
prefix = "snapshots"
access_key = "bench"
secret_key = "bench-secret"
data_key_file = "$work/key"
TOML
AGENT_GLOBAL=(--data-dir "$work/agent-data" --containerd-address "$work/no-containerd.sock")
TARGET=(--target "$work/agent.toml")
export RESTIC_REPOSITORY="s3:http://127.0.0.1:$PORT/bench-restic"
export RESTIC_PASSWORD=bench AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench-secret
export RESTIC_CACHE_DIR="$work/restic-cache"

m() { "$VENV/bin/python" "$HERE/measure.py" "$work/results" "$@"; }
stored() { "$VENV/bin/python" "$HERE/measure.py" --bucket-bytes "http://127.0.0.1:$PORT" "$1"; }

m agent-first "$AGENT" "${AGENT_GLOBAL[@]}" volume snapshot --path "$work/tree" --id first --create-bucket "${TARGET[@]}"
AGENT_STORED=$(stored bench-agent)
m agent-unchanged "$AGENT" "${AGENT_GLOBAL[@]}" volume snapshot --path "$work/tree" --id second "${TARGET[@]}"
m agent-restore "$AGENT" "${AGENT_GLOBAL[@]}" volume restore --path "$work/agent-out" --snapshot first --force "${TARGET[@]}"
diff -r "$work/tree" "$work/agent-out" >/dev/null || { echo "agent restore differs" >&2; exit 1; }
rm -rf "$work/agent-out"

restic init >/dev/null
m restic-first restic backup --host bench "$work/tree"
RESTIC_STORED=$(stored bench-restic)
m restic-unchanged restic backup --host bench "$work/tree"
m restic-restore restic restore latest --target "$work/restic-out"
diff -r "$work/tree" "$work/restic-out$work/tree" >/dev/null || { echo "restic restore differs" >&2; exit 1; }

"$VENV/bin/python" "$HERE/measure.py" --report "$work/results" "$TREE_BYTES" "$FILES" \
  "$AGENT_STORED" "$RESTIC_STORED"

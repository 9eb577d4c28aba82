#!/usr/bin/env bash
# A short, bounded fuzz run of the manifest parser, the build tarball
# unpacker, the CRI log line parser, the snapshot manifest and chunk reader,
# BuildKit's file-sync framing, and the DNS request path
# (CI runs it; longer campaigns are in fuzz/README.md and dns/fuzz/README.md).
# Installs cargo-fuzz itself. Corpora persist in /var/tmp/zattera-fuzz-corpus.
#   ZATTERA_FUZZ_SECONDS   per target (default 20)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/need-cargo.sh
SECONDS_EACH=${ZATTERA_FUZZ_SECONDS:-20}
CORPUS=/var/tmp/zattera-fuzz-corpus
export CARGO_TARGET_DIR=${ZATTERA_FUZZ_TARGET:-/var/tmp/zattera-fuzz-target}
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "[fuzz] cargo install --locked cargo-fuzz" >&2
  cargo install --locked --quiet cargo-fuzz --version 0.13.2
fi
mkdir -p "$CORPUS/manifest" "$CORPUS/request"
# Seeds: the example manifests.
cp examples/*.toml "$CORPUS/manifest/" 2>/dev/null || true
run() {
  local dir=$1 target=$2
  shift 2
  echo "[fuzz] $target for ${SECONDS_EACH}s" >&2
  (cd "$dir" && cargo fuzz run -s none "$target" "$CORPUS/$target" -- \
    -max_total_time="$SECONDS_EACH" -print_final_stats=1 "$@" 2>&1 | tail -n 15)
}
mkdir -p "$CORPUS/build_tarball" "$CORPUS/cri_line" "$CORPUS/snapshot_manifest" "$CORPUS/filesync"
run fuzz manifest -max_len=8192
run fuzz build_tarball -max_len=65536
run fuzz cri_line -max_len=4096
run fuzz snapshot_manifest -max_len=65536
run fuzz filesync -max_len=4096
run dns request -max_len=2048

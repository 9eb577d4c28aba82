#!/usr/bin/env bash
# Runs every test, unit and integration, against the real components
# (containerd, runc, overlayfs). As root, from a clone of the repository.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

eval "$(scripts/rig.sh)"
. scripts/need-cargo.sh

# Every skip is recorded here (zattera_testkit) and listed at the end: a
# skipped test's own message is captured and hidden with its passing output.
export ZATTERA_TEST_SKIPS=${ZATTERA_TEST_SKIPS:-${CARGO_TARGET_DIR:-$PWD/target}/test-skips.tsv}
mkdir -p "$(dirname "$ZATTERA_TEST_SKIPS")"
: > "$ZATTERA_TEST_SKIPS"

# What failed, and what failed once and passed when run again, with
# their messages (.config/nextest.toml): listed last. nextest keeps its
# store under the workspace's own target/, whatever CARGO_TARGET_DIR says.
export ZATTERA_TEST_JUNIT=${ZATTERA_TEST_JUNIT:-$PWD/target/nextest/default/junit.xml}
rm -f "$ZATTERA_TEST_JUNIT"

rc=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast || rc=$?
  python3 scripts/test-report.py "$ZATTERA_TEST_JUNIT"
else
  cargo test --workspace --no-fail-fast || rc=$?
fi
# Fails when the README cites a skipped test as evidence without saying CI
# does not run it.
python3 scripts/skips.py "$ZATTERA_TEST_SKIPS" --check || { [ "$rc" != 0 ] || rc=1; }
exit "$rc"

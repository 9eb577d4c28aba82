#!/usr/bin/env bash
# Builds the nixpacks planner the agent runs for contexts without a
# Dockerfile (dataplane.md BLD-5): the pinned release, from its crate on
# crates.io (`cargo install --locked`), never a binary downloaded at build
# time. Prints the binary's path. Kept under ZATTERA_TOOLS
# (/var/tmp/zattera-tools), so repeated runs on one machine reuse it; the
# packages ship it as /usr/lib/zattera/nixpacks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/need-cargo.sh
VERSION=1.41.0
root=${ZATTERA_TOOLS:-/var/tmp/zattera-tools}
bin=$root/bin/nixpacks
if ! "$bin" --version 2>/dev/null | grep -qF "$VERSION"; then
  printf '\033[1m[nixpacks]\033[0m cargo install --locked nixpacks %s (a few minutes, once)\n' "$VERSION" >&2
  # Its own target dir: the project's lock and features stay apart.
  CARGO_TARGET_DIR="$root/target" cargo install --locked --quiet nixpacks --version "$VERSION" --root "$root" >&2
  rm -rf "$root/target"
fi
echo "$bin"

# Sourced by the scripts: checks for a Rust toolchain new enough for edition 2024.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install a Rust toolchain >= 1.88 (rustup) and run this again" >&2
  exit 1
fi
rust_minor=$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')
if [ "${rust_minor:-0}" -lt 88 ]; then
  echo "$(rustc --version) is too old: zattera needs Rust >= 1.88 (edition 2024)" >&2
  exit 1
fi

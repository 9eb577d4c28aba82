#!/usr/bin/env bash
# Builds the packages from a release build:
#   dist/zattera-agent_<version>_amd64.deb        (cargo-deb)
#   dist/zattera-agent-<version>-1.x86_64.rpm     (cargo-generate-rpm)
#   dist/zattera-agent_<version>+fresh1_amd64.deb the same, version bumped, for
#                                                 the upgrade test of scripts/fresh-check.sh
# The man pages and shell completions in them are generated from the
# binaries' own clap definitions (`zattera-agent man`, `completions`), so they
# never drift from the flags. Then checks them: lintian on the .deb, rpm -qpl
# / -qpR and rpmlint on the .rpm, `man -l` on every page, `bash -n` and a real
# bash completion of `zattera-agent im<TAB>`.
#
# As root, from a clone (it installs its tools: apt for protoc, lintian, rpm
# and rpmlint; `cargo install --locked` for cargo-deb and cargo-generate-rpm).
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/need-cargo.sh
say() { printf '\033[1m[package]\033[0m %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }

CARGO_DEB_VERSION=3.8.0
CARGO_RPM_VERSION=0.21.1

need=()
# libzstd-dev: the snapshot engine links the system libzstd (Debian policy: no
# embedded copies).
for p in protobuf-compiler libzstd-dev pkg-config lintian rpm rpmlint man-db gzip binutils; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
for tool in "cargo-deb@$CARGO_DEB_VERSION" "cargo-generate-rpm@$CARGO_RPM_VERSION"; do
  name=${tool%@*}
  version=${tool#*@}
  if ! "$name" --version 2>/dev/null | grep -qF "$version"; then
    say "cargo install --locked $tool"
    cargo install --locked --quiet "$name" --version "$version"
  fi
done

version=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "zattera-agent"))')
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')

# The release tag the binary reports (hello, `version`): what a reference
# control plane's rollout waits for (src/version.rs).
export ZATTERA_VERSION=${ZATTERA_VERSION:-v$version}
say "release build of $version (reports $ZATTERA_VERSION)"
cargo build --release --locked --workspace --bins
bin="$target_dir/release"

say "man pages and completions from the clap definitions"
rm -rf dist/assets
mkdir -p dist/assets/man dist/assets/completions
for b in zattera-agent zattera-netns; do
  "$bin/$b" man dist/assets/man
  "$bin/$b" completions bash > "dist/assets/completions/$b.bash"
  "$bin/$b" completions zsh > "dist/assets/completions/_$b"
  "$bin/$b" completions fish > "dist/assets/completions/$b.fish"
done
for page in dist/assets/man/*.1; do
  man -l "$page" >/dev/null 2>&1 || die "man -l $page does not render"
  gzip -9n "$page"
done

say "the nixpacks planner (/usr/lib/zattera/nixpacks)"
# Stripped, as Debian policy (and lintian) want of an installed binary.
strip --strip-unneeded -o dist/assets/nixpacks "$(bash scripts/nixpacks.sh)"

say "packages"
rm -f dist/*.deb dist/*.rpm
cargo deb --no-build --no-strip -p zattera-agent -o "dist/zattera-agent_${version}_amd64.deb" >/dev/null
cargo deb --no-build --no-strip -p zattera-agent --deb-version "${version}+fresh1" \
  -o "dist/zattera-agent_${version}+fresh1_amd64.deb" >/dev/null
cargo generate-rpm -p . -o "dist/zattera-agent-${version}-1.x86_64.rpm"
deb="dist/zattera-agent_${version}_amd64.deb"
rpm="dist/zattera-agent-${version}-1.x86_64.rpm"

say "checking $deb"
# Errors fail the build; warnings are printed.
lintian --no-tag-display-limit "$deb" | tee dist/lintian.txt >&2 || true
if grep -q '^E:' dist/lintian.txt; then die "lintian reports errors on $deb"; fi
files=$(dpkg-deb -c "$deb")
for f in ./usr/bin/zattera-agent ./usr/bin/zattera-netns ./etc/zattera/agent.toml ./usr/lib/zattera/nixpacks \
  ./usr/lib/systemd/system/zattera-agent.service ./usr/share/man/man1/zattera-agent.1.gz \
  ./usr/share/man/man1/zattera-netns.1.gz ./usr/share/bash-completion/completions/zattera-agent \
  ./usr/share/zsh/vendor-completions/_zattera-agent ./usr/share/fish/vendor_completions.d/zattera-agent.fish; do
  grep -qF " $f" <<<"$files" || die "$deb lacks $f"
done
deps=$(dpkg-deb -f "$deb" Depends)
for d in 'containerd (>= 1.6) | containerd.io' runc nftables ca-certificates; do
  grep -qF "$d" <<<"$deps" || die "$deb does not depend on $d: $deps"
done
# Into variables: `grep -q` would close the pipe early (SIGPIPE under pipefail).
control=$(dpkg-deb --ctrl-tarfile "$deb" | tar -t)
grep -q conffiles <<<"$control" || die "$deb has no conffiles"

say "checking $rpm"
rpm -qpl "$rpm" > dist/rpm-files.txt
for f in /usr/bin/zattera-agent /usr/bin/zattera-netns /etc/zattera/agent.toml \
  /usr/lib/systemd/system/zattera-agent.service /usr/share/man/man1/zattera-agent.1.gz; do
  grep -qxF "$f" dist/rpm-files.txt || die "$rpm lacks $f"
done
rpm -qpR "$rpm" > dist/rpm-requires.txt
for d in '(containerd >= 1.6 or containerd.io)' nftables ca-certificates; do
  grep -qF "$d" dist/rpm-requires.txt || die "$rpm does not require $d"
done
configs=$(rpm -qp --configfiles "$rpm")
grep -qxF /etc/zattera/agent.toml <<<"$configs" || die "agent.toml is not a config file in $rpm"
rpmlint "$rpm" | tee dist/rpmlint.txt >&2 || true
if grep -qE '^[0-9]+ packages and [0-9]+ specfiles checked; [1-9][0-9]* errors' dist/rpmlint.txt; then
  die "rpmlint reports errors on $rpm"
fi

say "checking the completions in a real bash"
for b in zattera-agent zattera-netns; do
  bash -n "dist/assets/completions/$b.bash" || die "bash -n rejects the $b completion"
done
offered=$(bash --norc --noprofile -c '
  source dist/assets/completions/zattera-agent.bash
  COMP_WORDS=(zattera-agent im); COMP_CWORD=1; COMP_LINE="zattera-agent im"; COMP_POINT=${#COMP_LINE}
  _zattera__agent zattera-agent im zattera-agent
  printf "%s\n" "${COMPREPLY[@]}"')
grep -qx image <<<"$offered" || die "completing 'zattera-agent im<TAB>' offers: $offered"

ls -l dist/*.deb dist/*.rpm >&2
say "done"

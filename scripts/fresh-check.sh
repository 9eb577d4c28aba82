#!/usr/bin/env bash
# The fresh-machine check: proves that the README's first command works on a
# machine that has only what a fresh machine of this kind has, and that the
# packages install, upgrade and purge cleanly there.
#
# It builds a minimal Debian 12 root (mmdebstrap --variant=minbase, cached),
# adds only the Rust toolchain (bind-mounted read-only), gcc, libc6-dev, git,
# python3, ca-certificates and this machine's CA certificates, copies in a
# clean clone of the committed tree, and in a chroot of its own (private mount
# and network namespaces, NAT to reach the package mirror and crates.io):
#   demo      runs `bash scripts/demo.sh`; passes only if every instance is
#             HEALTHY and the published port answers;
#   packages  installs dist/zattera-agent_*.deb with apt (which pulls
#             containerd, runc and nftables), runs the *installed* agent on the
#             demo manifests to HEALTHY, upgrades to a bumped package keeping
#             an edited agent.toml, and purges it (needs scripts/package.sh);
#   tests     runs the README's test command, `bash scripts/test.sh`: every
#             tool and service the tests need comes from the project's own
#             scripts (the rig), none from this machine.
#
#   scripts/fresh-check.sh [demo] [packages] [tests]   (default: demo packages)
#   scripts/fresh-check.sh shell                 a shell in a fresh root, to look around
#
# As root, from a clone. Nothing it starts outlives it: every process runs in
# its network namespace, which is emptied and removed at the end, pass or fail.
#   ZATTERA_FRESH_CACHE  where the base root is cached (/var/cache/zattera-fresh)
#   ZATTERA_FRESH_WORK   scratch space (/var/tmp/zattera-fresh)
#   ZATTERA_FRESH_KEEP=1 keep the roots for a look afterwards
set -euo pipefail
shopt -s inherit_errexit
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${ZATTERA_FRESH_CACHE:-/var/cache/zattera-fresh}
WORK=${ZATTERA_FRESH_WORK:-/var/tmp/zattera-fresh}
MIRROR=${ZATTERA_FRESH_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
# What a fresh machine of this kind has besides the toolchain.
INCLUDE=gcc,libc6-dev,git,python3,ca-certificates
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(demo packages)

say() { printf '\033[1m[fresh]\033[0m %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root"
start=$(date +%s)

# --- host tools ----------------------------------------------------------------
need=()
for p in mmdebstrap iproute2 nftables util-linux; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]} on the host"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- the base root, cached -----------------------------------------------------
key=$(printf '%s %s %s v1' "$SUITE" "$INCLUDE" "$MIRROR" | sha256sum | cut -c1-12)
base="$CACHE/$SUITE-minbase-$key.tar"
mkdir -p "$CACHE" "$WORK"
if [ ! -s "$base" ]; then
  say "building the base root ($SUITE minbase + $INCLUDE) into $base"
  mmdebstrap --quiet --variant=minbase --include="$INCLUDE" \
    --setup-hook='mkdir -p "$1/usr/local/share/ca-certificates"' \
    --setup-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" 2>/dev/null || true' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    "$SUITE" "$base.tmp.tar" "$MIRROR"
  mv "$base.tmp.tar" "$base"
else
  say "base root: $base (cached)"
fi

# --- one isolated host ---------------------------------------------------------
# Every root gets a network namespace of its own (new_netns): the demo's
# agent and containers, still running, keep their ports and bridges there.
VETH=ztfr$$
TABLE=zattera_fresh_$$
ROOTS=()
NSS=()
cleanup() {
  local rc=$?
  # Every process of the check runs in a root of ours (containerd, shims,
  # the agent, and the containers, whose roots lie inside it) or in its
  # network namespace.
  for _ in 1 2 3 4 5; do
    pids=""
    for ns in "${NSS[@]}"; do pids="$pids $(ip netns pids "$ns" 2>/dev/null || true)"; done
    for p in /proc/[0-9]*; do
      root=$(readlink "$p/root" 2>/dev/null) || continue
      for r in "${ROOTS[@]}"; do
        case "$root" in "$r"|"$r"/*) pids="$pids ${p#/proc/}" ;; esac
      done
    done
    # Containers have network namespaces of their own: found by cgroup.
    for cg in /sys/fs/cgroup/zattera/zattera-fresh-$$ /sys/fs/cgroup/*/zattera/zattera-fresh-$$ \
      /sys/fs/cgroup/zattera/zattera-pkg-$$ /sys/fs/cgroup/*/zattera/zattera-pkg-$$; do
      [ -d "$cg" ] || continue
      pids="$pids $(find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null | tr '\n' ' ')"
    done
    [ -n "${pids// /}" ] || break
    kill -9 $pids 2>/dev/null || true
    sleep 1
  done
  for i in "${!NSS[@]}"; do
    ip netns del "${NSS[$i]}" 2>/dev/null || true
    ip link del "$VETH${i}h" 2>/dev/null || true
  done
  # runc removes each container's cgroup; the parents are the agents'.
  for h in /sys/fs/cgroup /sys/fs/cgroup/*; do
    for ns in "zattera-fresh-$$" "zattera-pkg-$$"; do
      [ -d "$h/zattera/$ns" ] || continue
      find "$h/zattera/$ns" -depth -type d -exec rmdir {} + 2>/dev/null || true
    done
  done
  nft delete table inet "$TABLE" 2>/dev/null || true
  for r in "${ROOTS[@]}"; do
    # (None, usually: the mounts were made in private mount namespaces.)
    { grep -F " $r" /proc/mounts || true; } | awk '{print $2}' | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    [ "${ZATTERA_FRESH_KEEP:-}" = 1 ] || rm -rf --one-file-system "$r" "$r.cgroup"
  done
  say "done in $(( $(date +%s) - start )) s (exit $rc)"
}
trap cleanup EXIT

# Network namespaces with a NATed link to the host each: the package
# mirror and crates.io are reachable, and nothing a root makes (bridges, nft
# tables, published ports) can touch the host's own or another root's.
echo 1 > /proc/sys/net/ipv4/ip_forward
nft -f - <<NFT
table inet $TABLE {
  chain forward {
    type filter hook forward priority filter - 1; policy accept;
    iifname "$VETH*" accept
    oifname "$VETH*" ct state established,related accept
  }
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr 10.254.254.0/24 oifname != "$VETH*" masquerade
  }
}
NFT

# A new network namespace, in $NS; the i-th has 10.254.254.(4i+2)/30.
new_netns() {
  local i=${#NSS[@]}
  NS=zt-fresh-$$-$i
  NSS+=("$NS")
  ip netns add "$NS"
  ip link add "$VETH${i}h" type veth peer name "$VETH${i}c"
  ip link set "$VETH${i}c" netns "$NS"
  ip addr add "10.254.254.$((4 * i + 1))/30" dev "$VETH${i}h"
  ip link set "$VETH${i}h" up
  ip -n "$NS" addr add "10.254.254.$((4 * i + 2))/30" dev "$VETH${i}c"
  ip -n "$NS" link set "$VETH${i}c" up
  ip -n "$NS" link set lo up
  ip -n "$NS" route add default via "10.254.254.$((4 * i + 1))"
}

# A fresh root from the base, with a clean clone of the committed tree, in
# $ROOT.
new_root() {
  local r="$WORK/$1-$$"
  rm -rf "$r"
  mkdir -p "$r"
  ROOTS+=("$r")
  new_netns
  tar -xf "$base" -C "$r"
  # The host's resolver, as a fresh machine of this kind would have it.
  cp -L /etc/resolv.conf "$r/etc/resolv.conf"
  cp /etc/apt/apt.conf.d/99artifact-registry "$r/etc/apt/apt.conf.d/" 2>/dev/null || true
  git clone -q --no-local "$HERE" "$r/root/zattera"
  mkdir -p "$r/root/.rustup" "$r/root/.cargo/bin"
  ROOT=$r
  ROOT_NS=$NS
}

# Runs a script in the root: private mounts (the root bound onto itself, so
# runc can pivot into container roots), /proc, /dev and the cgroup
# hierarchies from the host, a /sys of the network namespace above, and the
# toolchain read-only.
in_root() {
  local r=$1
  shift
  unshare --mount --propagation private bash -euo pipefail -c '
    r=$1 ns=$2
    shift 2
    mount --bind "$r" "$r"
    mount -t proc proc "$r/proc"
    mount --rbind /dev "$r/dev"
    mount -t tmpfs tmpfs "$r/run"
    mount --bind -o ro "$HOME/.rustup" "$r/root/.rustup"
    mount --bind -o ro "$HOME/.cargo/bin" "$r/root/.cargo/bin"
    # Still the host view of /sys here: keep its cgroup mounts for later.
    mkdir -p "$r.cgroup"
    mount --rbind /sys/fs/cgroup "$r.cgroup"
    exec nsenter --net="/run/netns/$ns" bash -euo pipefail -c '"'"'
      r=$1
      shift
      mount -t sysfs sysfs "$r/sys"
      mount --rbind "$r.cgroup" "$r/sys/fs/cgroup"
      # pivot_root, not chroot: the root of this mount namespace must be the
      # fresh root, or a process runc execs into a container (it joins the
      # mount namespace of the container, whose root is that of ours) lands
      # in the tree of the host.
      cd "$r"
      mkdir -p .oldroot
      pivot_root . .oldroot
      cd /
      umount -l /.oldroot
      exec /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
        PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        bash -euo pipefail -c "$@"
    '"'"' in_netns "$r" "$@"
  ' in_root "$r" "$ROOT_NS" "$@"
}

for stage in "${STAGES[@]}"; do
  case "$stage" in
  demo)
    say "demo: the README's first command in a fresh root"
    new_root demo
    r=$ROOT
    t0=$(date +%s)
    # A namespace of its own: containers' cgroups live in the host's tree.
    in_root "$r" "cd /root/zattera && ZATTERA_DEMO_NAMESPACE=zattera-fresh-$$ bash scripts/demo.sh" \
      || die "demo: bash scripts/demo.sh failed in the fresh root"
    say "demo: passed in $(( $(date +%s) - t0 )) s"
    ;;
  packages)
    deb=$(ls "$HERE"/dist/zattera-agent_*_amd64.deb 2>/dev/null | grep -v '+fresh' | sort -V | tail -n 1 || true)
    [ -n "$deb" ] || die "packages: no dist/zattera-agent_*_amd64.deb; run scripts/package.sh first"
    upgrade=$(ls "$HERE"/dist/zattera-agent_*+fresh*_amd64.deb 2>/dev/null | tail -n 1 || true)
    [ -n "$upgrade" ] || die "packages: no bumped package for the upgrade; run scripts/package.sh (it builds one)"
    say "packages: $(basename "$deb"), upgrade to $(basename "$upgrade")"
    new_root pkg
    r=$ROOT
    t0=$(date +%s)
    mkdir -p "$r/root/dist"
    cp "$deb" "$upgrade" "$r/root/dist/"
    in_root "$r" "bash /root/zattera/scripts/package-check.sh $(basename "$deb") $(basename "$upgrade") zattera-pkg-$$" \
      || die "packages: the package check failed in the fresh root"
    say "packages: passed in $(( $(date +%s) - t0 )) s"
    ;;
  tests)
    say "tests: the README's test command in a fresh root"
    new_root tests
    r=$ROOT
    t0=$(date +%s)
    in_root "$r" "cd /root/zattera && CI=true bash scripts/test.sh" \
      || die "tests: bash scripts/test.sh failed in the fresh root"
    say "tests: passed in $(( $(date +%s) - t0 )) s"
    ;;
  shell)
    # For a look around: an interactive shell in a fresh root.
    new_root shell
    in_root "$ROOT" 'cd /root/zattera && exec bash -i' ;;
  *) die "unknown stage $stage (demo, packages, tests, shell)" ;;
  esac
done

#!/usr/bin/env bash
# Inside a fresh Debian root (scripts/fresh-check.sh packages): the .deb from
# a user's point of view. Installs it with apt (containerd, runc and nftables
# come from the mirror), checks its files and the unit's enablement, runs the
# *installed* agent on the demo manifests to HEALTHY against containerd from
# the package, upgrades to a bumped package keeping an edited agent.toml, and
# purges it.
#   package-check.sh DEB UPGRADE_DEB NAMESPACE   (the packages in /root/dist)
# NAMESPACE is the agent's containerd namespace: its cgroups live in the
# host's hierarchy, so it must not be another agent's.
set -euo pipefail
deb=/root/dist/$1
upgrade=/root/dist/$2
ns=$3
say() { printf '\033[1m[package-check]\033[0m %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
export DEBIAN_FRONTEND=noninteractive

say "apt-get install $(basename "$deb")"
apt-get update -qq
apt-get install -y -qq "$deb" >/dev/null
for p in containerd runc nftables; do
  dpkg-query -W -f='${Status}' "$p" | grep -q 'ok installed' || die "$p was not installed as a dependency"
done
files=(/usr/bin/zattera-agent /usr/bin/zattera-netns /usr/lib/zattera/zattera-logshim /etc/zattera/agent.toml
  /usr/lib/systemd/system/zattera-agent.service /usr/share/man/man1/zattera-agent.1.gz
  /usr/share/man/man1/zattera-netns.1.gz /usr/share/bash-completion/completions/zattera-agent
  /usr/share/bash-completion/completions/zattera-netns /usr/share/zsh/vendor-completions/_zattera-agent
  /usr/share/fish/vendor_completions.d/zattera-agent.fish)
for f in "${files[@]}"; do
  [ -e "$f" ] || die "$f is not installed"
done
[ -L /etc/systemd/system/multi-user.target.wants/zattera-agent.service ] || die "the unit is not enabled"
[ "$(stat -c %a /var/lib/zattera)" = 700 ] || die "/var/lib/zattera is not 0700"
[ "$(stat -c %a /etc/zattera/agent.toml)" = 600 ] || die "/etc/zattera/agent.toml is not 0600"
grep -q '^KillMode=process' /usr/lib/systemd/system/zattera-agent.service || die "the unit lacks KillMode=process"
/usr/bin/zattera-agent version

say "containerd from the package, the demo image"
containerd >/var/log/containerd.log 2>&1 &
for _ in $(seq 1 100); do
  ctr version >/dev/null 2>&1 && break
  sleep 0.1
done
ctr version >/dev/null || die "containerd did not start: $(tail -n 5 /var/log/containerd.log)"
apt-get install -y -qq --no-install-recommends busybox-static >/dev/null
python3 /root/zattera/scripts/mkimage.py /root/images >/dev/null
agent() { /usr/bin/zattera-agent --namespace "$ns" "$@"; }
agent image import /root/images/busybox-oci.tar
agent doctor || die "doctor fails on this root"

say "the installed agent runs the demo manifests"
/usr/bin/zattera-agent --namespace "$ns" run --manifests /root/zattera/examples --subnet-pool 100-119 \
  >/var/log/zattera-agent.log 2>&1 &  # not through the function: $! must be the agent
agent=$!
healthy=no
for _ in $(seq 1 90); do
  if agent status --json 2>/dev/null | python3 -c '
import json, sys
a = json.load(sys.stdin)["assignments"]
sys.exit(0 if len(a) == 3 and all(x["state"] == "HEALTHY" for x in a) else 1)'; then
    healthy=yes
    break
  fi
  sleep 1
done
agent status
[ "$healthy" = yes ] || die "not HEALTHY within 90 s: $(tail -n 20 /var/log/zattera-agent.log)"
python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:8080/whoami.txt", timeout=5).read().decode().strip())' \
  || die "the published port does not answer"
kill -TERM "$agent"
wait "$agent" || die "the agent did not exit 0 on SIGTERM"
[ "$(ctr -n "$ns" task ls -q | wc -l)" = 3 ] || die "the containers did not outlive the agent"

say "upgrade to $(basename "$upgrade") keeps an edited agent.toml"
echo '# edited by the admin' >>/etc/zattera/agent.toml
apt-get install -y -qq "$upgrade" >/dev/null
dpkg-query -W -f='${Version}' zattera-agent | grep -q '+fresh1' || die "the upgrade did not install"
grep -q '^# edited by the admin' /etc/zattera/agent.toml || die "the upgrade replaced the edited agent.toml"

say "dpkg --purge"
dpkg --purge zattera-agent >/dev/null
for f in "${files[@]}"; do
  [ ! -e "$f" ] || die "$f is left after the purge"
done
[ ! -e /etc/systemd/system/multi-user.target.wants/zattera-agent.service ] || die "the unit's enablement is left"
say "passed"

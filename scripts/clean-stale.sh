#!/usr/bin/env bash
# Removes the kernel state that earlier, killed test runs left on this
# machine, matched by the tests' own names only (a stale rule from a killed
# run once refused a VIP connection in a later run):
#   nft tables   inet zttest_* (netns tests), inet zattera_zt_test_* (tests
#                with a containerd namespace zt-test-*), inet zattera_fresh_*
#                and zattera_zattera_fresh_* / zattera_zattera_pkg_* (the
#                fresh-machine check)
#   links        the tests' bridges, veths and VIP interfaces: a test bridge
#                prefix (zt + letters, never the agent's default ztbr) then
#                a slot, d, vip or a veth's octets
#   netns        zt-fresh-* (fresh-check), zt-<tag>-<pid> (the tests'
#                TestNetns: a four-letter tag) and ztvm-* with their guests
#                (the VM lane)
#   mounts       everything mounted under a test's temp dir (/tmp/.tmpXXXXXX)
#                that holds an agent run dir: the netns pins (nsfs) of an agent
#                that was killed with its test, which also keep those network
#                namespaces alive and lengthen every runc's mountinfo reads
# Run by .ci/run before anything else; never while tests run.
set -uo pipefail
say() { printf '\033[1m[clean-stale]\033[0m %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { say "must run as root"; exit 1; }

if command -v nft >/dev/null; then
  nft list tables 2>/dev/null | while read -r _ family name; do
    case "$family/$name" in
    inet/zttest_* | inet/zattera_zt_test_* | inet/zattera_fresh_* | inet/zattera_zattera_fresh_* | inet/zattera_zattera_pkg_*)
      say "nft table $family $name"
      nft delete table "$family" "$name" ;;
    esac
  done
fi

ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | while read -r link; do
  case "$link" in ztbr* | ztvm*) continue ;; esac
  if [[ "$link" =~ ^zt[a-z]{1,6}(d|b|[0-9]{1,3}t?|[db]v[0-9]{1,3}|[0-9]{1,3}v[0-9]{1,3}|vip|up0)$ ]]; then
    say "link $link"
    ip link del "$link" 2>/dev/null
  fi
done

if [ -d scripts/vm ]; then
  python3 scripts/vm/lane.py clean
fi
awk '{print $2}' /proc/self/mounts | grep -E '^/tmp/[.]tmp[A-Za-z0-9]{6}/run/netns/' | cut -d/ -f1-3 | sort -u |
  while read -r dir; do
    say "mounts under $dir"
    awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do umount -l "$m"; done
    rm -rf "$dir"
  done
for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
  if [[ "$ns" == zt-fresh-* || "$ns" =~ ^zt-[a-z]{4}-[0-9]+$ ]]; then
    say "netns $ns"
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$ns"
  fi
done
exit 0

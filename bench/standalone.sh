# Sourced by benchmarks that run the agent standalone (dns, metrics).
# remove_standalone NS PREFIX WORK: removes what such an agent made, ours
# only: the containers, images and containerd namespace NS, the agent's nft
# table, the links named PREFIX*, the netns mounts under WORK/run, and WORK.
remove_standalone() {
  local ns=$1 prefix=$2 work=$3 c i l f
  for c in $(ctr -a "$SOCK" -n "$ns" containers ls -q 2>/dev/null); do
    ctr -a "$SOCK" -n "$ns" tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true
  done
  sleep 1
  for c in $(ctr -a "$SOCK" -n "$ns" containers ls -q 2>/dev/null); do
    ctr -a "$SOCK" -n "$ns" tasks rm -f "$c" >/dev/null 2>&1 || true
    ctr -a "$SOCK" -n "$ns" containers rm "$c" >/dev/null 2>&1 || true
  done
  for i in $(ctr -a "$SOCK" -n "$ns" images ls -q 2>/dev/null); do
    ctr -a "$SOCK" -n "$ns" images rm "$i" >/dev/null 2>&1 || true
  done
  # containerd's GC frees the content in the background: retry briefly.
  for _ in 1 2 3 4 5; do
    ctr -a "$SOCK" namespaces rm "$ns" >/dev/null 2>&1 && break
    sleep 1
  done
  nft delete table inet "zattera_${ns//-/_}" 2>/dev/null || true
  for l in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$prefix" || true); do
    ip link delete "$l" 2>/dev/null || true
  done
  for f in "$work"/run/netns/*; do [ -e "$f" ] && umount "$f" 2>/dev/null; done
  # The netns directory is a mount of its own (shared propagation).
  umount "$work/run/netns" 2>/dev/null || true
  rm -rf "$work"
}

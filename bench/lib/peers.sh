# Helpers shared by the benchmarks that run the agent beside sequential
# `ctr run -d --cni` containers (bench/executor, bench/density). Sourced;
# the caller sets SOCK, NS_AGENT, NS_CTR, NFT_TABLE, PREFIX, CTR_BRIDGE,
# work and agent_pid. Everything here touches only what those name.

ctr_() { ctr --address "$SOCK" "$@"; }

# Kills and deletes every task and container of namespace $1 (ours only).
purge_containers() {
  local ids id
  ids=$(ctr_ -n "$1" containers ls -q 2>/dev/null) || return 0
  [ -n "$ids" ] || return 0
  for id in $ids; do ctr_ -n "$1" tasks kill -a -s SIGKILL "$id" >/dev/null 2>&1 || true; done
  for id in $ids; do
    for _ in $(seq 50); do
      ctr_ -n "$1" tasks rm "$id" >/dev/null 2>&1 && break
      ctr_ -n "$1" tasks ls -q 2>/dev/null | grep -qx "$id" || break
      sleep 0.1
    done
    ctr_ -n "$1" containers rm "$id" >/dev/null 2>&1 || true
  done
}
remove_links() {
  local l
  for l in /sys/class/net/"$PREFIX"* /sys/class/net/"$CTR_BRIDGE"; do
    [ -e "$l" ] && ip link del "$(basename "$l")" 2>/dev/null || true
  done
}
umount_under() {
  awk -v d="$1" '$2 ~ "^"d {print $2}' /proc/self/mounts | sort -r | while read -r m; do umount -l "$m" || true; done
}
stop_agent() {
  if [ -n "$agent_pid" ]; then
    kill "$agent_pid" 2>/dev/null || true
    wait "$agent_pid" 2>/dev/null || true
    agent_pid=
  fi
}
# Removes everything of the run, also after a failure: the agent, both
# namespaces' containers and images, the agent's nft table, the links, the
# mounts and cgroups under the run, its temp dir.
cleanup() {
  set +e
  stop_agent
  for ns in "$NS_AGENT" "$NS_CTR"; do
    purge_containers "$ns"
    for img in $(ctr_ -n "$ns" images ls -q 2>/dev/null); do ctr_ -n "$ns" images rm --sync "$img" >/dev/null; done
    ctr_ namespaces rm "$ns" >/dev/null 2>&1
  done
  nft delete table inet "$NFT_TABLE" 2>/dev/null
  remove_links
  umount_under "$work"
  for h in /sys/fs/cgroup /sys/fs/cgroup/*; do
    for ns in "$NS_AGENT" "$NS_CTR"; do
      for d in "$h/zattera/$ns" "$h/$ns"; do
        [ -d "$d" ] && { find "$d" -mindepth 1 -depth -type d -exec rmdir {} + 2>/dev/null; rmdir "$d" 2>/dev/null; }
      done
    done
  done
  rm -rf "$work"
}

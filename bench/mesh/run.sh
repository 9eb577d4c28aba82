#!/usr/bin/env bash
# Mesh benchmark (issue 14): TCP throughput and round-trip latency between
# two hosts through the userspace WireGuard the agent runs (the release
# binary's `mesh-device`, configured over its UAPI socket as the agent does),
# as ratios to the same transfer over the plain veth path between the same
# two hosts in the same run; and the device's CPU per Gbit/s.
#
# Hosts are network namespaces ztbw-a and ztbw-b on a bridge ztbwbr
# (underlay 10.203.88.1-2/24, mesh 10.90.250.1-2); everything is ours and
# removed on exit, also on failure. Root; no traffic leaves the host;
# bounded: SECS (default 10) per iperf3 run, COUNT (default 200) pings.
# Results: bench/mesh/results/<date>.json. AGENT=PATH measures that binary
# instead of building the release agent (a before and an after binary in
# one session, under the same conditions).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

SECS=${SECS:-10}
COUNT=${COUNT:-200}
P=ztbw
if [ "$(id -u)" != 0 ]; then
  echo "bench/mesh: run as root (namespaces, tun devices)" >&2
  exit 2
fi
for tool in iperf3 busybox python3; do
  command -v "$tool" >/dev/null || { echo "bench/mesh: $tool missing (scripts/rig.sh installs it)" >&2; exit 2; }
done
if [ -z "${AGENT:-}" ]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/zattera-target}
  cargo build --release -q --bin zattera-agent
  AGENT=$CARGO_TARGET_DIR/release/zattera-agent
fi
[ -x "$AGENT" ] || { echo "bench/mesh: $AGENT is not an executable" >&2; exit 2; }

cleanup() {
  for h in a b; do
    for pid in $(ip netns pids $P-$h 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del $P-$h 2>/dev/null || true
    ip link del ${P}v$h 2>/dev/null || true
    rm -f /var/run/wireguard/${P}$h.sock
  done
  ip link del ${P}br 2>/dev/null || true
}
trap cleanup EXIT
cleanup

ip link add ${P}br type bridge
ip link set ${P}br up
i=0
for h in a b; do
  i=$((i + 1))
  ip netns add $P-$h
  ip link add ${P}v$h type veth peer name eth0 netns $P-$h
  ip link set ${P}v$h master ${P}br up
  ip -n $P-$h link set lo up
  ip -n $P-$h link set eth0 up
  ip -n $P-$h addr add 10.203.88.$i/24 dev eth0
  # The device, started the way the agent starts it.
  nsenter --net=/run/netns/$P-$h -- setsid "$AGENT" mesh-device ${P}$h >/dev/null 2>&1 &
done
for h in a b; do
  for _ in $(seq 100); do [ -S /var/run/wireguard/${P}$h.sock ] && break; sleep 0.05; done
done

# Keys and the UAPI `set` the agent would send (x25519 in pure Python).
python3 - "$P" <<'EOF'
import os, socket, sys
P = sys.argv[1]
p = 2**255 - 19
def x25519(k, u):
    k = bytearray(k); k[0] &= 248; k[31] &= 127; k[31] |= 64
    k = int.from_bytes(k, "little"); x1 = u; x2, z2, x3, z3 = 1, 0, u, 1; swap = 0
    for t in reversed(range(255)):
        b = (k >> t) & 1; swap ^= b
        if swap: x2, x3, z2, z3 = x3, x2, z3, z2
        swap = b
        a = (x2 + z2) % p; aa = a * a % p; bb_ = (x2 - z2) % p; bb = bb_ * bb_ % p; e = (aa - bb) % p
        c = (x3 + z3) % p; d = (x3 - z3) % p; da = d * a % p; cb = c * bb_ % p
        x3 = (da + cb) ** 2 % p; z3 = x1 * (da - cb) ** 2 % p; x2 = aa * bb % p; z2 = e * (aa + 121665 * e) % p
    if swap: x2, x3, z2, z3 = x3, x2, z3, z2
    return (x2 * pow(z2, p - 2, p) % p).to_bytes(32, "little")
keys = {h: os.urandom(32) for h in "ab"}
pub = {h: x25519(keys[h], 9) for h in "ab"}
for i, (h, o) in enumerate([("a", "b"), ("b", "a")]):
    oi = 2 if h == "a" else 1
    body = (f"set=1\nprivate_key={keys[h].hex()}\nlisten_port=51820\n"
            f"public_key={pub[o].hex()}\nendpoint=10.203.88.{oi}:51820\nallowed_ip=10.90.250.{oi}/32\n\n")
    s = socket.socket(socket.AF_UNIX); s.connect(f"/var/run/wireguard/{P}{h}.sock"); s.sendall(body.encode())
    answer = s.recv(100).decode()
    assert "errno=0" in answer, answer
EOF
i=0
for h in a b; do
  i=$((i + 1))
  ip -n $P-$h link set ${P}$h mtu 1420 up
  ip -n $P-$h addr add 10.90.250.$i/32 dev ${P}$h
  ip -n $P-$h route add 10.90.0.0/16 dev ${P}$h src 10.90.250.$i
done
in_a() { nsenter --net=/run/netns/$P-a -- "$@"; }
in_b() { nsenter --net=/run/netns/$P-b -- "$@"; }
in_a busybox ping -c 3 -W 2 10.90.250.2 >/dev/null

in_b iperf3 -s -D -1 >/dev/null 2>&1 || true
cpu_of_devices() {
  local t=0
  for pid in $(ip netns pids $P-a) $(ip netns pids $P-b); do
    if grep -q mesh-device /proc/"$pid"/cmdline 2>/dev/null; then
      read -r -a f < /proc/"$pid"/stat
      t=$((t + f[13] + f[14]))
    fi
  done
  echo "$t"
}
gbits() { # DEST -> Gbit/s received
  in_b iperf3 -s -D -1 >/dev/null 2>&1
  sleep 0.3
  in_a iperf3 -c "$1" -t "$SECS" -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)'
}
rtt() { # DEST -> p50 and p99 ms
  in_a busybox ping -c "$COUNT" -i 0.01 -q "$1" >/dev/null
  in_a busybox ping -c "$COUNT" -i 0.01 "$1" | python3 -c '
import re,sys
v=sorted(float(m.group(1)) for m in (re.search(r"time=([0-9.]+)", l) for l in sys.stdin) if m)
print(v[len(v)//2], v[int(len(v)*0.99)-1])'
}

veth_gbit=$(gbits 10.203.88.2)
c0=$(cpu_of_devices)
mesh_gbit=$(gbits 10.90.250.2)
c1=$(cpu_of_devices)
read -r veth_p50 veth_p99 < <(rtt 10.203.88.2)
read -r mesh_p50 mesh_p99 < <(rtt 10.90.250.2)
hz=$(getconf CLK_TCK)
mkdir -p bench/mesh/results
out=bench/mesh/results/$(date -u +%Y-%m-%dT%H%M%S).json
AGENT_PATH=$AGENT python3 - "$veth_gbit" "$mesh_gbit" "$veth_p50" "$veth_p99" "$mesh_p50" "$mesh_p99" "$c0" "$c1" "$hz" "$SECS" "$out" <<'EOF'
import json, os, sys
vg, mg, vp50, vp99, mp50, mp99 = map(float, sys.argv[1:7])
c0, c1, hz, secs = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9]), int(sys.argv[10])
cpu_s = (c1 - c0) / hz
r = {
    "date": os.popen("date -u +%FT%TZ").read().strip(),
    "load": open("/proc/loadavg").read().split()[:3],
    "backend": "userspace (release agent's mesh-device)",
    "agent": os.environ.get("AGENT_PATH", ""),
    "throughput_gbit": {"veth": vg, "mesh": mg, "ratio": mg / vg},
    "rtt_ms": {"veth": {"p50": vp50, "p99": vp99}, "mesh": {"p50": mp50, "p99": mp99},
               "ratio_p50": mp50 / vp50},
    "device_cores_per_gbit_per_s": cpu_s / secs / mg,
    "device_cores_busy": cpu_s / secs,
}
json.dump(r, open(sys.argv[11], "w"), indent=2)
print(json.dumps(r, indent=2))
EOF

#!/usr/bin/env python3
"""The VM lane's measurements (issue 43.5), on real Debian guests. Under TCG
absolute figures mean little, so each is a ratio to a peer measured on the
same guests in the same run:

- the mesh: HTTP throughput (curl fetching a file from busybox httpd) and
  round trip (ping) between two guests joined to the test control plane,
  over kernel WireGuard and then the userspace backend, each against the
  plain virtio path between the same two guests;
- boot to all HEALTHY after `systemctl reboot`, with 1 and 20 instances
  (standalone), against the guest's own boot to multi-user.target.

    python3 scripts/vm/bench.py        (as root, after scripts/package.sh;
                                        bench/vm/run.sh is the entry)

Prints `ROW` lines for bench/report.py. Bounded: MIB (default 32) per
transfer, PINGS (default 30) per round trip. PARTS="mesh" or "boot" runs one
half.
"""
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster  # noqa: E402
import guest as vm  # noqa: E402
import lane  # noqa: E402
from guest import expect  # noqa: E402

MIB = int(os.environ.get("MIB", "32"))
PINGS = int(os.environ.get("PINGS", "30"))
PORT = 8099
# What to measure: the mesh, boot to HEALTHY, or both (the default).
PARTS = os.environ.get("PARTS", "mesh boot").split()


def row(measure, agent, peer, peer_value, ratio, goal="-", verdict="-"):
    print(f"ROW vm | {measure} | {agent} | {peer} | {peer_value} | {ratio} | {goal} | {verdict}",
          flush=True)


def serve(g):
    """A file of MIB MiB on busybox httpd at PORT, on every address of `g`."""
    g.sh(f"mkdir -p /tmp/www && head -c {MIB << 20} /dev/zero > /tmp/www/blob && "
         f"busybox httpd -p {PORT} -h /tmp/www > /dev/null 2>&1 < /dev/null")


def path(src, ip):
    """(Mbit/s, ms) from `src` to `ip`: one fetch of the file (after one
    warm-up), and the mean round trip of PINGS pings."""
    url = f"http://{ip}:{PORT}/blob"
    src.sh(f"curl -fsS -o /dev/null --max-time 120 {url}", timeout=180)
    speed = float(src.sh(f"curl -fsS -o /dev/null --max-time 300 -w '%{{speed_download}}' {url}",
                         timeout=360))
    pings = src.sh(f"busybox ping -q -c {PINGS} -i 0.2 {ip}", timeout=120)
    rtt = re.search(r"= [\d.]+/([\d.]+)/", pings)
    expect(rtt, f"no round trip in {pings}")
    return speed * 8 / 1e6, float(rtt.group(1))


def mesh_rows(guests, control):
    a, b = guests
    serve(b)
    workers = control.call("workers", count=2, timeout=300)["workers"]
    mesh_ip = {w["endpoint"].split(":")[0]: w["mesh_ip"] for w in workers}[b.ip]
    plain = path(a, b.ip)
    results = {}
    for backend in ("kernel", "userspace"):
        if backend == "userspace":
            # As an operator switches: stop, remove the kernel device, start.
            for g in guests:
                g.sh("systemctl stop zattera-agent && ip link del zt0 && "
                     "echo 'mesh-backend = \"userspace\"' >> /etc/zattera/agent.toml && "
                     "systemctl start zattera-agent", timeout=300)
        for g in guests:
            cluster.eventually(f"{g.name}: {backend} mesh with handshakes",
                               lambda g=g: cluster.mesh(g).get("backend") == backend
                               and cluster.shaken(g, cluster.peers_of(g, workers)), 180)
        results[backend] = path(a, mesh_ip)
    row("virtio path (peer), TCG guests", f"{plain[0]:.0f} Mbit/s", "-", f"{plain[1]:.2f} ms rtt", "-")
    for backend, (mbit, rtt) in results.items():
        row(f"mesh throughput, {backend} WireGuard / plain virtio", f"{mbit:.0f} Mbit/s",
            "plain virtio", f"{plain[0]:.0f} Mbit/s", f"{mbit / plain[0]:.2f}")
        row(f"mesh round trip, {backend} WireGuard / plain virtio", f"{rtt:.2f} ms",
            "plain virtio", f"{plain[1]:.2f} ms", f"{rtt / plain[1]:.2f}")
    if "userspace" in results and "kernel" in results:
        row("mesh throughput, userspace / kernel WireGuard", f"{results['userspace'][0]:.0f} Mbit/s",
            "kernel", f"{results['kernel'][0]:.0f} Mbit/s",
            f"{results['userspace'][0] / results['kernel'][0]:.2f}")


def boot_rows(ctx, g):
    node = lane.Node(g, ctx)
    node.install({})
    g.sh("systemctl enable --now zattera-agent", timeout=300)
    times = {}
    for n in (1, 20):
        g.write("/etc/zattera/manifests/sleeper.toml",
                lane.app("sleeper", lane.SLEEP) + f"replicas = {n}\n")
        node.wait(f"{n} sleepers HEALTHY", lambda s, n=n: lane.all_in(s, "sleeper", n, "HEALTHY"))
        g.reboot("reboot")
        node.wait(f"{n} sleepers HEALTHY after the reboot",
                  lambda s, n=n: lane.all_in(s, "sleeper", n, "HEALTHY"))
        healthy = float(g.sh("cut -d' ' -f1 /proc/uptime").strip())
        multi_user = int(g.sh("systemctl show -p ActiveEnterTimestampMonotonic --value "
                              "multi-user.target").strip()) / 1e6
        times[n] = (healthy, multi_user)
        row(f"boot to all HEALTHY / boot to multi-user, {n} instance{'s' if n > 1 else ''}",
            f"{healthy:.1f} s", "multi-user.target", f"{multi_user:.1f} s", f"{healthy / multi_user:.2f}")
    row("boot to all HEALTHY, 20 instances / 1", f"{times[20][0]:.1f} s", "1 instance",
        f"{times[1][0]:.1f} s", f"{times[20][0] / times[1][0]:.2f}")


def main():
    if os.geteuid() != 0:
        raise SystemExit("vm bench: must run as root")
    lane.host_tools()
    vm.clean_stale()
    deb, upgrade = lane.packages()
    img = vm.Image("bookworm").build()
    accel = os.environ.get("ZATTERA_VM_ACCEL") or ("kvm" if vm.kvm_boots(img) else "tcg")
    artifacts = vm.WORK / "runs" / time.strftime("bench-%Y%m%d-%H%M%S")
    artifacts.mkdir(parents=True, exist_ok=True)
    net = vm.Network(str(os.getpid()))
    facts = {}
    ctx = lane.Ctx("bookworm", deb, upgrade, lane.test_image(vm.WORK), facts, img, net, accel, artifacts)
    row("guests", f"bookworm, {accel}", "-", img.versions.read_text().split()[0], "-")
    guests, control = [], None
    try:
        if "mesh" in PARTS:
            control = cluster.Control(net, artifacts / "control.log")
            guests = [vm.Guest(img, net, f"bench{i}", 70 + i, accel, artifacts) for i in (0, 1)]
            cluster.each(lambda g: g.wait_up(400), guests)
            nodes = [lane.Node(g, ctx) for g in guests]
            cluster.each(lambda n: n.install(None), nodes)
            cluster.join(nodes, control.hello)
            mesh_rows(guests, control)
        for g in guests:
            g.stop()
        if "boot" not in PARTS:
            return 0
        g = vm.Guest(img, net, "bench-boot", 72, accel, artifacts)
        guests.append(g)
        g.wait_up(400)
        boot_rows(ctx, g)
    except (vm.CaseFailed, vm.GuestError) as e:
        for g in guests:
            g.keep_journal()
        vm.say(f"vm bench failed: {e}; logs under {artifacts}")
        return 1
    finally:
        if control is not None:
            control.close()
        for g in guests:
            g.stop()
        net.close()
    shutil.rmtree(artifacts, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

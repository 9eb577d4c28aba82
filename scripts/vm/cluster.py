"""The VM lane's cluster case (issue 43.2f): three guests with the .deb join
the test control plane with kernel WireGuard.

The control plane is the one the in-namespace cluster tests use, served by
`tests/vm_control.rs` on two control hosts (namespaces of their own on the
lane's bridge, each with a userspace WireGuard device); this file drives
the guests and asks it what it saw, in JSON lines.
"""
import json
import os
import subprocess
import threading
import time

import guest as vm
from guest import CaseFailed, expect

HERE = vm.Path(__file__).resolve().parents[2]
SERVER = ["cargo", "test", "--locked", "--test", "vm_control", "--"]
WG_PORT = 51820
# web on one guest, reached from a client on another as web.internal.
WEB = {"id": "web1", "env": "env-web", "slot": 50, "app": "app-web", "http_port": 80,
       "command": "httpd -f -p 80 -h /var/www", "vars": {"ZATTERA_ENV": "prod"}}
CLIENT = {"id": "cli1", "env": "env-cli", "slot": 51, "app": "app-cli",
          "command": "sleep 100000", "vars": {"ZATTERA_ENV": "prod"}}
VIP = "10.97.0.9"
CONTROL_IPS = ["10.90.0.1", "10.90.0.2"]
FETCH = "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 web.internal 80"


class Control:
    """The test control plane, as a process answering JSON lines."""

    def __init__(self, net, log):
        self.log = open(log, "ab")
        env = dict(os.environ, ZATTERA_VM_NS=net.ns, ZATTERA_VM_BRIDGE=net.bridge,
                   ZATTERA_VM_NET=vm.NET_PREFIX)
        # Built first, so the guests do not share the cores with rustc.
        subprocess.run([*SERVER[:-1], "--no-run"], cwd=HERE, check=True,
                       stdout=self.log, stderr=self.log, timeout=1800)
        self.proc = subprocess.Popen(
            [*SERVER, "--ignored", "--exact", "serve_the_vm_lane", "--nocapture"],
            cwd=HERE, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True)
        self.hello = self._answer()

    def _answer(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise vm.GuestError(f"the test control plane ended; its log: {self.log.name}")
            if line.startswith("@ "):
                return json.loads(line[2:])

    def call(self, op, **args):
        self.proc.stdin.write(json.dumps(dict(op=op, **args)) + "\n")
        self.proc.stdin.flush()
        out = self._answer()
        if "error" in out:
            raise CaseFailed(f"control plane, {op}: {out['error']}")
        return out

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def each(f, items):
    """`f` on every item at once (guests boot and install in parallel);
    the first exception is raised."""
    errors = []

    def run(x):
        try:
            f(x)
        except Exception as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(x,)) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def mesh(g):
    out = g.sh("zattera-netns mesh --json", check=False)
    try:
        return json.loads(out.stdout) if out.returncode == 0 else {}
    except json.JSONDecodeError:
        return {}


def join(nodes, hello):
    """Points each node's agent at the control plane with the join token
    and its guest's address as the mesh endpoint, and starts it."""
    for n in nodes:
        n.g.sh("cat >> /etc/zattera/agent.toml <<EOF\n"
               f"control = \"{hello['control']}\"\n"
               f"join-token = \"{hello['token']}\"\n"
               f"mesh-endpoints = [\"{n.g.ip}:{WG_PORT}\"]\nEOF")
    each(lambda n: n.g.sh("systemctl enable --now zattera-agent", timeout=300), nodes)


def peers_of(g, workers):
    """The mesh IPs `g` has as peers: the other workers and both controls."""
    return [w["mesh_ip"] for w in workers if not w["endpoint"].startswith(f"{g.ip}:")] + CONTROL_IPS


def shaken(g, others):
    """Whether `g`'s device has a handshake with every peer, pinging each
    (a handshake happens on the first packet)."""
    for ip in others:
        g.sh(f"busybox ping -c1 -W1 {ip}", check=False)
    peers = mesh(g).get("peers", [])
    return len(peers) == len(others) and all(
        p.get("latest_handshake_seconds_ago") is not None for p in peers)


def eventually(what, f, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if f():
            return
        time.sleep(2)
    raise CaseFailed(f"not {what} within {timeout} s")


def exec_in(g, cid, command, n=[0]):  # noqa: B006 (a counter for exec ids)
    n[0] += 1
    return g.sh(f"ctr -n zattera task exec --exec-id lane{n[0]} {cid} sh -c {json.dumps(command)}",
                check=False, timeout=60)


def case_cluster(ctx, first, node_of):
    """`first` is booted; `node_of(guest)` makes a lane Node of a guest."""
    guests = [first] + [vm.Guest(ctx.img, ctx.net, f"cluster{i}-{ctx.suite}", 40 + i, ctx.accel,
                                 ctx.artifacts) for i in (1, 2)]
    control = None
    try:
        control = Control(ctx.net, first.dir / "control.log")
        each(lambda g: g.wait_up(400), guests[1:])
        nodes = [node_of(g) for g in guests]
        each(lambda n: n.install(None), nodes)
        join(nodes, control.hello)
        t0 = time.time()
        workers = control.call("workers", count=3, timeout=300)["workers"]
        ctx.facts["cluster: unit start to 3 workers synced"] = f"{time.time() - t0:.0f} s"
        by_ip = {w["endpoint"].split(":")[0]: w for w in workers}
        a, b, c = (by_ip[g.ip] for g in guests)
        ga, gb, gc = guests

        # Kernel WireGuard on every guest, with a handshake with each peer
        # (both control hosts and the two other workers).
        for g in guests:
            eventually(f"{g.name}: 4 peers with a handshake", lambda g=g: shaken(g, peers_of(g, workers)), 120)
            m = mesh(g)
            expect(m.get("backend") == "kernel", f"{g.name}: the mesh backend is {m.get('backend')}")
            expect(g.ok("test -d /sys/module/wireguard"), f"{g.name}: no wireguard module")
        ctx.facts["cluster: mesh backend"] = "kernel (3 guests)"
        for g in guests:
            for ip in peers_of(g, workers):
                expect(g.ok(f"busybox ping -c1 -W5 {ip}"), f"{g.name}: no ping to {ip}")

        # web on B, a client on A: web.internal -> VIP -> B's port over the
        # mesh, and nothing but WireGuard between the guests.
        control.call("push", node=b["node_id"], assignments=[WEB])
        control.call("push", node=a["node_id"], assignments=[CLIENT])
        web = control.call("state", assignment="web1", state="HEALTHY", timeout=300)
        cli = control.call("state", assignment="cli1", state="RUNNING", timeout=300)
        port = web["mesh_port_bindings"]["http"]
        control.call("route", version=2, fqdn="web.prod.proj.internal.", env="env-web", vip=VIP,
                     assignment="web1", node=b["node_id"], endpoint=f"{b['mesh_ip']}:{port}")
        pcap = first.dir / "bridge.pcap"
        # --immediate-mode: each packet reaches tcpdump at once, not in
        # blocks the kernel retires after a second (lost at a SIGTERM).
        capture = subprocess.Popen(ctx.net.exec(["tcpdump", "-i", ctx.net.bridge, "-n", "-U",
                                                 "--immediate-mode", "-w", str(pcap)]),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        try:
            eventually("web.internal from A's client", lambda: "hello from zattera" in exec_in(
                ga, cli["container_id"], FETCH).stdout, 120)
        finally:
            time.sleep(1)
            capture.terminate()
            capture.wait()
        between = f"ip and not host {vm.GATEWAY}"

        def read(f):
            out = subprocess.run(["tcpdump", "-n", "-r", str(pcap), f], capture_output=True, text=True)
            return out.stdout.splitlines()
        wireguard = read(f"{between} and udp port {WG_PORT}")
        clear = read(f"{between} and not (udp src port {WG_PORT} and udp dst port {WG_PORT})")
        ctx.facts["cluster: capture on the bridge"] = f"{len(wireguard)} WireGuard packets, {len(clear)} others"
        expect(wireguard, "the capture saw no WireGuard")
        expect(not clear, "traffic in clear between the guests: " + "\n".join(clear[:20]))

        # The leader moves: every stream follows it, and reports reach it.
        control.call("move_leader", node="ctl-2")
        for w in (a, b, c):
            control.call("sessions", node=w["node_id"], host="ctl-2", timeout=120)
        eventually("every guest's mesh names ctl-2 the leader",
                   lambda: all(mesh(g).get("leader_node_id") == "ctl-2" for g in guests), 120)
        time.sleep(5)  # what the new streams resend lands before the mark
        mark = control.call("frames")["frames"]

        # B reboots: it syncs with the leader again, web is adopted (same
        # container), HEALTHY again, and reached from A again.
        before = node_of(gb).created()
        t0 = time.time()
        gb.reboot("reboot")
        control.call("sessions", node=b["node_id"], host="ctl-2", after=1, timeout=400)
        again = control.call("state", assignment="web1", state="HEALTHY", host="ctl-2", since=mark,
                             timeout=400)
        ctx.facts["cluster: reboot to web HEALTHY on the new leader (TCG)"] = f"{time.time() - t0:.0f} s"
        expect(again["container_id"] == web["container_id"],
               f"web was replaced across the reboot: {web['container_id']} -> {again['container_id']}")
        expect(node_of(gb).created() == before,
               f"B's containers were re-created across the reboot: {before} -> {node_of(gb).created()}")
        expect(mesh(gb).get("backend") == "kernel", "B's mesh is not kernel after the reboot")
        s = node_of(gb).status() or {}
        expect([r.get("state") for r in s.get("assignments", [])] == ["HEALTHY"],
               f"B's status after the reboot: {s}")
        eventually("web.internal from A's client after B's reboot", lambda: "hello from zattera" in exec_in(
            ga, cli["container_id"], FETCH).stdout, 180)
    except Exception:
        for g in guests[1:]:
            g.keep_journal()
        vm.say(f"  other guests' logs: {', '.join(str(g.dir) for g in guests[1:])}")
        vm.hold(guests)
        raise
    finally:
        if control is not None:
            control.close()
        for g in guests[1:]:
            g.stop()

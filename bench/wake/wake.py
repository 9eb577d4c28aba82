"""Wake (issue 59): a cold start of an app with a health check, timed as a
user waits for it.

The release agent runs standalone (its own containerd namespace, bridge
prefix ztwk, subnet slot 152). Each round writes a manifest for a new app
whose server answers 0.3 s after its start, HTTP-checked with the default
interval (10 s), and polls every 10 ms: the agent's status over its admin
socket, and a TCP connect to the instance's port once it has an IP. It
records when the port first answered and when status said HEALTHY. Then
one adoption: the agent restarted (SIGTERM, which leaves the containers
running) and the time from its start to HEALTHY again.

The peer is the same container started with `ctr run -d --net-host` (no
network of its own to set up) and its port polled every 10 ms: what a
container start and the app's own 0.3 s cost with nothing of the agent's.

Goals (issue 59): port answering to HEALTHY at most 0.5 s (p50); manifest
to HEALTHY at most 1 s (p50). Prints ROW lines for bench/report.py and
writes bench/wake/results/<time>.json. Everything it makes is removed,
also on failure; no traffic leaves the host.
"""

import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib"))
from standalone_agent import ARCHIVE, IMAGE, Agent, ctr, status  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
TAG = str(os.getpid())
NS = f"zt-bench-wk-{TAG}"
NS_CTR = f"zt-bench-wkc-{TAG}"
POLL = 0.01
PEER_PORT = 18931
SERVE = "sleep 0.3; exec httpd -f -p {port} -h /var/www"


def say(msg):
    print(f"bench/wake: {msg}", file=sys.stderr, flush=True)


def row_of(snap, app):
    return next((r for r in snap.get("assignments", []) if r["app"] == app), None)


def answers(ip, port):
    try:
        with socket.create_connection((ip, port), timeout=0.05):
            return True
    except OSError:
        return False


def manifest(app):
    return f"""[app]
name = "{app}"
project = "ztwake"

[build]
type = "image"
image = "{IMAGE}"

[deploy.healthcheck]
type = "http"
path = "/"

[env.production]
command = "{SERVE.format(port=80)}"
stop_grace = "1s"

[[env.production.ports]]
name = "http"
container_port = 80
protocol = "http"
"""


def watch(agent, app, t0, healthy_only=False):
    """Polls until `app` is HEALTHY; returns (port answered, HEALTHY), seconds after t0."""
    port_at = None
    deadline = t0 + 60
    while time.monotonic() < deadline:
        try:
            row = row_of(status(agent.run_dir), app)
        except (OSError, ValueError):
            row = None
        now = time.monotonic()
        if row and row["state"] == "HEALTHY":
            return port_at, now - t0
        if row and row["state"] == "FAILED":
            raise SystemExit(f"bench/wake: {app} FAILED: {row['message']}")
        if port_at is None and not healthy_only and row and row.get("ip") and answers(row["ip"], 80):
            port_at = time.monotonic() - t0
        time.sleep(POLL)
    raise SystemExit(f"bench/wake: {app} not HEALTHY within 60 s: {agent.tail()}")


def wait_gone(agent, app):
    """Until the app's row and its container are gone: each round is a cold
    start on an idle node, not one behind the last round's removal."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if row_of(status(agent.run_dir), app) is None and not ctr("-n", NS, "containers", "ls", "-q").stdout.split():
            return
        time.sleep(0.1)
    raise SystemExit(f"bench/wake: {app} was not removed within 60 s")


def peer_round(i):
    name = f"wake-peer-{i}"
    t0 = time.monotonic()
    ctr("-n", NS_CTR, "run", "-d", "--net-host", IMAGE, name, "sh", "-c", SERVE.format(port=PEER_PORT))
    deadline = t0 + 60
    while not answers("127.0.0.1", PEER_PORT):
        if time.monotonic() > deadline:
            raise SystemExit("bench/wake: the peer's port never answered")
        time.sleep(POLL)
    took = time.monotonic() - t0
    ctr("-n", NS_CTR, "tasks", "kill", "-s", "SIGKILL", name, check=False)
    for _ in range(100):
        if ctr("-n", NS_CTR, "tasks", "rm", name, check=False).returncode == 0:
            break
        time.sleep(0.1)
    ctr("-n", NS_CTR, "containers", "rm", name, check=False)
    return took


def p50(values):
    return statistics.median(values)


def main():
    agent = Agent(tempfile.mkdtemp(prefix="zt-bench-wk."), NS, "ztwk", "152-152")
    try:
        agent.import_image()
        ctr("-n", NS_CTR, "images", "import", ARCHIVE)
        agent.start()
        agent.wait_ready()
        to_healthy, port_to_healthy = [], []
        for i in range(ROUNDS):
            app = f"wake{i}"
            t0 = agent.write_manifest(f"{app}.toml", manifest(app))
            port_at, healthy_at = watch(agent, app, t0)
            to_healthy.append(healthy_at)
            if port_at is not None:
                port_to_healthy.append(max(0.0, healthy_at - port_at))
            say(f"round {i + 1}: port answered {port_at if port_at is None else round(port_at, 3)} s, "
                f"HEALTHY {healthy_at:.3f} s after the manifest")
            if i + 1 < ROUNDS:
                os.remove(os.path.join(agent.manifests, f"{app}.toml"))
                wait_gone(agent, app)
        # Adoption: the last app stays; the agent restarts under it.
        agent.stop()
        t0 = agent.start()
        _, adopted = watch(agent, f"wake{ROUNDS - 1}", t0, healthy_only=True)
        say(f"agent restart: HEALTHY {adopted:.3f} s after the agent's start (adopted)")
        peer = [peer_round(i) for i in range(ROUNDS)]
        say(f"peer (ctr run -d --net-host, port polled): {', '.join(f'{p:.3f}' for p in peer)} s")
    finally:
        agent.remove([NS_CTR])
    doc = {
        "rounds": ROUNDS,
        "manifest_to_healthy_s": to_healthy,
        "port_to_healthy_s": port_to_healthy,
        "restart_to_healthy_s": adopted,
        "peer_ctr_run_to_port_s": peer,
    }
    out = os.path.join(ROOT, "bench", "wake", "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, time.strftime("%Y%m%d-%H%M%S") + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
    a, p = p50(to_healthy) * 1000, p50(peer) * 1000
    print(f"ROW wake | manifest to HEALTHY, app ready 0.3 s after start, 10 s interval, p50 ms | {a:.0f} | "
          f"ctr run -d --net-host to its port answering | {p:.0f} | {a / p:.2f} | <= 1000 ms | "
          f"{'met' if a <= 1000 else 'MISSED'}")
    if port_to_healthy:
        g = p50(port_to_healthy) * 1000
        print(f"ROW wake | port answering to HEALTHY, p50 ms (spread {min(port_to_healthy) * 1000:.0f}-"
              f"{max(port_to_healthy) * 1000:.0f}) | {g:.0f} | - | - | - | <= 500 ms | {'met' if g <= 500 else 'MISSED'}")
    print(f"ROW wake | agent restart to HEALTHY (adopted instance), ms | {adopted * 1000:.0f} | - | - | - | - | -")


if __name__ == "__main__":
    main()

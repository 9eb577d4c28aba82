"""Scale (issue 59): COUNT (1,000) instances on one node, as deployed.

The release agent runs standalone (namespace zt-bench-sc-<pid>, bridges
ztsc*, subnet slots 160-163) with COUNT sleeping busybox instances in four
projects (one environment each: a /24 holds 253), no health check. It
measures:
- the cold converge: the manifests written to every instance RUNNING or
  HEALTHY (status polled every 0.25 s);
- at rest, SETTLE (20) s after the converge, over WINDOW (60) s: the agent's
  CPU (% of one core) and RSS; the node memory per instance (PSS of the
  agent's growth over itself with nothing to run, containerd's growth, every
  shim of the namespace and every log shim of the run, over COUNT);
- `status --json` latency (the CLI, 5 runs, p50), the status document's
  size, the nft table's rule count, the routes and conntrack entries;
- adoption: the agent restarted (SIGTERM: the containers keep running) to
  every instance up again;
- a full desired-set change: every manifest's command edited, to every
  instance replaced and up again.

The peer is PEER_COUNT (COUNT) sequential `ctr run -d` of the same
container in its own empty network namespace (no bridge, no log shim: a
lower bound the agent's converge is compared with).

Goals (issue 59): converge at most 0.4 of sequential `ctr run`; agent RSS
at most 64 MiB; agent CPU at rest at most 2 % of one core; node memory per
instance at most 1.5 MiB. Prints ROW lines for bench/report.py and writes
bench/scale/results/<time>.json. Everything it makes is removed, also on
failure; no traffic leaves the host.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib"))
from standalone_agent import AGENT, ARCHIVE, IMAGE, Agent, ctr, status  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNT = int(os.environ.get("COUNT", "1000"))
PEER_COUNT = int(os.environ.get("PEER_COUNT", str(COUNT)))
SETTLE = float(os.environ.get("SETTLE", "20"))
WINDOW = float(os.environ.get("WINDOW", "60"))
PROJECTS = 4
TAG = str(os.getpid())
NS = f"zt-bench-sc-{TAG}"
NS_CTR = f"zt-bench-scc-{TAG}"
HZ = os.sysconf("SC_CLK_TCK")


def say(msg):
    print(f"bench/scale: {msg}", file=sys.stderr, flush=True)


def manifest(project, replicas, command):
    return f"""[app]
name = "sleeper"
project = "{project}"

[build]
type = "image"
image = "{IMAGE}"

[env.production]
replicas = {replicas}
command = "{command}"
stop_grace = "1s"
"""


def write_all(agent, command):
    share = [COUNT // PROJECTS + (1 if i < COUNT % PROJECTS else 0) for i in range(PROJECTS)]
    t0 = None
    for i, n in enumerate(share):
        at = agent.write_manifest(f"p{i}.toml", manifest(f"ztscale{i}", n, command))
        t0 = t0 or at
    return t0


def up_ids(agent):
    """The container ids of the instances up, and how many rows there are."""
    try:
        rows = status(agent.run_dir, timeout=30).get("assignments", [])
    except (OSError, ValueError):  # not listening yet (a restart)
        return set(), 0
    return {r["container_id"] for r in rows if r["state"] in ("RUNNING", "HEALTHY")}, len(rows)


def wait_up(agent, t0, what, replacing=frozenset(), within=1200):
    """Seconds from t0 to every instance up (none of them one of `replacing`)."""
    while True:
        ids, total = up_ids(agent)
        n = len(ids - replacing)
        if n == COUNT and total == COUNT:
            return time.monotonic() - t0
        if time.monotonic() - t0 > within:
            raise SystemExit(f"bench/scale: {what}: {n} of {COUNT} up after {within} s: {agent.tail()}")
        if agent.proc.poll() is not None:
            raise SystemExit(f"bench/scale: the agent exited: {agent.tail()}")
        time.sleep(0.25)


def pids(kind, work):
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if kind == "shims" and "containerd-shim-runc-v2" in cmd and f"-namespace {NS} " in cmd:
            out.append(int(p))
        elif kind == "logs" and "zattera-log" in cmd and work in cmd:
            out.append(int(p))
    return out


def pss_kib(pid_list):
    total = 0
    for p in pid_list:
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def ticks(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def profile_start():
    """With PROFILE=DIR, a whole-machine CPU profile of the window at rest
    (perf, cpu-clock at 997 Hz); written to DIR/rest.data and DIR/rest.txt."""
    out = os.environ.get("PROFILE")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    return out, subprocess.Popen(["perf", "record", "-q", "-a", "-g", "-e", "cpu-clock", "-F", "997", "-o",
                                  os.path.join(out, "rest.data")], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)


def profile_stop(perf, pid):
    if perf is None:
        return
    out, proc = perf
    proc.send_signal(2)
    proc.wait()
    data = os.path.join(out, "rest.data")
    report = lambda *a: subprocess.run(["perf", "report", "-i", data, "--no-children", "-g", "none", "--stdio",
                                        *a], capture_output=True, text=True).stdout
    with open(os.path.join(out, "rest.txt"), "w") as f:
        f.write("== CPU samples at rest by command\n" + report("--sort", "comm") + "\n")
        f.write("== the agent's samples (every thread) by symbol\n" + report("--pid", str(pid), "--sort", "dso,symbol"))
    say(f"profile at rest: {out}/rest.txt")


def containerd_pid():
    run = os.environ.get("ZATTERA_RIG_RUN", "/run/zattera-rig")
    return int(open(os.path.join(run, "containerd.pid")).read())


def kernel_state(agent):
    table = "zattera_" + NS.replace("-", "_")
    rules = subprocess.run(["nft", "-a", "list", "table", "inet", table], capture_output=True, text=True).stdout
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    try:
        conntrack = int(open("/proc/sys/net/netfilter/nf_conntrack_count").read())
    except OSError:
        conntrack = -1
    return {
        "nft_rules": sum(1 for line in rules.splitlines() if "# handle" in line and "chain " not in line),
        "routes": len(routes.splitlines()),
        "conntrack": conntrack,
    }


def peer_converge():
    t0 = time.monotonic()
    for i in range(PEER_COUNT):
        ctr("-n", NS_CTR, "run", "-d", IMAGE, f"scale-peer-{i}", "sleep", "100000")
    return time.monotonic() - t0


def main():
    agent = Agent(tempfile.mkdtemp(prefix="zt-bench-sc."), NS, "ztsc", "160-163")
    doc = {"count": COUNT, "peer_count": PEER_COUNT}
    try:
        agent.import_image()
        ctr("-n", NS_CTR, "images", "import", ARCHIVE)
        ctd = containerd_pid()
        ctd_base = pss_kib([ctd])
        agent.start()
        agent.wait_ready()
        time.sleep(3)
        agent_idle = pss_kib([agent.proc.pid])
        t0 = write_all(agent, "sleep 100000")
        doc["converge_s"] = wait_up(agent, t0, "cold converge")
        say(f"cold converge of {COUNT}: {doc['converge_s']:.1f} s")
        time.sleep(SETTLE)
        perf = profile_start()
        a0, w0 = ticks(agent.proc.pid), time.monotonic()
        time.sleep(WINDOW)
        a1, w1 = ticks(agent.proc.pid), time.monotonic()
        profile_stop(perf, agent.proc.pid)
        doc["agent_cpu_pct"] = 100.0 * (a1 - a0) / HZ / (w1 - w0)
        doc["agent_rss_mib"] = rss_kib(agent.proc.pid) / 1024
        shims, logs = pids("shims", agent.work), pids("logs", agent.work)
        groups = {
            "agent": max(0, pss_kib([agent.proc.pid]) - agent_idle),
            "containerd": max(0, pss_kib([ctd]) - ctd_base),
            "shims": pss_kib(shims),
            "log shims": pss_kib(logs),
        }
        doc["pss_kib"] = groups
        doc["processes"] = {"shims": len(shims), "log shims": len(logs)}
        doc["node_mib_per_instance"] = sum(groups.values()) / 1024 / COUNT
        say(f"at rest: agent CPU {doc['agent_cpu_pct']:.2f} % of a core, RSS {doc['agent_rss_mib']:.1f} MiB; "
            f"node PSS per instance {doc['node_mib_per_instance']:.2f} MiB {groups} ({len(shims)} shims, "
            f"{len(logs)} log shims)")
        lat = []
        for _ in range(5):
            s = time.monotonic()
            out = subprocess.run([AGENT, "--run-dir", agent.run_dir, "status", "--json"], capture_output=True)
            lat.append(time.monotonic() - s)
        doc["status_json_ms_p50"] = statistics.median(lat) * 1000
        doc["status_json_bytes"] = len(out.stdout)
        doc["kernel"] = kernel_state(agent)
        say(f"status --json p50 {doc['status_json_ms_p50']:.0f} ms ({len(out.stdout)} bytes); {doc['kernel']}")
        agent.stop()
        t0 = agent.start()
        doc["adopt_s"] = wait_up(agent, t0, "adoption")
        say(f"adoption after a restart: {doc['adopt_s']:.1f} s")
        before, _ = up_ids(agent)
        t0 = write_all(agent, "sleep 100001")
        doc["change_s"] = wait_up(agent, t0, "a full change", replacing=frozenset(before))
        say(f"full desired-set change (every instance replaced): {doc['change_s']:.1f} s")
        agent.stop()
        doc["peer_converge_s"] = peer_converge()
        say(f"peer: {PEER_COUNT} sequential ctr run -d: {doc['peer_converge_s']:.1f} s")
    finally:
        agent.remove([NS_CTR])
    out_dir = os.path.join(ROOT, "bench", "scale", "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, time.strftime("%Y%m%d-%H%M%S") + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
    peer = doc["peer_converge_s"] * COUNT / PEER_COUNT
    r = doc["converge_s"] / peer
    print(f"ROW scale | cold converge of {COUNT:,}, s | {doc['converge_s']:.1f} | sequential ctr run -d | "
          f"{peer:.1f} | {r:.2f} | <= 0.4 | {'met' if r <= 0.4 else 'MISSED'}")
    c = doc["agent_cpu_pct"]
    print(f"ROW scale | agent CPU at rest, {COUNT:,} instances, % of a core | {c:.2f} | - | - | - | <= 2 % | "
          f"{'met' if c <= 2 else 'MISSED'}")
    m = doc["agent_rss_mib"]
    print(f"ROW scale | agent RSS, {COUNT:,} instances, MiB | {m:.1f} | - | - | - | <= 64 MiB | "
          f"{'met' if m <= 64 else 'MISSED'}")
    n = doc["node_mib_per_instance"]
    print(f"ROW scale | node memory per instance at {COUNT:,} (PSS), MiB | {n:.2f} | - | - | - | <= 1.5 MiB | "
          f"{'met' if n <= 1.5 else 'MISSED'}")
    print(f"ROW scale | adoption after an agent restart, {COUNT:,} instances, s | {doc['adopt_s']:.1f} | "
          f"cold converge | {doc['converge_s']:.1f} | {doc['adopt_s'] / doc['converge_s']:.2f} | - | -")
    print(f"ROW scale | full desired-set change, {COUNT:,} instances replaced, s | {doc['change_s']:.1f} | "
          f"cold converge | {doc['converge_s']:.1f} | {doc['change_s'] / doc['converge_s']:.2f} | - | -")
    print(f"ROW scale | status --json, {COUNT:,} instances, p50 ms | {doc['status_json_ms_p50']:.0f} | - | - | - | - | -")


if __name__ == "__main__":
    main()

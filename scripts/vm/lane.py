#!/usr/bin/env python3
"""The VM lane: the agent as it is really installed, on real Debian guests
that boot with systemd, cgroup v2 and kernel WireGuard.

Each case boots a fresh guest from a cached image (Debian's packages only,
see guest.py), installs dist/zattera-agent_*.deb in it with apt, and checks
what a user of a packaged node relies on.

    scripts/vm/lane.py [--suite bookworm --suite trixie --suite forky] [CASE ...]
    scripts/vm/lane.py image SUITE     build (or show) a cached image
    scripts/vm/lane.py clean           remove what killed runs left

Suites: bookworm (Debian 12), trixie (13) and forky (14, testing: its
Release is read past its Valid-Until). Cases (default: all on bookworm;
install and restart on trixie; install and reboot on forky):
    install   apt install, doctor on cgroup v2, the unit to HEALTHY (active
              only once ready), the journal, an OOM kill as FAILED "out of
              memory (limit N MiB)", purge
    restart   systemctl restart and an upgrade to a newer .deb: no task pid
              changes, a failing health check never reads HEALTHY, the
              edited agent.toml is kept
    reboot    systemctl reboot with a published port, DNS and a volume in
              use, then poweroff and a cold boot: every instance comes back,
              nothing from before is left, the SIGTERM trap of a container
              wrote into its volume both times; reports boot to all HEALTHY
    cluster   three guests join the test control plane (tests/vm_control.rs,
              on the host side of the bridge) with kernel WireGuard: a
              client on one reaches web.internal -> VIP -> a port on another
              over the mesh, with only WireGuard on the bridge; the leader
              moves and the streams follow; a guest reboots, rejoins, and
              its container is adopted, not replaced
    docker    a node with Docker's package layout: containerd.io (made in
              the guest from the suite's containerd and runc, providing,
              conflicting with and replacing both, unversioned) and a
              docker-ce that depends on it; apt installs the agent with
              nothing removed, doctor names containerd.io, the web app
              reaches HEALTHY on its containerd, Docker's namespace stays
    powercut  power cuts (58) on one guest whose disk keeps only what the
              guest flushed (qemu's cache=writeback): qemu SIGKILLed, then a
              cold boot, four times. 2-10 s after an image import (seeded;
              the seed is printed): a manifest on the image's own 4 MiB
              layer runs, the layer whole; at the first log rotation of a
              fast writer: every rotated segment decodes (zstd, on the
              host), `logs` works, and the log janitor's sweep past its
              grace leaves each segment holding what it did; right after a
              copy-up into a fresh volume (the instance RUNNING): the
              volume holds the image's files whole; right after an
              upgrade: the package's files match their sums. After each:
              every service HEALTHY, `status` works and says the last run
              ended without a clean stop. No job cut: standalone manifests
              have no jobs (only control assigns them)

As root, after scripts/package.sh. A failed case keeps its guest's console
log and journal under the run's directory, which the output names.
    ZATTERA_VM_ACCEL=tcg|kvm   skip the KVM probe
    ZATTERA_VM_KEEP=1          keep every case's directory
    ZATTERA_VM_HOLD=SECS       keep a failed case's guests up that long (ssh to them)
    ZATTERA_VM_SEED=N          the powercut case's seed (its cut times)
"""
import argparse
import contextlib
import gzip
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import guest as vm  # noqa: E402
import cluster  # noqa: E402
from guest import CaseFailed, expect  # noqa: E402

HERE = Path(__file__).resolve().parents[2]
HOST_TOOLS = ["qemu-system-x86", "qemu-utils", "mmdebstrap", "e2fsprogs", "openssh-client",
              "iproute2", "busybox-static", "procps", "tcpdump", "zstd"]
# CI's set, kept so the whole run stays well under an hour (about 23 min of
# TCG here, after about 28 min of build, tests, fuzz and packages); the
# cgroup and docker cases and forky are run by hand (README, Tests), each
# passing on 2026-12-07.
DEFAULT_CASES = {"bookworm": ["install", "restart", "reboot", "cluster", "powercut"],
                 "trixie": ["install"],
                 "forky": []}
# The guest disk's qemu cache mode, by case (guest.Guest): "unsafe" unless a
# case cuts the power, where what the guest flushed must survive a SIGKILL.
DISK_CACHE = {"powercut": "writeback"}
# Under TCG a guest is 5-20x slower than this host: generous bounds.
HEALTHY_WITHIN = 300

INSTALLED = [
    "/usr/bin/zattera-agent", "/usr/bin/zattera-netns", "/usr/lib/zattera/zattera-logshim",
    "/etc/zattera/agent.toml",
    "/usr/lib/systemd/system/zattera-agent.service", "/usr/share/man/man1/zattera-agent.1.gz",
    "/usr/share/man/man1/zattera-netns.1.gz", "/usr/share/bash-completion/completions/zattera-agent",
    "/usr/share/zsh/vendor-completions/_zattera-agent",
    "/usr/share/fish/vendor_completions.d/zattera-agent.fish",
]
WEB = (HERE / "examples/web.toml").read_text()
def app(name, command, more="", image="docker.io/zattera/busybox:test"):
    """A manifest of app `name` (project demo, env production) running
    `command` in `image` (the busybox test image); `more` is appended TOML."""
    return (f'[app]\nname = "{name}"\nproject = "demo"\n'
            f'[build]\ntype = "image"\nimage = "{image}"\n'
            f'[env.production]\ncommand = {json.dumps(command)}\n{more}')


SLEEP = "trap 'exit 0' TERM; while true; do sleep 1; done"
# Always failing its health check.
FAILING = app("sick", SLEEP, 'stop_grace = "2s"\n'
              '[deploy.healthcheck]\ntype = "exec"\ncommand = "false"\ninterval = "2s"\n')
# The main process over its memory limit, then a child (not the main
# process) over it.
HOG = app("hog", "exec dd if=/dev/zero of=/dev/null bs=64M count=1",
          "[env.production.resources]\nmemory_mb = 16\n")
CHILD_HOG = app("childhog", "dd if=/dev/zero of=/dev/null bs=64M count=1; sleep 3600",
                "[env.production.resources]\nmemory_mb = 16\n")
# A fork bomb under a pids limit of 128, and a spinner under half a core.
BOMB = app("bomb", "b() { b | b & }; b; sleep 3600",
           "[env.production.resources]\npids = 128\ncpu_millis = 200\n")
SPIN = app("spin", "x=$(head -c 8388608 /dev/zero | tr '\\0' a); while :; do :; done",
           "[env.production.resources]\ncpu_millis = 500\nmemory_mb = 64\n")
# Writes a line into its volume when stopped: proof of a graceful stop.
KEEPER = app("keeper", "trap 'echo stopped >> /data/stops; exit 0' TERM; echo started >> /data/starts; "
             "while true; do sleep 1; done",
             'stop_grace = "10s"\n[[env.production.volumes]]\nname = "data"\nmount_path = "/data"\n')


def host_tools():
    missing = [p for p in HOST_TOOLS if subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True
    ).stdout.find("ok installed") < 0]
    if missing:
        vm.say(f"installing {' '.join(missing)} on the host")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                       check=True, env=env, stdout=subprocess.DEVNULL)


def packages():
    dist = HERE / "dist"
    debs = sorted(p for p in dist.glob("zattera-agent_*_amd64.deb") if "+fresh" not in p.name)
    upgrades = sorted(dist.glob("zattera-agent_*+fresh*_amd64.deb"))
    if not debs or not upgrades:
        raise SystemExit("vm lane: no dist/zattera-agent_*.deb (and its +fresh upgrade); "
                         "run scripts/package.sh first")
    return debs[-1], upgrades[-1]


def test_image(work):
    """The busybox OCI archive the manifests run (no registry in a guest)."""
    out = work / "images"
    if not (out / "busybox-oci.tar").exists():
        subprocess.run([sys.executable, str(HERE / "scripts/mkimage.py"), str(out)], check=True,
                       stdout=subprocess.DEVNULL)
    return out / "busybox-oci.tar"


class Node:
    """A guest with the agent's package installed (by `install`)."""

    def __init__(self, g, ctx):
        self.g = g
        self.ctx = ctx
        self.copied = False
        self.status_error = None

    def put_packages(self):
        """The .deb, its upgrade and the test image, in /root."""
        if self.copied:
            return
        g = self.g
        g.put(self.ctx.deb, f"/root/{self.ctx.deb.name}")
        g.put(self.ctx.upgrade, f"/root/{self.ctx.upgrade.name}")
        g.put(self.ctx.image, "/root/busybox-oci.tar")
        self.copied = True

    def install(self, manifests):
        """The .deb, the test image, and `manifests` (name: text) in
        /etc/zattera/manifests; `None`: no manifests (a cluster node)."""
        g = self.g
        self.put_packages()
        g.sh(f"DEBIAN_FRONTEND=noninteractive apt-get install -y -q /root/{self.ctx.deb.name}",
             timeout=600)
        if manifests is not None:
            g.sh("mkdir -p /etc/zattera/manifests")
            for name, text in manifests.items():
                g.write(f"/etc/zattera/manifests/{name}", text)
            g.sh("echo 'manifests = \"/etc/zattera/manifests\"' >> /etc/zattera/agent.toml")
        g.sh("zattera-agent image import /root/busybox-oci.tar", timeout=600)

    def status(self):
        """`status --json` as the agent answered; None when it answered
        with an error (kept in `status_error`). A lost ssh connection
        (exit 255) is retried for a while, then is the guest's failure,
        never the agent's."""
        for attempt in range(6):
            out = self.g.sh("zattera-agent status --json", timeout=60, check=False)
            if out.returncode != 255:
                break
            time.sleep(5)
        else:
            raise vm.GuestLost(f"{self.g.name}: ssh stopped answering: {out.stderr.strip()[-500:]}")
        if out.returncode != 0:
            self.status_error = f"exit {out.returncode}: {(out.stdout + out.stderr).strip()[-1000:]}"
            return None
        try:
            return json.loads(out.stdout)
        except json.JSONDecodeError:
            return None

    def states(self):
        s = self.status() or {}
        return {(r.get("app"), r.get("id")): r for r in s.get("assignments", [])}

    def wait(self, what, done, timeout=HEALTHY_WITHIN):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            s = self.status()
            if s is not None:
                last = s
                if done(s):
                    return s
            time.sleep(2)
        raise CaseFailed(f"not {what} within {timeout} s; last status: {json.dumps(last)[:3000]}")

    def created(self):
        """Each container's id with the time containerd created it: the
        same after a reboot when the agent adopted it, not re-created it."""
        out = self.g.sh("for c in $(ctr -n zattera containers ls -q); do "
                        "echo \"$c $(ctr -n zattera containers info $c | grep -m1 CreatedAt)\"; done",
                        timeout=60)
        return sorted(out.splitlines())

    def task_cgroups(self):
        """Each task's pid with its cgroup, as the kernel says."""
        return {pid: self.g.sh(f"cat /proc/{pid}/cgroup", check=False).stdout.strip()
                for _, pid in self.task_pids()}

    def task_pids(self):
        """Each task's container id and init pid, read from the shims'
        bundles: `ctr task ls` asks each shim for its state, and under TCG
        a shim busy with exec probes can time out and be left out."""
        out = self.g.sh("for f in /run/containerd/io.containerd.runtime.v2.task/zattera/*/init.pid; do "
                        "[ -e \"$f\" ] && echo \"$(basename \"$(dirname \"$f\")\") $(cat \"$f\")\"; done",
                        timeout=60, check=False).stdout
        return sorted(line.split()[:2] for line in out.splitlines() if len(line.split()) == 2)


def rows(s, app):
    return [r for r in s.get("assignments", []) if r.get("app") == app]


def all_in(s, app, n, state):
    r = rows(s, app)
    return len(r) == n and all(x.get("state") == state for x in r)


# --- cases --------------------------------------------------------------------

def case_install(ctx, g):
    node = Node(g, ctx)
    node.install({"web.toml": WEB, "hog.toml": HOG})
    for f in INSTALLED:
        expect(g.ok(f"test -e {f}"), f"{f} is not installed")
    expect(g.ok("test -L /etc/systemd/system/multi-user.target.wants/zattera-agent.service"),
           "the unit is not enabled by the package")
    expect(g.sh("stat -c %a /var/lib/zattera /etc/zattera/agent.toml").split() == ["700", "600"],
           "/var/lib/zattera is not 0700, or agent.toml not 0600")
    doctor = g.sh("zattera-agent doctor", check=False)
    expect(doctor.returncode == 0, f"doctor fails:\n{doctor.stdout}{doctor.stderr}")
    expect(g.sh("stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs", "the guest is not on cgroup v2")
    ctx.facts["cgroup"] = "v2"
    # Type=notify: `systemctl start` returns once the agent said READY=1,
    # and by then its admin socket serves.
    g.sh("systemctl enable --now zattera-agent", timeout=300)
    expect(g.sh("systemctl is-active zattera-agent", check=False).stdout.strip() == "active",
           "the unit is not active after enable --now")
    expect(node.status() is not None,
           f"the unit is active but the admin socket does not answer ({node.status_error})")
    t0 = time.time()
    node.wait("web 2 x HEALTHY", lambda s: all_in(s, "web", 2, "HEALTHY"))
    ctx.facts["install: unit start to HEALTHY"] = f"{time.time() - t0:.0f} s"
    body = g.sh("curl -fsS --max-time 10 http://127.0.0.1:8080/whoami.txt", check=False)
    expect(body.returncode == 0 and "served by" in body.stdout, f"port 8080: {body.stdout}{body.stderr}")
    # Each container's logger is the packaged small log shim (47).
    shims = int(g.sh("pgrep -c -f '^/usr/lib/zattera/zattera-logshim ' || true").strip() or 0)
    expect(shims >= 2, f"{shims} zattera-logshim processes for 2 web instances")
    journal = g.sh("journalctl -u zattera-agent --no-pager")
    expect("manifests loaded" in journal, f"the agent's lines are not in the journal:\n{journal[-2000:]}")
    node.wait("hog FAILED out of memory", lambda s: any(
        r.get("state") == "FAILED" and r.get("message") == "out of memory (limit 16 MiB)"
        for r in rows(s, "hog")))
    plan_under_the_packaged_layout(g)
    g.sh("DEBIAN_FRONTEND=noninteractive dpkg --purge zattera-agent", timeout=300)
    for f in INSTALLED:
        expect(not g.ok(f"test -e {f}"), f"{f} is left after the purge")
    expect(not g.ok("test -e /etc/systemd/system/multi-user.target.wants/zattera-agent.service"),
           "the unit's enablement is left after the purge")
    expect(g.ok("test -d /var/lib/zattera/logs"), "the purge removed /var/lib/zattera")


def plan_under_the_packaged_layout(g):
    """45.4 on a packaged node: the shipped planner plans an app with no
    Dockerfile under the 0700 data dir and a 077 umask. The build then stops
    at once for a platform with no emulator (the guest has no builder and no
    network; a stand-in buildkitd path lets the pipeline start)."""
    g.write("/root/plan-app/package.json",
            '{"name":"plan-app","version":"1.0.0","scripts":{"start":"node index.js"}}\n')
    g.write("/root/plan-app/index.js", "console.log('hi')\n")
    g.write("/root/plan.toml", 'build-backend = "buildkit"\nbuildkitd-binary = "/bin/true"\n')
    out = g.sh("umask 077; zattera-agent --config /root/plan.toml build /root/plan-app "
               "--platform linux/s390x 2>&1", check=False).stdout
    expect("planning with nixpacks" in out and "nixpacks plan:" not in out,
           f"the packaged planner did not plan:\n{out}")
    expect("no emulator for linux/s390x" in out, f"the build did not stop at the platform:\n{out}")
    expect(g.sh("stat -c %a /var/lib/zattera").strip() == "700", "the data dir was opened up")
    expect(g.sh("ls -A /var/lib/zattera-build").strip() == "", "the build scratch was left")


def case_cgroup(ctx, g):
    node = Node(g, ctx)
    node.install({"web.toml": WEB, "spin.toml": SPIN})
    g.sh("echo 'metrics-listen = \"127.0.0.1:9464\"' >> /etc/zattera/agent.toml")
    g.sh("systemctl enable --now zattera-agent", timeout=300)
    s = node.wait("web and spin up", lambda s: all_in(s, "web", 2, "HEALTHY")
                  and all_in(s, "spin", 1, "HEALTHY"))
    cid = rows(s, "spin")[0]["container_id"]
    cg = f"/sys/fs/cgroup/zattera/zattera/{cid}"
    expect(g.sh(f"cat {cg}/cpu.max").split() == ["50000", "100000"], "spin's cpu.max is not half a core")
    expect(g.sh(f"cat {cg}/memory.max").strip() == str(64 << 20), "spin's memory.max is not 64 MiB")
    # `stats` against the cgroup v2 files, read right after.
    time.sleep(15)
    stats = json.loads(g.sh("zattera-agent stats --json spin.production.demo"))
    stats = stats if isinstance(stats, list) else stats.get("instances", [stats])
    expect(len(stats) == 1, f"stats: {stats}")
    current = int(g.sh(f"cat {cg}/memory.current").strip())
    mem = stats[0]["memory_bytes"]
    expect(abs(mem - current) <= max(current // 4, 2 << 20),
           f"stats memory {mem} against memory.current {current}")
    cpu = stats[0]["cpu_percent"]
    expect(20 <= cpu <= 60, f"stats cpu {cpu}% for a spinner under cpu.max 50000/100000")
    ctx.facts["cgroup: spin stats against the cgroup"] = f"cpu {cpu:.0f}% (max 50), memory {mem} / {current}"
    metrics = g.sh("curl -fsS --max-time 10 http://127.0.0.1:9464/metrics")
    psi = [line for line in metrics.splitlines()
           if line.startswith("zattera_instance_pressure_seconds") and 'app="spin"' in line]
    expect(any('resource="cpu"' in line for line in psi) and any('resource="memory"' in line for line in psi),
           f"no PSI series for spin on /metrics: {psi}")
    # A child over the limit takes the whole container (memory.oom.group):
    # not a container that lost a process and reads RUNNING.
    g.write("/etc/zattera/manifests/childhog.toml", CHILD_HOG)
    node.wait("childhog FAILED out of memory", lambda s: any(
        r.get("state") == "FAILED" and r.get("message") == "out of memory (limit 16 MiB)"
        for r in rows(s, "childhog")))
    g.sh("rm /etc/zattera/manifests/childhog.toml")
    # A fork bomb is held by its pids limit, and the node stays up.
    g.write("/etc/zattera/manifests/bomb.toml", BOMB)
    s = node.wait("bomb running", lambda s: len(rows(s, "bomb")) == 1
                  and rows(s, "bomb")[0].get("container_id")
                  and rows(s, "bomb")[0].get("state") in ("RUNNING", "HEALTHY"))
    bomb = f"/sys/fs/cgroup/zattera/zattera/{rows(s, 'bomb')[0]['container_id']}"
    deadline = time.time() + 120
    while time.time() < deadline and not g.ok(f"grep -q '^max [1-9]' {bomb}/pids.events"):
        time.sleep(2)
    expect(g.ok(f"grep -q '^max [1-9]' {bomb}/pids.events"), "the bomb never reached its pids limit")
    current = int(g.sh(f"cat {bomb}/pids.current").strip())
    expect(current <= 128, f"the bomb has {current} pids under a limit of 128")
    node.wait("web HEALTHY beside the bomb", lambda s: all_in(s, "web", 2, "HEALTHY"), timeout=120)
    body = g.sh("curl -fsS --max-time 20 http://127.0.0.1:8080/whoami.txt", check=False)
    expect(body.returncode == 0, "port 8080 does not answer beside the bomb")
    g.sh("rm /etc/zattera/manifests/bomb.toml")
    node.wait("the bomb removed", lambda s: not rows(s, "bomb"), timeout=180)


def settled(node):
    return lambda s: all_in(s, "web", 2, "HEALTHY") and len(rows(s, "sick")) == 1 \
        and rows(s, "sick")[0].get("state") in ("RUNNING", "UNHEALTHY")


def never_healthy(node, app, seconds, how):
    deadline = time.time() + seconds
    seen = []
    while time.time() < deadline:
        s = node.status()
        if s is not None:
            for r in rows(s, app):
                expect(r.get("state") != "HEALTHY",
                       f"after {how}: {app}, whose check always fails, reads HEALTHY")
                seen.append(r.get("state"))
        time.sleep(1)
    expect(seen, f"after {how}: no status answered for {seconds} s")


def case_restart(ctx, g):
    node = Node(g, ctx)
    node.install({"web.toml": WEB, "sick.toml": FAILING})
    g.sh("systemctl enable --now zattera-agent", timeout=300)
    node.wait("web HEALTHY, sick not", settled(node))
    pids = node.task_pids()
    expect(len(pids) == 3, f"3 tasks, not {pids}")
    cgroups = node.task_cgroups()
    for how, command in [
        ("systemctl daemon-reload", "systemctl daemon-reload"),
        ("systemctl restart", "systemctl restart zattera-agent"),
        ("an upgrade", f"DEBIAN_FRONTEND=noninteractive apt-get install -y -q /root/{ctx.upgrade.name}"),
    ]:
        before = g.sh("systemctl show -p MainPID --value zattera-agent").strip()
        g.sh(command, timeout=600)
        after = g.sh("systemctl show -p MainPID --value zattera-agent").strip()
        # systemd never moves or kills the containers' processes.
        expect(node.task_cgroups() == cgroups,
               f"{how}: the tasks' cgroups changed: {cgroups} -> {node.task_cgroups()}")
        if how == "systemctl daemon-reload":
            expect(after == before, f"{how} restarted the agent")
            expect(node.task_pids() == pids, f"{how}: task pids changed")
            continue
        if how == "an upgrade":
            expect("+fresh" in g.sh("dpkg-query -W -f='${Version}' zattera-agent"), "the upgrade did not install")
            expect(g.ok("grep -q '^manifests = ' /etc/zattera/agent.toml"), "the upgrade lost the edited agent.toml")
            if after == before:
                # The package restarts a running unit on upgrade; if it did
                # not, the old binary still runs and nothing is tested.
                raise CaseFailed("the upgrade did not restart the agent")
        expect(after != before and after != "0", f"{how}: the agent did not restart ({before} -> {after})")
        never_healthy(node, "sick", 20, how)
        node.wait(f"web HEALTHY after {how}", settled(node))
        expect(node.task_pids() == pids, f"{how}: task pids changed: {pids} -> {node.task_pids()}")


def case_reboot(ctx, g):
    node = Node(g, ctx)
    node.install({"web.toml": WEB, "keeper.toml": KEEPER})
    g.sh("systemctl enable --now zattera-agent", timeout=300)
    up = lambda s: all_in(s, "web", 2, "HEALTHY") and all_in(s, "keeper", 1, "HEALTHY")  # noqa: E731
    node.wait("web and keeper HEALTHY", up)
    volume = g.sh("find /var/lib/zattera/volumes -name starts -path '*keeper*' | head -n 1").strip() \
        or g.sh("find /var/lib/zattera/volumes -name starts | head -n 1").strip()
    expect(volume, "the keeper's volume has no starts file")
    data = os.path.dirname(volume)
    web_ips = [r.get("ip") for r in rows(node.status(), "web") if r.get("ip")]
    expect(web_ips, "the web instances have no IP in status")
    created = node.created()
    for round_, how in [(1, "reboot"), (2, "poweroff")]:
        if how == "reboot":
            _, t_down = g.reboot("reboot")
        else:
            g.sh("systemctl poweroff", check=False, timeout=60)
            t_down = time.time()
            deadline = time.time() + 300
            while g.proc.poll() is None and time.time() < deadline:
                time.sleep(1)
            expect(g.proc.poll() is not None, "the guest did not power off within 300 s")
            g.power_on()
            g.wait_up(400)
        node.wait(f"every instance HEALTHY after {how}", up)
        # Started again, not re-created: a container keeps its writable layer.
        expect(node.created() == created, f"after {how}: containers re-created: {created} -> {node.created()}")
        uptime = float(g.sh("cut -d' ' -f1 /proc/uptime").strip())
        ctx.facts[f"{ctx.suite} boot to all HEALTHY after {how} (guest uptime, TCG)"] = f"{uptime:.0f} s"
        stops = g.sh(f"cat {data}/stops", check=False).stdout.split()
        expect(stops.count("stopped") == round_,
               f"after {how}: the keeper's SIGTERM trap wrote {stops.count('stopped')} of {round_} lines")
        expect(g.sh(f"cat {data}/starts").split().count("started") == round_ + 1,
               f"after {how}: the keeper's volume lost its earlier lines")
        body = g.sh("curl -fsS --max-time 10 http://127.0.0.1:8080/whoami.txt", check=False)
        expect(body.returncode == 0, f"after {how}: port 8080 does not answer")
        # From inside the keeper, through its gateway's DNS (the IPs may be
        # new after a boot).
        web_ips = [r.get("ip") for r in rows(node.status(), "web") if r.get("ip")]
        keeper = rows(node.status(), "keeper")[0].get("container_id")
        answer = g.sh(f"ctr -n zattera task exec --exec-id dns{round_} {keeper} "
                      f"nslookup web.internal", check=False)
        expect(any(f"Address: {ip}" in answer.stdout for ip in web_ips),
               f"after {how}: DNS does not answer web.internal with {web_ips}: "
               f"{answer.stdout}{answer.stderr}")
        tasks = len(node.task_pids())
        netns = int(g.sh("ls /run/zattera/netns | wc -l").strip())
        veths = int(g.sh("ip -o link show type veth | wc -l").strip())
        expect(netns == tasks == 3, f"after {how}: {netns} netns files, {tasks} tasks (3 wanted)")
        expect(veths == tasks, f"after {how}: {veths} veths for {tasks} tasks")
        tables = g.sh("nft list tables").split("\n")
        expect(len([t for t in tables if t.strip()]) <= 2, f"after {how}: nft tables {tables}")
        del t_down


# Docker's package layout, made in the guest from the suite's own containerd
# and runc (the files dpkg says they own, with dpkg-deb only): containerd.io
# provides containerd and runc WITHOUT a version, conflicts with and replaces
# both, and ships Docker's config.toml (the CRI plugin off); docker-ce is a
# stand-in that depends on it. Prints the two .debs' paths.
DOCKER_LAYOUT = r"""set -eu
out=/root/docker-layout
rm -rf "$out"
mkdir -p "$out/containerd.io/DEBIAN" "$out/docker-ce/DEBIAN" "$out/debs"
tree=$out/containerd.io
# Files and links to files, the paths as dpkg has them; folders follow
# (a link to a folder is merged /usr's /lib, never the package's).
dpkg-query -L containerd runc | sort -u | while read -r f; do
  if [ -f "$f" ] || { [ -L "$f" ] && [ ! -d "$f" ]; }; then echo "${f#/}"; fi
done > "$out/files"
tar -C / --no-recursion -cf - -T "$out/files" | tar -C "$tree" -xpf -
find "$tree" -type d -exec chmod 0755 {} +
mkdir -p "$tree/etc/containerd"
printf '%s\n' '# What Docker'"'"'s containerd.io ships: the CRI plugin off.' \
  'disabled_plugins = ["cri"]' > "$tree/etc/containerd/config.toml"
echo /etc/containerd/config.toml > "$tree/DEBIAN/conffiles"
version=$(dpkg-query -W -f='${Version}' containerd | sed 's/[~+].*//; s/-[^-]*$//')-1
depends=$(dpkg-query -W -f='${Depends}, ' containerd runc | tr ',' '\n' |
  sed 's/^ *//; s/ *$//; /^$/d; /^runc/d; /^containerd/d' | sort -u | paste -sd, | sed 's/,/, /g')
cat > "$tree/DEBIAN/control" <<CONTROL
Package: containerd.io
Version: $version
Architecture: amd64
Maintainer: zattera VM lane <lane@zattera.invalid>
Depends: $depends
Provides: containerd, runc
Conflicts: containerd, runc
Replaces: containerd, runc
Section: admin
Priority: optional
Description: stand-in for Docker's containerd.io (the VM lane)
 Debian's containerd and runc, packaged as Docker packages them.
CONTROL
cat > "$tree/DEBIAN/postinst" <<'SCRIPT'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
  deb-systemd-helper unmask containerd.service >/dev/null || true
  deb-systemd-helper enable containerd.service >/dev/null || true
  if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
    deb-systemd-invoke restart containerd.service >/dev/null || true
  fi
fi
SCRIPT
cat > "$tree/DEBIAN/prerm" <<'SCRIPT'
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
  deb-systemd-invoke stop containerd.service >/dev/null || true
fi
SCRIPT
chmod 0755 "$tree/DEBIAN/postinst" "$tree/DEBIAN/prerm"
cat > "$out/docker-ce/DEBIAN/control" <<'CONTROL'
Package: docker-ce
Version: 5:28.0.0-1~zattera.lane
Architecture: amd64
Maintainer: zattera VM lane <lane@zattera.invalid>
Depends: containerd.io (>= 1.6)
Section: admin
Priority: optional
Description: stand-in for Docker's docker-ce (the VM lane)
 Only its dependency on containerd.io, as a node running Docker has it.
CONTROL
dpkg-deb --root-owner-group -Zgzip --build "$tree" "$out/debs/containerd.io_${version}_amd64.deb" >/dev/null
dpkg-deb --root-owner-group -Zgzip --build "$out/docker-ce" "$out/debs/docker-ce_28.0.0_amd64.deb" >/dev/null
ls "$out"/debs/*.deb
"""


def installed(g, package):
    """Whether dpkg has `package` installed (not removed, not config-files)."""
    out = g.sh(f"dpkg-query -W -f='${{db:Status-Abbrev}}' {package}", check=False)
    return out.returncode == 0 and out.stdout.startswith("ii")


def case_docker(ctx, g):
    """The package on a node laid out as Docker's packages lay it out:
    containerd.io instead of Debian's containerd and runc, docker-ce on it.
    apt must install the agent without removing anything, and the agent
    runs on containerd.io's containerd."""
    node = Node(g, ctx)
    debs = g.sh(DOCKER_LAYOUT, timeout=300).split()
    expect(len(debs) == 2, f"the Docker layout's packages: {debs}")
    fields = g.sh(f"dpkg-deb -f {debs[0]} Package Provides Conflicts Replaces")
    expect("Provides: containerd, runc" in fields and "Conflicts: containerd, runc" in fields,
           f"containerd.io's control: {fields}")
    # apt replaces Debian's containerd and runc by containerd.io.
    out = g.sh("DEBIAN_FRONTEND=noninteractive apt-get install -y -q "
               "-o Dpkg::Options::=--force-confnew " + " ".join(debs), timeout=600)
    for p in ("containerd", "runc"):
        expect(not installed(g, p), f"Debian's {p} is still installed beside containerd.io:\n{out}")
    for p in ("containerd.io", "docker-ce"):
        expect(installed(g, p), f"{p} did not install:\n{out}")
    g.sh("systemctl enable --now containerd", timeout=120)
    expect(g.sh("systemctl is-active containerd", check=False).stdout.strip() == "active",
           "containerd.io's containerd is not active")
    owner = g.sh("dpkg-query -S \"$(readlink -f /proc/$(systemctl show -p MainPID --value containerd)/exe)\"",
                 check=False).stdout
    expect(owner.startswith("containerd.io:"), f"the running containerd is not containerd.io's: {owner}")
    expect("disabled_plugins = [\"cri\"]" in g.sh("cat /etc/containerd/config.toml"),
           "containerd.io's config.toml is not Docker's")
    # Docker's own namespace, which the agent never touches.
    g.sh("ctr namespaces create moby", timeout=60)
    # Nothing is removed: not containerd.io, not docker-ce.
    node.put_packages()
    deb = f"/root/{ctx.deb.name}"
    sim = g.sh(f"apt-get -s install {deb}", timeout=300)
    summary = [line for line in sim.splitlines() if " to remove" in line]
    expect(summary and " 0 to remove" in summary[0] and "Remv " not in sim,
           f"apt would remove packages to install the agent:\n{sim}")
    expect("Inst zattera-agent" in sim, f"apt would not install the agent:\n{sim}")
    ctx.facts[f"{ctx.suite} docker: apt-get -s install"] = summary[0].strip()
    node.install({"web.toml": WEB})
    for p in ("containerd.io", "docker-ce", "zattera-agent"):
        expect(installed(g, p), f"{p} is not installed after the agent's install")
    expect(g.sh("dpkg --audit").strip() == "", "dpkg --audit reports half-installed packages")
    report = json.loads(g.sh("zattera-agent doctor --json", timeout=120))
    checks = {c["name"]: c for c in report["checks"]}
    ctd = checks.get("containerd", {})
    expect(ctd.get("verdict") == "pass", f"doctor's containerd check: {ctd}")
    expect("from package containerd.io" in ctd.get("detail", ""),
           f"doctor does not name containerd.io: {ctd.get('detail')}")
    expect("Docker runs on it too" in ctd.get("detail", ""),
           f"doctor does not see Docker's namespace: {ctd.get('detail')}")
    expect(checks.get("runc", {}).get("verdict") == "pass", f"doctor's runc check: {checks.get('runc')}")
    expect(report.get("ok") is True, f"doctor fails: {json.dumps(report)}")
    ctx.facts[f"{ctx.suite} docker: doctor containerd"] = ctd["detail"]
    g.sh("systemctl enable --now zattera-agent", timeout=300)
    node.wait("web 2 x HEALTHY on containerd.io", lambda s: all_in(s, "web", 2, "HEALTHY"))
    body = g.sh("curl -fsS --max-time 10 http://127.0.0.1:8080/whoami.txt", check=False)
    expect(body.returncode == 0 and "served by" in body.stdout, f"port 8080: {body.stdout}{body.stderr}")
    expect("moby" in g.sh("ctr namespaces ls -q").split(), "Docker's namespace moby is gone")
    # Removing the agent leaves Docker's packages alone too.
    sim = g.sh("apt-get -s purge zattera-agent", timeout=300)
    removed = sorted(line.split()[1] for line in sim.splitlines() if line.startswith(("Remv ", "Purg ")))
    expect(removed == ["zattera-agent"], f"purging the agent would remove {removed}:\n{sim}")


# --- power cuts (58) ------------------------------------------------------------

POWERCUT_IMAGE = "docker.io/zattera/busybox:powercut"
LOGS = "/var/lib/zattera/logs"
# A line of the CRI log format the log shim writes (src/logs/shim.rs).
CRI_LINE = re.compile(rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d) (stdout|stderr) [FP] ")
# The files under a directory, one a line: path, size, SHA-256 (in the
# guest's shell and in busybox's alike).
TREE = ("cd {root} && find . -type f | sort | while read -r f; do "
        "echo \"$f $(wc -c < \"$f\") $(sha256sum < \"$f\" | cut -d' ' -f1)\"; done")
# The layer only the powercut image has, under /seed: 4 MiB of seeded
# random bytes (it does not compress, so the layer is 4 MiB) and a few
# small files.
SEED_FILES = {
    "seed/big.bin": random.Random(58).randbytes(4 << 20),
    "seed/README": b"copied up into a fresh volume at its first use\n",
    "seed/conf/app.conf": b"answer = 42\n",
    "seed/conf/empty": b"",
}
# Runs the imported image (cut 1).
LAYER = app("layer", SLEEP, image=POWERCUT_IMAGE)
# About 12 MiB of output at once (50,000 lines of 200 bytes, with the CRI
# prefix): the log shim rotates at 8 MiB (ROTATE_BYTES). Cut 2.
CHATTY = app("chatty", "yes \"$(head -c 200 /dev/zero | tr '\\0' x)\" | head -n 50000; " + SLEEP)
# A fresh volume over the image's /seed: the agent copies /seed into it
# before the task starts (cut 3).
SEEDED = app("seeded", SLEEP, '[[env.production.volumes]]\nname = "seed"\nmount_path = "/seed"\n',
             image=POWERCUT_IMAGE)


def tree(text):
    """TREE's output as a sorted list of (path, size, sha256)."""
    return sorted(tuple(line.split()) for line in text.splitlines() if line.strip())


def powercut_image(work, base):
    """The powercut image: the test image (`base`, its OCI archive) plus
    a layer of its own, SEED_FILES, written by mkimage.py's own writer (made
    anew each run: a second). Its archive, and /seed as TREE prints it."""
    out = work / "images" / "powercut-oci.tar"
    want = tree("\n".join(f"./{name.removeprefix('seed/')} {len(data)} {hashlib.sha256(data).hexdigest()}"
                          for name, data in SEED_FILES.items()))
    sys.path.insert(0, str(HERE / "scripts"))
    import mkimage  # noqa: E402
    with tarfile.open(base) as t:
        def blob(digest):
            return t.extractfile("blobs/sha256/" + digest.split(":", 1)[1]).read()
        index = json.loads(t.extractfile("index.json").read())
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = blob(manifest["config"]["digest"])
        layers = [gzip.decompress(blob(layer["digest"])) for layer in manifest["layers"]]
    entries = [("dir", "seed", None), ("dir", "seed/conf", None),
               *(("file", name, data) for name, data in SEED_FILES.items())]
    with contextlib.redirect_stdout(sys.stderr):
        mkimage.single_image(str(out.parent), out.name, POWERCUT_IMAGE, config, layers,
                             mkimage.tar_layer(entries))
    return out, want


def check_segments(g):
    """Every rotated log segment in LOGS decodes: `.zst` ones with zstd
    (on the host: the guest has no zstd), raw ones (a rotation the cut left
    before its compression) as they are; every line is a CRI line, but a
    raw segment's last, which a cut may have torn. What was found, a line
    each, and the bytes each segment holds decoded, by segment (its name
    without `.zst`: a raw file and its compressed copy are one segment),
    the larger where there are both."""
    names = g.sh(f"ls {LOGS}").split()
    segments = sorted(n for n in names if re.search(r"\.log\.\d+(\.zst)?$", n))
    expect(segments, f"no rotated segment in {LOGS}: {names}")
    seen, held = [], {}
    for name in segments:
        data = g.read_bytes(f"{LOGS}/{name}")
        if name.endswith(".zst"):
            out = subprocess.run(["zstd", "-q", "-d", "-c"], input=data, capture_output=True)
            expect(out.returncode == 0, f"{name} ({len(data)} bytes) does not decode: {out.stderr.decode()}")
            text, torn_ok = out.stdout, False
        else:
            text, torn_ok = data, True
        expect(b"\0" not in text, f"{name}: NUL bytes in it (blocks the cut left unwritten)")
        lines = text.split(b"\n")
        torn = lines.pop() != b""
        expect(not torn or torn_ok, f"{name}: its last line is torn")
        bad = [line[:80] for line in lines if not CRI_LINE.match(line)]
        expect(not bad, f"{name}: {len(bad)} lines not in the CRI format, first {bad[:3]}")
        seen.append(f"{name} ({'zstd' if name.endswith('.zst') else 'raw'}, {len(data)} bytes, "
                    f"{len(text)} decoded, {len(lines)} lines{', torn tail' if torn else ''})")
        segment = name.removesuffix(".zst")
        held[segment] = max(held.get(segment, 0), len(text))
    left = [n for n in names if n.endswith(".tmp")]
    return seen + [f"{n} (a compression the cut interrupted)" for n in left], held


def case_powercut(ctx, g):
    """Power cuts at the worst moments (58), on one guest: qemu SIGKILLed
    with nothing synced by the test (the disk in writeback mode, so what the
    guest flushed survives and its page cache does not), then a cold boot.
    After each: every service HEALTHY again, status working and saying the
    last run ended without a clean stop."""
    node = Node(g, ctx)
    archive, seed_tree = powercut_image(vm.WORK, ctx.image)
    seed = int(os.environ.get("ZATTERA_VM_SEED") or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    vm.say(f"powercut: seed {seed} (ZATTERA_VM_SEED={seed} repeats the cut times)")
    ctx.facts["powercut: seed"] = str(seed)
    node.install({"web.toml": WEB})
    g.put(archive, "/root/powercut-oci.tar")
    g.sh("systemctl enable --now zattera-agent", timeout=300)
    services = {"web": 2}

    def up(s):
        return all(all_in(s, name, n, "HEALTHY") for name, n in services.items())

    node.wait("web HEALTHY", up)
    notices = []
    # What the agent lost, found by a check that need not stop the later
    # cuts; the case fails at its end if any.
    lost = []

    def cut(n, what):
        t_cut = g.cut()
        vm.say(f"powercut {n}: power cut {what}")
        g.power_on()
        g.wait_up(400)
        t_ssh = time.time()
        s = node.wait(f"every service HEALTHY after cut {n} ({what})", up)
        t_up = time.time()
        uptime = float(g.sh("cut -d' ' -f1 /proc/uptime").strip())
        said = [x for x in s.get("notices", []) if "ended without a clean stop" in x]
        expect(said, f"after cut {n}: status --json notices do not say the last run ended "
                     f"without a clean stop: {s.get('notices')}")
        expect(said[0] not in notices, f"after cut {n}: the notice is the last cut's: {said[0]}")
        notices.append(said[0])
        table = g.sh("zattera-agent status", check=False)
        expect(table.returncode == 0 and "without a clean stop" in table.stdout,
               f"after cut {n}: `zattera-agent status` exited {table.returncode}:\n"
               f"{table.stdout}{table.stderr}")
        ctx.facts[f"powercut {n}: {what}"] = (f"power on to ssh {t_ssh - t_cut:.0f} s, to every service "
                                             f"HEALTHY {t_up - t_cut:.0f} s (guest uptime {uptime:.0f} s)")
        vm.say(f"powercut {n}: {ctx.facts[f'powercut {n}: {what}']}")

    # 1. Seconds after an image import: the image, its layer unpacked.
    delay = rng.uniform(2, 10)
    t0 = time.time()
    g.sh("zattera-agent image import /root/powercut-oci.tar", timeout=600)
    imported = time.time()
    time.sleep(max(0.0, imported + delay - time.time()))
    cut(1, f"{delay:.1f} s after an image import ({imported - t0:.0f} s)")
    images = g.sh("ctr -n zattera images ls -q", timeout=60).split()
    expect(POWERCUT_IMAGE in images, f"after cut 1: the imported image is gone: {images}")
    g.write("/etc/zattera/manifests/layer.toml", LAYER)
    services["layer"] = 1
    node.wait("layer HEALTHY on the imported image", up)
    inside = tree(g.sh("zattera-agent exec layer.production.demo -- sh -c "
                       + shlex.quote(TREE.format(root="/seed")), timeout=120))
    expect(inside == seed_tree, f"after cut 1: the imported layer's /seed is {inside}, not {seed_tree}")

    # 2. Right after a log rotation: the first rotated segment appears.
    g.write("/etc/zattera/manifests/chatty.toml", CHATTY)
    services["chatty"] = 1
    t0 = time.time()
    at_cut = g.sh(f"timeout 300 sh -c 'until ls {LOGS}/*.log.[0-9]* >/dev/null 2>&1; do sleep 0.1; done; "
                  f"ls {LOGS}'", timeout=330).split()
    cut(2, f"at the first rotated segment ({time.time() - t0:.0f} s after the app; "
           f"in {LOGS}: {' '.join(n for n in at_cut if '.log.' in n)})")
    logs = g.sh("zattera-agent logs chatty.production.demo --tail 3", check=False, timeout=120)
    expect(logs.returncode == 0 and logs.stdout.strip(),
           f"after cut 2: `zattera-agent logs chatty` exited {logs.returncode}:\n{logs.stdout}{logs.stderr}")
    # Removed, so that its shim compresses what it rotated and ends: the
    # segments are then still.
    s = node.wait("chatty's container", lambda s: rows(s, "chatty") and rows(s, "chatty")[0].get("container_id"))
    cid = rows(s, "chatty")[0]["container_id"]
    g.sh("rm /etc/zattera/manifests/chatty.toml")
    del services["chatty"]
    node.wait("chatty removed", lambda s: not rows(s, "chatty"), timeout=180)
    g.sh(f"timeout 120 sh -c 'while pgrep -f \"^/usr/lib/zattera/zattera-logshim .*{cid}\" >/dev/null; do sleep 1; done'",
         timeout=150)
    segments, held = check_segments(g)
    ctx.facts["powercut 2: rotated segments after the boot"] = "; ".join(segments)
    # What the log janitor makes of what the cut left once it is past the
    # janitor's grace (10 minutes, retention::GRACE; the raw and partial
    # files' times set back here rather than waited for), at its sweep at
    # the agent's start: a rotation left raw is finished, a partial
    # compression dropped, and no segment may hold less than it did.
    g.sh(f"cd {LOGS} && t=$(( $(date +%s) - 660 )) && for f in *.log.[0-9]*; do "
         f"case $f in *.zst) ;; *) [ ! -e \"$f\" ] || touch -d @$t \"$f\" ;; esac; done")
    g.sh("systemctl restart zattera-agent", timeout=300)
    g.sh(f"timeout 180 sh -c 'while ls {LOGS} | grep -Eq \"[.]log[.][0-9]+([.]zst[.]tmp)?$\"; do sleep 1; done'",
         timeout=200, check=False)
    segments, swept = check_segments(g)
    ctx.facts["powercut 2: rotated segments after the janitor's sweep"] = "; ".join(segments)
    for segment, n in held.items():
        if swept.get(segment, 0) < n:
            lost.append(f"cut 2: the log janitor's sweep after the cut left {segment} with "
                        f"{swept.get(segment, 0)} bytes of the {n} it held (before the sweep: "
                        f"{ctx.facts['powercut 2: rotated segments after the boot']}; after: "
                        f"{'; '.join(segments)})")

    # 3. Right after a copy-up into a fresh volume: the instance RUNNING.
    g.write("/etc/zattera/manifests/seeded.toml", SEEDED)
    services["seeded"] = 1
    t0 = time.time()
    while not any(r.get("state") in ("RUNNING", "HEALTHY") for r in rows(node.status() or {}, "seeded")):
        expect(time.time() - t0 < HEALTHY_WITHIN, f"seeded not RUNNING within {HEALTHY_WITHIN} s")
    cut(3, f"right after a copy-up, the instance RUNNING ({time.time() - t0:.0f} s after the app)")
    volume = g.sh("ls -d /var/lib/zattera/volumes/*-seed").split()
    expect(len(volume) == 1, f"after cut 3: the seed volume: {volume}")
    copied = tree(g.sh(TREE.format(root=shlex.quote(volume[0] + "/_data"))))
    expect(copied == seed_tree, f"after cut 3: the volume holds {copied}, not the image's /seed {seed_tree}")
    marks = g.sh(f"ls -A {shlex.quote(volume[0])}").split()
    expect(sorted(marks) == ["_data", "copied-up"], f"after cut 3: beside the volume's _data: {marks}")

    # 4. Right after an upgrade's swap (the package's restart).
    g.sh(f"DEBIAN_FRONTEND=noninteractive apt-get install -y -q /root/{ctx.upgrade.name}", timeout=600)
    cut(4, "right after an upgrade to the +fresh package")
    expect("+fresh" in g.sh("dpkg-query -W -f='${Version}' zattera-agent"), "after cut 4: the upgrade is gone")
    expect(g.sh("dpkg --audit").strip() == "", "after cut 4: dpkg --audit reports half-installed packages")
    # Not the edited conffile, nor the docs the image's dpkg never installs
    # (guest.DPKG_OPTS: path-exclude=/usr/share/doc/*).
    verify = [line for line in g.sh("dpkg --verify zattera-agent", check=False).stdout.splitlines()
              if " c /" not in line and not re.match(r"missing +/usr/share/doc/", line)]
    expect(not verify, f"after cut 4: the package's files differ from their sums: {verify}")
    expect(not lost, "the agent lost: " + " | ".join(lost))


def case_cluster(ctx, g):
    cluster.case_cluster(ctx, g, lambda guest: Node(guest, ctx))


CASES = {"install": case_install, "cgroup": case_cgroup, "restart": case_restart,
         "reboot": case_reboot, "cluster": case_cluster, "docker": case_docker,
         "powercut": case_powercut}


class Ctx:
    def __init__(self, suite, deb, upgrade, image, facts, img=None, net=None, accel=None,
                 artifacts=None):
        # What a case that boots more guests needs: the suite's image, the
        # lane's network, the accelerator and the run's directory.
        self.img, self.net, self.accel, self.artifacts = img, net, accel, artifacts
        self.suite = suite
        self.deb = deb
        self.upgrade = upgrade
        self.image = image
        self.facts = facts


BOOT_WITHIN = 240


class Problem:
    def __init__(self, message, guest_failed):
        self.message = message
        self.guest_failed = guest_failed


def run_case(ctx, case, name, index):
    """Runs `case` on a fresh guest named `name`; None when it passed,
    else the Problem (its log kept, the guest held on request)."""
    t0 = time.time()
    g = vm.Guest(ctx.img, ctx.net, name, index, ctx.accel, ctx.artifacts,
                 cache=DISK_CACHE.get(case, "unsafe"))
    try:
        # A first boot reaches ssh in 15 to 25 s under TCG; a guest that
        # hangs at boot is given up on well before that costs the lane its
        # time budget, and run again (see main).
        g.wait_up(BOOT_WITHIN)
        ctx.facts[f"{ctx.suite} boot to ssh"] = f"{time.time() - t0:.0f} s"
        CASES[case](ctx, g)
        vm.say(f"PASS {case} on {ctx.suite} ({time.time() - t0:.0f} s)")
        if os.environ.get("ZATTERA_VM_KEEP") != "1":
            g.stop()
            shutil.rmtree(g.dir, ignore_errors=True)
        return None
    except (CaseFailed, vm.GuestError, subprocess.SubprocessError) as e:
        g.keep_journal()
        stalls = g.kernel_stalls()
        vm.say(f"FAIL {case} on {ctx.suite} ({time.time() - t0:.0f} s): {e}")
        if not isinstance(e, CaseFailed):
            traceback.print_exc()
        for line in stalls[:3]:
            vm.say(f"  guest kernel: {line}")
        vm.say(f"  console log and journal: {g.dir}")
        vm.hold([g])
        return Problem(str(e).splitlines()[0] if str(e) else type(e).__name__,
                       guest_failed=bool(stalls) or isinstance(e, vm.GuestLost))
    finally:
        g.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", action="append", choices=vm.SUITES)
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("vm lane: must run as root")
    if args.cases[:1] == ["clean"]:
        vm.clean_stale()
        return 0
    host_tools()
    if args.cases[:1] == ["image"]:
        for suite in args.cases[1:] or vm.SUITES:
            img = vm.Image(suite).build()
            print(img.dir)
        return 0
    vm.clean_stale()
    plan = []
    for suite in args.suite or list(DEFAULT_CASES):
        if args.suite and not (args.cases or DEFAULT_CASES[suite]):
            raise SystemExit(f"vm lane: name the cases to run on {suite} ({', '.join(CASES)})")
        for case in args.cases or DEFAULT_CASES[suite]:
            if case not in CASES:
                raise SystemExit(f"vm lane: unknown case {case} ({', '.join(CASES)})")
            plan.append((suite, case))
    deb, upgrade = packages()
    run_id = str(os.getpid())
    artifacts = vm.WORK / "runs" / time.strftime("%Y%m%d-%H%M%S")
    artifacts.mkdir(parents=True, exist_ok=True)
    image = test_image(vm.WORK)
    net = vm.Network(run_id)
    failed, flaky = [], []
    facts = {}
    try:
        n = 0
        for suite, case in plan:
            img = vm.Image(suite).build()
            accel = os.environ.get("ZATTERA_VM_ACCEL") or ("kvm" if vm.kvm_boots(img) else "tcg")
            facts[f"{suite} versions"] = img.versions.read_text().replace("\n", " ").strip()
            facts[f"{suite} accel"] = accel
            ctx = Ctx(suite, deb, upgrade, image, facts, img, net, accel, artifacts)
            first = None
            for attempt in ("", "-again"):
                problem = run_case(ctx, case, f"{case}-{suite}{attempt}", n)
                n += 1
                if problem is None:
                    break
                # Once more on a fresh guest only when the guest itself
                # failed (its kernel stalled, ssh was lost): under TCG on
                # a shared host the emulated CPUs can starve. An agent's
                # failure in a healthy guest fails the lane at once.
                if first is not None or not problem.guest_failed:
                    break
                first = problem
                vm.say(f"  {case} on {suite}: the guest failed, not the agent; once more on a fresh guest")
            if problem is not None:
                failed.append(f"{case} on {suite}")
            elif first is not None:
                flaky.append(f"{case} on {suite} (first try: {first.message})")
    finally:
        net.close()
    for k, v in facts.items():
        vm.say(f"  {k}: {v}")
    for f in flaky:
        vm.say(f"FLAKY {f}")
    if failed:
        vm.say(f"vm lane: {len(failed)} of {len(plan)} cases failed: {', '.join(failed)}")
        return 1
    vm.say(f"vm lane: all {len(plan)} cases passed")
    if os.environ.get("ZATTERA_VM_KEEP") != "1":
        shutil.rmtree(artifacts, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

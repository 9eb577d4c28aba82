"""The release agent run standalone by a benchmark (bench/wake, bench/scale):
started and stopped, its status read over the admin socket, and everything
it made removed afterwards (its containerd namespace, nft table, links with
the bench's prefix, mounts under the work directory). Ours only."""

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import time

AGENT = os.environ.get("AGENT", "")
SOCK = os.environ.get("ZATTERA_TEST_CONTAINERD", "/run/zattera-rig/containerd/containerd.sock")
ARCHIVE = os.path.join(os.environ.get("ZATTERA_TEST_IMAGES", "/var/lib/zattera-rig/images"), "busybox-oci.tar")
IMAGE = "docker.io/zattera/busybox:test"


def status(run_dir, timeout=5):
    """The agent's `status --json` document, straight from its admin socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(os.path.join(run_dir, "agent.sock"))
        s.sendall(b"status\n")
        chunks = []
        while True:
            b = s.recv(1 << 16)
            if not b:
                break
            chunks.append(b)
    return json.loads(b"".join(chunks))


def ctr(*args, check=True):
    return subprocess.run(["ctr", "--address", SOCK, *args], check=check, capture_output=True, text=True)


class Agent:
    """One standalone agent: namespace `ns`, bridges `prefix*`, subnet slots
    `slots` ("A-B"), under the directory `work`."""

    def __init__(self, work, ns, prefix, slots):
        self.work, self.ns, self.prefix, self.slots = work, ns, prefix, slots
        self.run_dir = os.path.join(work, "run")
        self.manifests = os.path.join(work, "manifests")
        os.makedirs(self.manifests, exist_ok=True)
        self.proc = None

    def base(self):
        return [AGENT, "--containerd-address", SOCK, "--namespace", self.ns, "--run-dir", self.run_dir,
                "--data-dir", os.path.join(self.work, "data")]

    def import_image(self):
        subprocess.run(self.base() + ["image", "import", ARCHIVE], check=True, capture_output=True)

    def start(self):
        """Starts the agent; returns the monotonic time it was started at."""
        log = open(os.path.join(self.work, "agent.log"), "ab")
        started = time.monotonic()
        self.proc = subprocess.Popen(self.base() + ["run", "--manifests", self.manifests, "--bridge-prefix",
                                                    self.prefix, "--subnet-pool", self.slots,
                                                    "--host-shutdown-check", "none"], stdout=log, stderr=log)
        return started

    def wait_ready(self, within=60):
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                return status(self.run_dir)
            except (OSError, ValueError):
                if self.proc.poll() is not None:
                    raise SystemExit(f"the agent exited: {self.tail()}")
                time.sleep(0.01)
        raise SystemExit(f"the agent's admin socket never answered: {self.tail()}")

    def write_manifest(self, name, text):
        """Writes a manifest whole (through a rename); returns when it appeared."""
        path = os.path.join(self.manifests, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        at = time.monotonic()
        os.rename(path + ".tmp", path)
        return at

    def stop(self):
        """SIGTERM (not a host shutdown: the containers keep running)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self):
        with open(os.path.join(self.work, "agent.log"), "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def remove(self, other_namespaces=()):
        """Stops the agent and removes everything it (and the peer, in
        `other_namespaces`) made."""
        self.stop()
        keep = os.environ.get("BENCH_KEEP_LOG")
        if keep:
            shutil.copy(os.path.join(self.work, "agent.log"), keep)
        for ns in (self.ns, *other_namespaces):
            ids = ctr("-n", ns, "containers", "ls", "-q", check=False).stdout.split()

            def remove(c, ns=ns):
                ctr("-n", ns, "tasks", "kill", "-s", "SIGKILL", c, check=False)
                for _ in range(50):
                    done = ctr("-n", ns, "tasks", "rm", "-f", c, check=False)
                    if done.returncode == 0 or "not found" in done.stderr:
                        break
                    time.sleep(0.1)
                ctr("-n", ns, "containers", "rm", c, check=False)

            # A thousand containers one by one take minutes: eight at once.
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(remove, ids))
            for img in ctr("-n", ns, "images", "ls", "-q", check=False).stdout.split():
                ctr("-n", ns, "images", "rm", "--sync", img, check=False)
            ctr("namespaces", "rm", ns, check=False)
        subprocess.run(["nft", "delete", "table", "inet", "zattera_" + self.ns.replace("-", "_")],
                       capture_output=True)
        for link in os.listdir("/sys/class/net"):
            if link.startswith(self.prefix):
                subprocess.run(["ip", "link", "del", link], capture_output=True)
        mounts = [line.split()[1] for line in open("/proc/self/mounts") if line.split()[1].startswith(self.work)]
        for m in sorted(mounts, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)

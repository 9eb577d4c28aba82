"""Real Debian guests for the VM lane: images built from Debian's packages
only, booted with qemu (KVM when a probe shows a KVM guest really boots
here, TCG otherwise), on tap devices of a bridge inside a network namespace
of the lane's own, driven over ssh.

Nothing here reaches outside this machine: the lane's namespace has no
route out, and guests have no user-mode NAT.
"""
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path(os.environ.get("ZATTERA_VM_CACHE", "/var/cache/zattera-vm"))
WORK = Path(os.environ.get("ZATTERA_VM_WORK", "/var/tmp/zattera-vm"))
MIRROR = os.environ.get("ZATTERA_VM_MIRROR", "http://deb.debian.org/debian")
SECURITY = os.environ.get("ZATTERA_VM_SECURITY_MIRROR", "http://deb.debian.org/debian-security")

# What every guest has: a booting systemd host with ssh, and what the .deb
# depends on (containerd, runc, nftables), so that `apt install ./the.deb`
# works with no network. curl and tcpdump are the tests' own tools.
PACKAGES = [
    "systemd-sysv", "udev", "dbus", "kmod", "iproute2", "openssh-server",
    "linux-image-cloud-amd64", "initramfs-tools", "e2fsprogs",
    "containerd", "runc", "nftables", "ca-certificates",
    "curl", "procps", "tcpdump", "busybox-static",
]
# Small guests; man pages stay (the package check looks for its own).
DPKG_OPTS = [
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
]
SUITES = ("bookworm", "trixie", "forky")
# apt options a suite's image is built with. Forky (Debian 14, testing) is
# read from a mirror whose Release may be past its Valid-Until: apt would
# refuse it. The guests have no sources, so nothing else reads the date.
APT_OPTS = {"forky": ['Acquire::Check-Valid-Until "false"']}
# Bumped when the image's customisation changes.
IMAGE_VERSION = "v1"
# The lane's network: a bridge in the lane's namespace, guests on taps.
NET_PREFIX = "10.254.250"
GATEWAY = f"{NET_PREFIX}.1"
# Every name the lane makes starts with this: cleanup finds them by it.
PREFIX = "ztvm"

NET_SCRIPT = r"""#!/bin/sh
# The lane's guest network, from the kernel command line (ztvm.ip=,
# ztvm.gw=, ztvm.name=): the lane gives every guest its own address.
set -eu
for word in $(cat /proc/cmdline); do
  case "$word" in
    ztvm.ip=*) ip=${word#ztvm.ip=} ;;
    ztvm.gw=*) gw=${word#ztvm.gw=} ;;
    ztvm.name=*) hostname "${word#ztvm.name=}"; echo "${word#ztvm.name=}" > /etc/hostname ;;
  esac
done
ip link set lo up
[ -n "${ip:-}" ] || exit 0
for _ in $(seq 1 100); do
  [ -e /sys/class/net/eth0 ] && break
  sleep 0.1
done
ip addr replace "$ip" dev eth0
ip link set eth0 up
[ -z "${gw:-}" ] || ip route replace default via "$gw"
"""

NET_UNIT = """[Unit]
Description=The VM lane's guest network (from the kernel command line)
DefaultDependencies=no
After=systemd-udevd.service local-fs.target
Before=network.target network-online.target ssh.service
Wants=network.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/ztvm-net

[Install]
WantedBy=multi-user.target
"""


def say(*words):
    print("\033[1m[vm]\033[0m", *words, file=sys.stderr, flush=True)


def run(argv, check=True, **kw):
    return subprocess.run(argv, check=check, **kw)


def lane_key():
    """The lane's ssh key (kept with the image cache: images trust it)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    key = CACHE / "id_ed25519"
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "zattera-vm-lane", "-f", str(key)])
    return key


class Image:
    """A cached guest image: a raw ext4 root, and the kernel and initrd
    taken from its /boot (the cloud kernel has virtio_blk as a module)."""

    def __init__(self, suite):
        if suite not in SUITES:
            raise SystemExit(f"unknown suite {suite} (one of {', '.join(SUITES)})")
        self.suite = suite
        pub = lane_key().with_suffix(".pub").read_text()
        # A suite's apt options join the hash only when it has some: the
        # other suites' cached images keep their keys.
        inputs = "\n".join([suite, MIRROR, SECURITY, " ".join(PACKAGES), " ".join(DPKG_OPTS), IMAGE_VERSION,
                            NET_SCRIPT, NET_UNIT, pub, *APT_OPTS.get(suite, [])])
        self.key = hashlib.sha256(inputs.encode()).hexdigest()[:12]
        self.dir = CACHE / f"{suite}-{self.key}"
        self.root = self.dir / "root.img"
        self.kernel = self.dir / "vmlinuz"
        self.initrd = self.dir / "initrd.img"
        self.versions = self.dir / "versions"

    def ready(self):
        return all(p.exists() for p in (self.root, self.kernel, self.initrd, self.versions))

    def build(self):
        if self.ready():
            say(f"image {self.suite}: {self.dir} (cached)")
            return self
        say(f"image {self.suite}: building into {self.dir}")
        t0 = time.time()
        WORK.mkdir(parents=True, exist_ok=True)
        tree = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-root-", dir=WORK))
        try:
            sources = [
                f"deb {MIRROR} {self.suite} main",
                f"deb {MIRROR} {self.suite}-updates main",
                f"deb {SECURITY} {self.suite}-security main",
            ]
            run(["mmdebstrap", "--quiet", "--variant=minbase",
                 "--include=" + ",".join(PACKAGES), *DPKG_OPTS,
                 *(f"--aptopt={o}" for o in APT_OPTS.get(self.suite, [])),
                 self.suite, str(tree), *sources])
            self._customise(tree)
            self.dir.mkdir(parents=True, exist_ok=True)
            boot = tree / "boot"
            kernel = sorted(boot.glob("vmlinuz-*"))[-1]
            initrd = sorted(boot.glob("initrd.img-*"))[-1]
            shutil.copy(kernel, self.kernel.with_suffix(".tmp"))
            shutil.copy(initrd, self.initrd.with_suffix(".tmp"))
            versions = self._versions(tree, kernel.name.removeprefix("vmlinuz-"))
            raw = self.root.with_suffix(".tmp")
            raw.unlink(missing_ok=True)
            run(["mkfs.ext4", "-q", "-F", "-L", "root", "-d", str(tree), str(raw), "3G"])
            raw.rename(self.root)
            self.kernel.with_suffix(".tmp").rename(self.kernel)
            self.initrd.with_suffix(".tmp").rename(self.initrd)
            self.versions.write_text(versions)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        say(f"image {self.suite}: built in {time.time() - t0:.0f} s")
        return self

    def _customise(self, tree):
        (tree / "etc/fstab").write_text("/dev/vda / ext4 rw,errors=remount-ro 0 1\n")
        (tree / "etc/hostname").write_text(f"{PREFIX}\n")
        ssh = tree / "root/.ssh"
        ssh.mkdir(mode=0o700, exist_ok=True)
        (ssh / "authorized_keys").write_text(lane_key().with_suffix(".pub").read_text())
        os.chmod(ssh / "authorized_keys", 0o600)
        (tree / "etc/ssh/sshd_config.d").mkdir(exist_ok=True)
        (tree / "etc/ssh/sshd_config.d/ztvm.conf").write_text(
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n")
        script = tree / "usr/local/sbin/ztvm-net"
        script.write_text(NET_SCRIPT)
        os.chmod(script, 0o755)
        (tree / "etc/systemd/system/ztvm-net.service").write_text(NET_UNIT)
        wants = tree / "etc/systemd/system/multi-user.target.wants"
        wants.mkdir(parents=True, exist_ok=True)
        (wants / "ztvm-net.service").symlink_to("/etc/systemd/system/ztvm-net.service")
        # The journal of an earlier boot is kept: the reboot cases read it.
        (tree / "var/log/journal").mkdir(parents=True, exist_ok=True)
        # No mirror is reachable from a guest: apt works from local files.
        for f in [tree / "etc/apt/sources.list", *(tree / "etc/apt/sources.list.d").glob("*")]:
            f.unlink(missing_ok=True)

    def _versions(self, tree, kernel):
        def pkg(name):
            out = run(["chroot", str(tree), "dpkg-query", "-W", "-f=${Version}", name],
                      capture_output=True, text=True, check=False)
            return out.stdout.strip() or "?"
        return (f"kernel={kernel}\ncontainerd={pkg('containerd')}\nrunc={pkg('runc')}\n"
                f"systemd={pkg('systemd')}\nnftables={pkg('nftables')}\n")


def kvm_boots(image):
    """Whether a KVM guest really boots here (a nested host may hang after
    "Booting from ROM"). Asked once per host kernel, and cached."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    probe = CACHE / f"kvm-probe-{os.uname().release}"
    if probe.exists():
        return probe.read_text().strip() == "yes"
    with tempfile.TemporaryDirectory(dir=WORK) as d:
        console = Path(d) / "console.log"
        proc = subprocess.Popen(
            ["qemu-system-x86_64", "-accel", "kvm", "-cpu", "host", "-m", "256", "-nodefaults",
             "-display", "none", "-no-reboot", "-kernel", str(image.kernel),
             "-append", "console=ttyS0 panic=-1", "-serial", f"file:{console}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ok = False
        deadline = time.time() + 20
        while time.time() < deadline and proc.poll() is None:
            if console.exists() and b"Linux version" in console.read_bytes():
                ok = True
                break
            time.sleep(0.5)
        proc.kill()
        proc.wait()
    probe.write_text("yes\n" if ok else "no\n")
    say(f"KVM probe: a KVM guest {'boots' if ok else 'does not boot'} here; using {'KVM' if ok else 'TCG'}")
    return ok


class Network:
    """The lane's network namespace, with a bridge for the guests' taps."""

    def __init__(self, run_id):
        self.ns = f"{PREFIX}-{run_id}"
        self.bridge = f"{PREFIX}br"
        self.taps = 0
        run(["ip", "netns", "add", self.ns])
        self.ip("link", "set", "lo", "up")
        self.ip("link", "add", self.bridge, "type", "bridge")
        self.ip("addr", "add", f"{GATEWAY}/24", "dev", self.bridge)
        self.ip("link", "set", self.bridge, "up")

    def ip(self, *args):
        run(["ip", "-n", self.ns, *args])

    def tap(self):
        name = f"{PREFIX}t{self.taps}"
        self.taps += 1
        self.ip("tuntap", "add", name, "mode", "tap")
        self.ip("link", "set", name, "master", self.bridge)
        self.ip("link", "set", name, "up")
        return name

    def exec(self, argv):
        return ["ip", "netns", "exec", self.ns, *argv]

    def close(self):
        run(["ip", "netns", "pids", self.ns], check=False, capture_output=True)
        run(["ip", "netns", "del", self.ns], check=False)


class GuestError(Exception):
    pass


class GuestLost(GuestError):
    """ssh to the guest failed (its exit 255), or never came: the guest's
    failure, not the agent's."""


class CaseFailed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise CaseFailed(what)


class Guest:
    """One booted guest, on an overlay of its image (the image is never
    written), with its console log in `self.dir`.

    `cache` is qemu's cache mode of the guest's disk. "unsafe" (the default)
    ignores the guest's flushes: fast, and a kill of qemu may lose what the
    guest had synced. "writeback" honours them (qcow2's metadata written,
    the file fdatasync'd), so after a SIGKILL of qemu (see `cut`) the disk
    holds what the guest flushed, and what was only in the guest's page
    cache is gone; a write the guest sent but never flushed may or may not
    be there (in qemu's qcow2 cache, lost; in the host's page cache, kept),
    as with a real disk's volatile cache."""

    def __init__(self, image, net, name, index, accel, artifacts, cache="unsafe"):
        self.image = image
        self.cache = cache
        self.net = net
        self.name = name
        self.ip = f"{NET_PREFIX}.{10 + index}"
        self.dir = artifacts / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.console = self.dir / "console.log"
        self.disk = self.dir / "disk.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(image.root),
             str(self.disk)])
        self.tap = net.tap()
        self.accel = accel
        self.index = index
        self.proc = None
        self.power_on()

    def power_on(self):
        """Boots the guest (again, after a poweroff) on its disk."""
        image, net, name, index = self.image, self.net, self.name, self.index
        # `-cpu max` under TCG for every suite: forky's 7.x kernel has been
        # seen to oops at boot on qemu's default CPU model (qemu64).
        cpu = ["-accel", "kvm", "-cpu", "host"] if self.accel == "kvm" else \
            ["-accel", "tcg,thread=multi", "-cpu", "max"]
        append = (f"root=/dev/vda rw console=ttyS0 net.ifnames=0 ztvm.ip={self.ip}/24 "
                  f"ztvm.gw={GATEWAY} ztvm.name={name}")
        argv = ["qemu-system-x86_64", "-name", f"{net.ns}-{name}", *cpu, "-smp", "2",
                "-m", os.environ.get("ZATTERA_VM_MEMORY", "1536"),
                "-nodefaults", "-no-user-config", "-display", "none",
                "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", append,
                "-drive", f"file={self.disk},if=virtio,format=qcow2,cache={self.cache}",
                "-netdev", f"tap,id=n0,ifname={self.tap},script=no,downscript=no",
                "-device", f"virtio-net-pci,netdev=n0,mac=52:54:00:7a:00:{10 + index:02x}",
                "-device", "virtio-rng-pci",
                "-serial", f"file:{self.console}"]
        # The console log of every boot, not only the last one's.
        if self.console.exists():
            with open(self.dir / "console-earlier.log", "ab") as keep:
                keep.write(self.console.read_bytes())
        with open(self.dir / "qemu.log", "ab") as log:
            self.proc = subprocess.Popen(net.exec(argv), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def cut(self):
        """Cuts the power: qemu is SIGKILLed, nothing is flushed or synced
        (the guest's page cache is lost); the disk is kept for `power_on`.
        The time of the cut."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        t = time.time()
        self.proc.wait()
        return t

    def ssh_argv(self, command):
        return self.net.exec([
            "ssh", "-i", str(lane_key()), "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
            "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=6", "-o", "BatchMode=yes",
            f"root@{self.ip}", command])

    def sh(self, command, timeout=300, check=True):
        """Runs `command` in the guest's root shell; its stdout."""
        try:
            out = subprocess.run(self.ssh_argv(command), capture_output=True, text=True,
                                 timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise GuestError(f"{self.name}: `{command}` did not end within {timeout} s") from e
        if check and out.returncode == 255:
            raise GuestLost(f"{self.name}: ssh failed running `{command}`: {out.stderr[-1000:]}")
        if check and out.returncode != 0:
            raise GuestError(f"{self.name}: `{command}` exited {out.returncode}:\n"
                             f"{out.stdout[-3000:]}{out.stderr[-3000:]}")
        return out.stdout if check else out

    def ok(self, command, timeout=60):
        """Whether `command` succeeds in the guest."""
        try:
            return self.sh(command, timeout=timeout, check=False).returncode == 0
        except GuestError:
            return False

    def put(self, local, remote):
        with open(local, "rb") as f:
            out = subprocess.run(self.ssh_argv(f"cat > {shlex.quote(remote)}"), stdin=f,
                                 capture_output=True, timeout=300)
        if out.returncode != 0:
            raise GuestError(f"{self.name}: copying {local} to {remote}: {out.stderr.decode()}")

    def read_bytes(self, remote):
        """A guest file's bytes, as they are."""
        out = subprocess.run(self.ssh_argv(f"cat {shlex.quote(remote)}"), capture_output=True,
                             timeout=300)
        if out.returncode != 0:
            raise GuestError(f"{self.name}: reading {remote}: {out.stderr.decode()}")
        return out.stdout

    def write(self, remote, text):
        out = subprocess.run(self.ssh_argv(f"mkdir -p $(dirname {shlex.quote(remote)}) && "
                                           f"cat > {shlex.quote(remote)}"),
                             input=text, text=True, capture_output=True, timeout=60)
        if out.returncode != 0:
            raise GuestError(f"{self.name}: writing {remote}: {out.stderr}")

    def boot_id(self):
        return self.sh("cat /proc/sys/kernel/random/boot_id", timeout=30).strip()

    def wait_up(self, timeout=300, after_boot=None):
        """Waits until ssh answers (in a boot other than `after_boot`)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise GuestError(f"{self.name}: qemu exited {self.proc.returncode}; "
                                 f"console: {self.console}")
            try:
                boot = self.boot_id()
                if boot != after_boot:
                    return boot
            except GuestError:
                pass
            time.sleep(2)
        raise GuestLost(f"{self.name}: no ssh within {timeout} s; console: {self.console}")

    def reboot(self, how="reboot", timeout=400):
        before = self.boot_id()
        subprocess.run(self.ssh_argv(f"systemctl {how}"), capture_output=True, timeout=60)
        t0 = time.time()
        return self.wait_up(timeout, after_boot=before), t0

    def kernel_stalls(self):
        """The guest kernel's stall reports in this boot's console log (an
        RCU stall, a soft lockup, a hung task): under TCG on a busy host
        the emulated CPUs can starve, and ssh then stops answering."""
        try:
            text = self.console.read_text(errors="replace")
        except OSError:
            return []
        marks = ("stall on CPU", "stalls on CPUs", "soft lockup", "blocked for more than")
        return [line.strip() for line in text.splitlines() if any(m in line for m in marks)]

    def keep_journal(self):
        """The guest's journal beside its console log, for a failed case."""
        try:
            out = subprocess.run(self.ssh_argv("journalctl --no-pager -o short-monotonic"),
                                 capture_output=True, timeout=120)
            (self.dir / "journal.txt").write_bytes(out.stdout)
        except (subprocess.TimeoutExpired, OSError):
            pass

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.disk.unlink(missing_ok=True)


def hold(guests):
    """With ZATTERA_VM_HOLD=SECS, keeps failed guests running that long,
    saying how to reach them (a failure to look at by hand)."""
    secs = int(os.environ.get("ZATTERA_VM_HOLD", "0") or 0)
    if secs <= 0:
        return
    for g in guests:
        say(f"  {g.name}: {' '.join(g.ssh_argv('')[:-1])}")
    say(f"holding the failed guests for {secs} s")
    time.sleep(secs)


def clean_stale():
    """Removes what earlier, killed runs of the lane left: qemu processes
    named after a lane namespace, and the namespaces themselves."""
    out = run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if args.startswith("qemu-system-x86_64 -name " + PREFIX + "-"):
            say(f"killing a guest left by an earlier run: {pid}")
            os.kill(int(pid), signal.SIGKILL)
    names = run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in names:
        if ns.startswith(PREFIX + "-"):
            say(f"removing namespace {ns} left by an earlier run")
            # The cluster case's control hosts run WireGuard devices there.
            pids = run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run(["ip", "netns", "del", ns], check=False)

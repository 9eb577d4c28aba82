#!/usr/bin/env python3
"""bench/logs: lines per second through the log shim into CRI files, against
`cat` writing the same stream to a file, in the same run (issue 17).

The log shim is the packaged agent binary started the way containerd's runc
shim starts it (`zattera-agent zattera-log PATH ...`, the container's stdout
pipe on fd 3, stderr on fd 4, the readiness pipe on fd 5); the writer is
`cat` of a prepared file of numbered 100-byte lines, so the consumer is the
bottleneck in both cases. Every run is checked for loss: the shim's output
(compressed rotations and the live file) must hold every line once, in order.

Usage: measure.py AGENT_BINARY WORKDIR LINES RUNS REPORT_JSON
"""
import json
import os
import subprocess
import sys
import time


def make_input(path, lines):
    with open(path, "wb") as f:
        chunk = []
        for n in range(lines):
            chunk.append(b"line %012d %-81s\n" % (n, b"abcdefghijklmnopqrstuvwxyz0123456789"))
            if len(chunk) == 10000:
                f.write(b"".join(chunk))
                chunk = []
        f.write(b"".join(chunk))


def run(consumer_argv, input_path, fds_for_shim):
    """Feeds `cat input` into the consumer; wall seconds and the consumer's CPU."""
    feed = subprocess.Popen(["cat", input_path], stdout=subprocess.PIPE)
    if fds_for_shim:
        err_r, err_w = os.pipe()
        ready_r, ready_w = os.pipe()
        os.close(err_w)  # stderr: EOF at once

        def place():
            # Through spare numbers first: a source may already be 3, 4 or
            # 5, and dup2 onto itself would leave it close-on-exec.
            spare = [os.dup(fd) for fd in (feed.stdout.fileno(), err_r, ready_w)]
            for want, fd in zip((3, 4, 5), spare):
                os.dup2(fd, want, inheritable=True)

        start = time.monotonic()
        consumer = subprocess.Popen(consumer_argv, preexec_fn=place, stdin=subprocess.DEVNULL, close_fds=False)
        os.close(err_r)
        os.close(ready_w)
        os.read(ready_r, 1)  # the shim is ready when it closes fd 5
        os.close(ready_r)
    else:
        start = time.monotonic()
        consumer = subprocess.Popen(consumer_argv[:-1], stdin=feed.stdout,
                                    stdout=open(consumer_argv[-1], "wb"))
    feed.stdout.close()
    _, status, usage = os.wait4(consumer.pid, 0)
    wall = time.monotonic() - start
    feed.wait()
    if status != 0:
        sys.exit(f"{consumer_argv[0]} exited with {status}")
    return wall, usage.ru_utime + usage.ru_stime


def shim_lines(dirpath, live_name):
    """Every spewed number in the shim's files, in order (seq, then live)."""
    rotated = []
    for name in os.listdir(dirpath):
        if name.startswith(live_name + ".") and name.endswith(".zst"):
            rotated.append((int(name[len(live_name) + 1:-4]), name))
        elif name.startswith(live_name + ".") and not name.endswith(".tmp"):
            sys.exit(f"an uncompressed rotation was left: {name}")
    count = 0
    files = [n for _, n in sorted(rotated)] + [live_name]
    for name in files:
        path = os.path.join(dirpath, name)
        if name.endswith(".zst"):
            data = subprocess.run(["zstd", "-dcq", path], check=True, stdout=subprocess.PIPE).stdout
        else:
            with open(path, "rb") as f:
                data = f.read()
        for line in data.splitlines():
            text = line.split(b" ", 3)[3]
            n = int(text.split(b" ")[1])
            if n != count:
                sys.exit(f"{name}: want line {count}, found {text[:40]!r}")
            count += 1
    return count, len(rotated)


def main():
    agent, work, lines, runs, report = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    os.makedirs(work, exist_ok=True)
    input_path = os.path.join(work, "input")
    make_input(input_path, lines)
    mib = os.path.getsize(input_path) / (1 << 20)
    rows = {"cat": [], "shim": []}
    shim_cpu = []
    rotations = 0
    for i in range(runs):
        out = os.path.join(work, f"cat-{i}")
        wall, _ = run(["cat", out], input_path, False)
        rows["cat"].append(lines / wall)
        if os.path.getsize(out) != os.path.getsize(input_path):
            sys.exit("cat lost bytes")
        os.remove(out)

        d = os.path.join(work, f"shim-{i}")
        os.makedirs(d)
        live = os.path.join(d, "c.log")
        wall, cpu = run([agent, "zattera-log", live], input_path, True)
        rows["shim"].append(lines / wall)
        shim_cpu.append(cpu / mib)
        got, rotations = shim_lines(d, "c.log")
        if got != lines:
            sys.exit(f"the shim kept {got} of {lines} lines")
        subprocess.run(["rm", "-rf", d], check=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    result = {
        "lines": lines,
        "mib": round(mib, 1),
        "runs": runs,
        "cat_lines_per_s": [round(x) for x in rows["cat"]],
        "shim_lines_per_s": [round(x) for x in rows["shim"]],
        "ratio_p50": round(med(rows["shim"]) / med(rows["cat"]), 3),
        "shim_cpu_ms_per_mib": round(med(shim_cpu) * 1000, 2),
        "rotations_per_run": rotations,
        "lost_lines": 0,
    }
    with open(report, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the snapshot benchmark's tree: TOTAL_MIB (default 512) MiB of mixed
files, deterministic from a seed, so every run backs up the same bytes.

Most files are small (1-64 KiB random); medium ones (256 KiB - 4 MiB) and a
few large ones (32-64 MiB) hold most of the bytes; about a tenth are
text-like logs (compressible); about one in forty duplicates an earlier
file, whole or as a shared first half, the way copied releases, backups of
backups and rotated logs do.

usage: mktree.py DIR [TOTAL_MIB]
"""

import os
import random
import sys

MIB = 1 << 20


def main():
    root = sys.argv[1]
    total = int(sys.argv[2]) * MIB if len(sys.argv) > 2 else 512 * MIB
    rng = random.Random(20261201)
    os.makedirs(root)
    written, n, made = 0, 0, []
    words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(2000)]

    sizes = []

    def put(path, data):
        nonlocal written
        data = data[: max(1, total - written)]
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
        written += len(data)
        made.append(full)
        sizes.append(len(data))

    while written < total:
        n += 1
        d = "d%02d/s%02d" % (n % 23, n % 7)
        pick = rng.random()
        if pick < 0.74:
            size = rng.randint(1024, 64 * 1024)
            put("%s/small-%05d.bin" % (d, n), rng.randbytes(size))
        elif pick < 0.86:
            size = rng.randint(256 * 1024, 4 * MIB)
            put("%s/medium-%05d.bin" % (d, n), rng.randbytes(size))
        elif pick < 0.866:
            size = rng.randint(32 * MIB, 64 * MIB)
            put("%s/large-%05d.bin" % (d, n), rng.randbytes(size))
        elif pick < 0.975:
            lines = []
            size = 0
            target = rng.randint(64 * 1024, 2 * MIB)
            while size < target:
                line = b"2026-12-01T10:%02d:%02dZ INFO " % (rng.randint(0, 59), rng.randint(0, 59))
                line += b" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + b"\n"
                lines.append(line)
                size += len(line)
            put("%s/app-%05d.log" % (d, n), b"".join(lines))
        elif made:
            # A duplicate of an earlier file: whole, or its head plus new bytes.
            src = rng.choices(made, weights=sizes)[0]
            with open(src, "rb") as f:
                data = f.read()
            if rng.random() < 0.5 and len(data) > 8192:
                data = data[: len(data) // 2] + rng.randbytes(4096)
            put("copies/%s/copy-%05d" % (d, n), data)
    print("%s: %d files, %.1f MiB" % (root, len(made), written / MIB))


if __name__ == "__main__":
    main()

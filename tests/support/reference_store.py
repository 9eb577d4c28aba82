#!/usr/bin/env python3
"""Writes a data directory as the reference (Go) agent leaves it, from the
byte layouts in shared/spec/dataplane.md, independently of the agent's own
code: a log stream (LOG-1, LOG-3, LOG-6, LOG-7) and a metrics file (TS-8).

    reference_store.py DATA_DIR NODE_ID STREAM T0_UNIX_SECONDS

The stream gets one closed segment (two lines, compressed with the zstd
CLI, with its index) and an active segment (one line), at T0, T0+1 and
T0+2 s. tsdb.bin gets the node's memory_total_bytes = 4242 in the four raw
slots from T0 on, and one 5-minute point.
"""
import os
import struct
import subprocess
import sys


def uvarint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def record(time_ns, stderr, line):
    body = struct.pack("<qB", time_ns, 1 if stderr else 0) + line.encode()
    return uvarint(len(body)) + body


def write_logs(data, stream, t0):
    d = os.path.join(data, "logs", stream)
    os.makedirs(d, exist_ok=True)
    s = 1_000_000_000
    closed = record(t0 * s, False, "reference line 1") + record(t0 * s + s, True, "reference line 2")
    raw = os.path.join(d, "seg-00000000.raw")
    with open(raw, "wb") as f:
        f.write(closed)
    subprocess.run(["zstd", "-q", "-f", raw, "-o", os.path.join(d, "seg-00000000.zst")], check=True)
    os.remove(raw)
    with open(os.path.join(d, "seg-00000000.idx"), "wb") as f:
        f.write(struct.pack("<qqI", t0 * s, t0 * s + s, 1) + struct.pack("<Qq", 0, t0 * s))
    with open(os.path.join(d, "active.log"), "wb") as f:
        f.write(record(t0 * s + 2 * s, False, "reference line 3"))


def string(text):
    b = text.encode()
    return struct.pack("<I", len(b)) + b


def write_tsdb(data, node_id, t0):
    raw_slots, down_slots = 5760, 8640
    first = t0 // 15
    raw_abs = [-1] * raw_slots
    raw_val = [0.0] * raw_slots
    for slot in range(first, first + 4):
        raw_abs[slot % raw_slots] = slot
        raw_val[slot % raw_slots] = 4242.0
    down_abs = [-1] * down_slots
    down_val = [0.0] * down_slots
    down_cnt = [0] * down_slots
    d = first // 20
    down_abs[d % down_slots], down_val[d % down_slots], down_cnt[d % down_slots] = d, 4242.0, 4
    out = struct.pack("<III", 0x5A545344, 1, 1)
    out += string("memory_total_bytes") + string("node") + string(node_id)
    out += struct.pack("<q", first + 3)
    out += struct.pack(f"<{raw_slots}q", *raw_abs) + struct.pack(f"<{raw_slots}f", *raw_val)
    out += struct.pack(f"<{down_slots}q", *down_abs) + struct.pack(f"<{down_slots}f", *down_val)
    out += struct.pack(f"<{down_slots}H", *down_cnt)
    os.makedirs(os.path.join(data, "metrics"), exist_ok=True)
    with open(os.path.join(data, "metrics", "tsdb.bin"), "wb") as f:
        f.write(out)


def main():
    data, node_id, stream, t0 = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    write_logs(data, stream, t0)
    write_tsdb(data, node_id, t0)


if __name__ == "__main__":
    main()

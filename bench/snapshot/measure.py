#!/usr/bin/env python3
"""Helpers for run.sh.

  measure.py RESULTS LABEL CMD...    run CMD, append "LABEL wall_s peak_rss_kib" to RESULTS
  measure.py --bucket-bytes ENDPOINT BUCKET    the bytes of every object in BUCKET
  measure.py --report RESULTS TREE_BYTES FILES AGENT_STORED RESTIC_STORED
"""

import os
import subprocess
import sys
import time


def run(results, label, cmd):
    log = open(results + "." + label + ".log", "w")
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - start
    if status != 0:
        log.close()
        sys.stderr.write(open(results + "." + label + ".log").read())
        sys.exit("%s failed (status %d)" % (label, status))
    with open(results, "a") as f:
        f.write("%s %.3f %d\n" % (label, wall, usage.ru_maxrss))
    print("%-18s %7.2f s  peak RSS %6.1f MiB" % (label, wall, usage.ru_maxrss / 1024), file=sys.stderr)


def bucket_bytes(endpoint, bucket):
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench-secret",
                      region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
    total = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        total += sum(o["Size"] for o in page.get("Contents", []))
    print(total)


def report(results, tree_bytes, files, agent_stored, restic_stored):
    rows = {}
    for line in open(results):
        label, wall, rss = line.split()
        rows[label] = (float(wall), int(rss))
    tree_bytes, agent_stored, restic_stored = int(tree_bytes), int(agent_stored), int(restic_stored)
    mib = tree_bytes / (1 << 20)
    print("tree: %.0f MiB in %s files; agent stored %.1f MiB, restic %.1f MiB\n"
          % (mib, files, agent_stored / (1 << 20), restic_stored / (1 << 20)))
    print("| step | agent | restic | agent / restic (throughput) |")
    print("|---|---|---|---|")
    for step in ("first", "unchanged", "restore"):
        a, r = rows["agent-" + step], rows["restic-" + step]
        print("| %s | %.2f s, %.0f MiB/s, peak RSS %.0f MiB | %.2f s, %.0f MiB/s, peak RSS %.0f MiB | %.2f× |"
              % (step, a[0], mib / a[0], a[1] / 1024, r[0], mib / r[0], r[1] / 1024, r[0] / a[0]))
    da, dr = tree_bytes / agent_stored, tree_bytes / restic_stored
    print("| dedup ratio (tree / stored) | %.3f | %.3f | %+.1f %% |" % (da, dr, (da / dr - 1) * 100))


if __name__ == "__main__":
    if sys.argv[1] == "--bucket-bytes":
        bucket_bytes(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--report":
        report(*sys.argv[2:7])
    else:
        run(sys.argv[1], sys.argv[2], sys.argv[3:])

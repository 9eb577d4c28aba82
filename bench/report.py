#!/usr/bin/env python3
"""Runs the benchmarks and writes one report (bench/report.sh is the entry).

Each benchmark runs as `bash bench/<name>/run.sh` with the bounded sizes
below, one after the other (they share two cores), under a time limit. Its
whole output is kept in bench/results/<date>/<name>.txt with the machine's
load before and after. Rows of the ratio table come from `ROW` lines a
benchmark prints (`ROW bench | measure | agent | peer | peer value | ratio |
goal | verdict`) or, for those that write JSON results, from that JSON;
growth curves come from `CURVE name x y unit` lines and become SVG plots.
Standard library only.
"""

import datetime
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name: (environment for a bounded run, time limit in seconds)
BENCHES = {
    "dns": ({"RUNS": "3", "DURATION": "6"}, 600),
    "executor": ({"COUNTS": "1 10 50 100 200", "ROUNDS": "3", "IDLE_SECS": "30"}, 2400),
    "density": ({"COUNTS": "1 10 50 100 200"}, 2400),
    "runtime": ({"ROUNDS": "20", "PULL_ROUNDS": "5"}, 900),
    "control": ({"IDLE_SECS": "30", "CONVERGE_SECS": "540"}, 900),
    "netns": ({}, 900),
    "build": ({"RUNS": "3"}, 1800),
    "snapshot": ({"TREE_MIB": "256"}, 1200),
    "logs": ({"LINES": "1000000", "RUNS": "3"}, 900),
    "metrics": ({"INSTANCES": "100", "SCRAPES": "50"}, 900),
    "mesh": ({"SECS": "10", "COUNT": "200"}, 600),
    "vm": ({"MIB": "32", "PINGS": "30"}, 2400),
    "wake": ({"ROUNDS": "5"}, 600),
    "scale": ({"COUNT": "1000"}, 3000),
}
# Plots: file name, title, y label, curves drawn on it.
PLOTS = [
    ("converge", "Cold converge time", "ms", ["converge_ms", "converge_ms_ctr"]),
    ("density", "Node memory per instance (PSS: shims, log shims, agent and containerd growth)", "MiB",
     ["node_pss_mib_per_instance", "node_pss_mib_per_instance_ctr"]),
    ("rss", "Agent resident memory", "KiB", ["agent_rss_kib"]),
    ("cpu-per-pass", "Agent CPU per steady pass (window CPU / passes)", "ms", ["agent_cpu_ms_per_pass"]),
    ("cpu-per-second", "Agent CPU in steady state, per second", "ms", ["agent_cpu_ms_per_s"]),
    ("pass-time", "Steady pass time (p50)", "us", ["pass_p50_us"]),
    ("dns-names", "Resolver peak by table size", "qps", ["dns_qps_by_names"]),
    ("rules", "Rules rebuild by published ports", "ms", ["rules_rebuild_ms"]),
]
X_LABEL = {"dns-names": "names", "rules": "published ports"}


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run(name, env, limit, out_dir):
    """Runs one benchmark; returns (exit code, seconds, output)."""
    cmd = ["bash", os.path.join(HERE, name, "run.sh")]
    if name == "netns":
        cmd = ["cargo", "bench", "-q", "-p", "zattera-netns", "--bench", "netns"]
    # A setting in the caller's environment overrides the bounded default.
    full_env = {**env, **os.environ}
    before = load()
    started = time.monotonic()
    print(f"== {name} (limit {limit} s, load {before})", flush=True)
    # Its own session, so that a timeout stops the whole benchmark (its
    # cargo, its bench binary, the agents it started), not just the script:
    # SIGTERM first, so the scripts' exit traps clean up, then SIGKILL.
    p = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=limit)
        code, output = p.returncode, out + err
    except subprocess.TimeoutExpired:
        code = "timeout"
        out, err = "", ""
        for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = p.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                out, err = "", ""
        output = (out or "") + (err or "")
    secs = time.monotonic() - started
    after = load()
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write(f"# {' '.join(cmd)} {env}\n# exit {code}, {secs:.0f} s, load before {before}, after {after}\n")
        f.write(output)
    print(f"   exit {code}, {secs:.0f} s", flush=True)
    return code, secs, output, before, after


def rows_from_lines(output):
    rows = []
    for line in output.splitlines():
        if line.startswith("ROW "):
            parts = [p.strip() for p in line[4:].split("|")]
            if len(parts) == 8:
                rows.append(parts)
    return rows


def newest_json(name, since):
    files = [f for f in glob.glob(os.path.join(HERE, name, "results", "*.json")) if os.path.getmtime(f) >= since]
    return json.load(open(max(files, key=os.path.getmtime))) if files else None


def verdict(ratio, goal):
    op, value = goal.split()
    ok = ratio <= float(value) if op == "<=" else ratio >= float(value)
    return "met" if ok else "MISSED"


def rows_from_json(name, doc):
    """The ratio rows of the benchmarks that report in JSON."""
    rows = []
    if doc is None:
        return rows
    if name == "build":
        res = doc.get("results", {})
        for agent, peer, what in [
            ("agent-cold", "buildah-cold", "build, cold"),
            ("agent-cached", "buildah-cached", "build, layer cache"),
            ("agent-bk-cold", "buildctl-cold", "BuildKit build, cold"),
            ("agent-bk-cached", "buildctl-cached", "BuildKit build, cached"),
        ]:
            if agent in res and peer in res:
                a, p = res[agent]["median_s"], res[peer]["median_s"]
                rows.append(["build", what + ", median s", f"{a:.2f}", peer.rsplit("-", 1)[0], f"{p:.2f}",
                             f"{a / p:.2f}", "<= 1.05", verdict(a / p, "<= 1.05")])
    elif name == "logs":
        r = doc["ratio_p50"]
        median = lambda v: sorted(v)[len(v) // 2] if isinstance(v, list) and v else v
        rows.append(["logs", "lines/s through the log shim (p50)", str(median(doc.get("shim_lines_per_s", ""))),
                     "cat to a file", str(median(doc.get("cat_lines_per_s", ""))), f"{r:.2f}", ">= 0.8",
                     verdict(r, ">= 0.8")])
    elif name == "mesh":
        t, l = doc["throughput_gbit"], doc["rtt_ms"]
        rows.append(["mesh", "TCP throughput, Gbit/s", f"{t['mesh']:.2f}", "plain veth", f"{t['veth']:.2f}",
                     f"{t['ratio']:.2f}", ">= 0.5", verdict(t["ratio"], ">= 0.5")])
        rows.append(["mesh", "round trip p50, ms", f"{l['mesh']['p50']:.3f}", "plain veth", f"{l['veth']['p50']:.3f}",
                     f"{l['ratio_p50']:.2f}", "<= 2.0", verdict(l["ratio_p50"], "<= 2.0")])
    elif name == "metrics":
        rows.append(["metrics", f"one /metrics scrape, {doc['instances']} instances, p50 ms",
                     str(doc["scrape_ms_p50"]), "-", "-", "-", "-", "-"])
    return rows


def rows_from_text(name, output):
    """Rows parsed from the human output of the Rust and Python benches."""
    rows = []
    if name == "control":
        dec = re.search(r"^decode only\s+p50\s+([\d.]+)(µs|ms)", output, re.M)
        noop = re.search(r"^no-op pass\s+p50\s+([\d.]+)(µs|ms)", output, re.M)
        if dec and noop:
            to_ms = lambda m: float(m.group(1)) / (1000 if m.group(2) == "µs" else 1)
            d, n = to_ms(dec), to_ms(noop)
            rows.append(["control", "no-op pass over 1,000 assignments, p50 ms", f"{n:.2f}",
                         "prost decode of the set", f"{d:.2f}", f"{n / d:.2f}", "-",
                         "met (<= 5 ms)" if n <= 5 else "MISSED (<= 5 ms)"])
        # As deployed (control_converge): the real binary with its 1,000
        # instances running, and the pass that starts 10 changes among them.
        steady = re.search(r"^\s*steady: .*no-op pass p50 ([\d.]+) ms \((\d+) passes\)", output, re.M)
        change = re.search(r"passes that started or stopped work: \[\"([\d.]+)\"", output)
        count = re.search(r"^control_converge bench: (\d+) instances HEALTHY", output, re.M)
        if steady and count:
            n = float(steady.group(1))
            rows.append(["control", f"no-op pass as deployed, {int(count.group(1)):,} instances, p50 ms", f"{n:.1f}",
                         "-", "-", "-", "-", "met (<= 5 ms)" if n <= 5 else "MISSED (<= 5 ms)"])
            if change:
                c = float(change.group(1))
                rows.append(["control", f"pass that starts 10 changes of {int(count.group(1)):,}, ms", f"{c:.1f}",
                             "no-op pass as deployed", f"{n:.1f}", f"{c / n:.2f}", "-", "-"])
    elif name == "snapshot":
        for m in re.finditer(r"^\| (first snapshot|unchanged|restore)[^|]*\|[^|]*\|[^|]*\| ([\d.]+)×", output, re.M):
            r = float(m.group(2))
            rows.append(["snapshot", m.group(1) + ", throughput", "-", "restic", "-", f"{r:.2f}", ">= 1.0",
                         verdict(r, ">= 1.0")])
    elif name == "netns":
        ours = re.search(r"^zattera-netns[^:]*: n=\d+ p50=([\d.]+)", output, re.M)
        cni = re.search(r"^CNI[^:]*: n=\d+ p50=([\d.]+)", output, re.M)
        if ours and cni:
            o, c = float(ours.group(1)), float(cni.group(1))
            rows.append(["netns", "attach + publish + detach, p50 ms", f"{o:.1f}", "CNI bridge+portmap",
                         f"{c:.1f}", f"{o / c:.2f}", "<= 0.5", verdict(o / c, "<= 0.5")])
    return rows


def curves_from(output):
    curves = {}
    for line in output.splitlines():
        m = re.match(r"^CURVE (\S+) (\S+) (\S+) (\S+)$", line)
        if m:
            try:
                curves.setdefault(m.group(1), []).append((float(m.group(2)), float(m.group(3))))
            except ValueError:
                pass
    return curves


def svg(title, y_label, x_label, series):
    """A line plot with log-scaled x (counts grow by decades), plain SVG."""
    import math

    w, h, left, right, top, bottom = 560, 320, 70, 150, 30, 45
    xs = sorted({x for pts in series.values() for x, _ in pts if x > 0})
    ys = [y for pts in series.values() for _, y in pts]
    if not xs or not ys:
        return None
    lx = [math.log10(x) for x in xs]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1
    y1 = max(ys) * 1.1 or 1
    px = lambda x: left + (math.log10(x) - x0) / (x1 - x0) * (w - left - right)
    py = lambda y: h - bottom - y / y1 * (h - top - bottom)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13">{title}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
           f'<text x="{(left + w - right) / 2}" y="{h - 8}" text-anchor="middle">{x_label} (log scale)</text>',
           f'<text x="14" y="{(top + h - bottom) / 2}" transform="rotate(-90 14 {(top + h - bottom) / 2})" '
           f'text-anchor="middle">{y_label}</text>']
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{h - bottom + 15}" text-anchor="middle">{x:g}</text>')
    for i in range(5):
        y = y1 * i / 4
        out.append(f'<text x="{left - 5}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
        out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{w - right}" y2="{py(y):.1f}" stroke="#ddd"/>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        c = colors[i % len(colors)]
        pts = sorted(p for p in pts if p[0] > 0)
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{path}"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"><title>{x:g}: {y:g}</title></circle>')
        out.append(f'<text x="{w - right + 8}" y="{top + 14 * (i + 1)}" fill="{c}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main():
    wanted = sys.argv[1:] or list(BENCHES)
    unknown = [b for b in wanted if b not in BENCHES]
    if unknown:
        sys.exit(f"bench/report: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHES)}")
    # REPORT_NAME names the report and its raw directory (default: the date).
    date = os.environ.get("REPORT_NAME") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%MZ")
    results = os.path.join(HERE, "results")
    raw = os.path.join(results, date)
    os.makedirs(raw, exist_ok=True)
    rows, curves, runs = [], {}, []
    for name in wanted:
        env, limit = BENCHES[name]
        since = time.time()
        code, secs, output, before, after = run(name, env, limit, raw)
        got = rows_from_lines(output) + rows_from_json(name, newest_json(name, since)) + rows_from_text(name, output)
        if not got:
            got = [[name, "(no figures: see the raw output)", "-", "-", "-", "-", "-", f"exit {code}"]]
        rows += got
        for k, v in curves_from(output).items():
            curves.setdefault(k, []).extend(v)
        runs.append((name, code, secs, before, after, {k: os.environ.get(k, v) for k, v in env.items()}))

    plots = []
    for file, title, unit, names in PLOTS:
        series = {n: curves[n] for n in names if n in curves}
        doc = svg(title, unit, X_LABEL.get(file, "instances"), series)
        if doc:
            with open(os.path.join(raw, f"{file}.svg"), "w") as f:
                f.write(doc)
            plots.append((file, title, series))
    with open(os.path.join(raw, "curves.json"), "w") as f:
        json.dump(curves, f, indent=1)

    md = [f"# Benchmark report, {stamp}", "",
          f"Machine: {os.cpu_count()} cores, {os.uname().release}, "
          f"load at the end {load()}. Generated by `bash bench/report.sh {' '.join(sys.argv[1:])}`.".rstrip(), "",
          "Every ratio is the agent's figure over the peer's, measured in the same run on this machine.", "",
          "| bench | measure | agent | peer | peer value | ratio | goal | verdict |",
          "|---|---|---|---|---|---|---|---|"]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += ["", "## Growth curves", ""]
    for file, title, series in plots:
        md.append(f"### {title}")
        md.append("")
        md.append(f"![{title}]({date}/{file}.svg)")
        md.append("")
        for n, pts in sorted(series.items()):
            md.append(f"- `{n}`: " + ", ".join(f"{x:g} → {y:g}" for x, y in sorted(pts)))
        md.append("")
    md += ["## Runs", "", "| bench | exit | seconds | load before | load after | settings |", "|---|---|---|---|---|---|"]
    for name, code, secs, before, after, env in runs:
        settings = " ".join(f"{k}={v}" for k, v in env.items()) or "-"
        md.append(f"| {name} | {code} | {secs:.0f} | {before} | {after} | {settings} |")
    md += ["", f"Raw output of each benchmark: [`{date}/`]({date}/).", ""]
    report = os.path.join(results, f"{date}.md")
    with open(report, "w") as f:
        f.write("\n".join(md))
    print(f"report: {report}")


if __name__ == "__main__":
    main()

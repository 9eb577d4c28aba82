#!/usr/bin/env python3
"""What the test run did not run, and whether the README may rely on it.

    scripts/skips.py RECORD [--readme README.md] [--check]

RECORD is the file the tests append their skips to (zattera_testkit,
ZATTERA_TEST_SKIPS): one `<binary>\t<test>\t<reason>` line per skip. Prints
every skipped test with its reason, and the tests the sources mark
`#[ignore = "..."]` (run elsewhere, by name). With --check, exits 1 when a
skipped test is cited in the README (its function name appears there) but
is missing from the README's section "What CI does not run": the README
must never cite as evidence a test that CI skips without saying so.
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_RUN_HEADING = "What CI does not run"


def skipped(record):
    rows = []
    path = pathlib.Path(record)
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split("\t", 2)
        if len(parts) == 3:
            rows.append(tuple(parts))
    return sorted(set(rows))


def ignored():
    """(file, test, reason) for every `#[ignore = ..]` test in the workspace."""
    rows = []
    for path in sorted(ROOT.rglob("*.rs")):
        if "target" in path.parts or ".git" in path.parts:
            continue
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            m = re.match(r'\s*#\[ignore(?: = "(.*)")?\]', line)
            if not m:
                continue
            for nxt in lines[i + 1 : i + 6]:
                f = re.search(r"fn (\w+)", nxt)
                if f:
                    rows.append((str(path.relative_to(ROOT)), f.group(1), m.group(1) or "no reason given"))
                    break
    return rows


def not_run_section(readme):
    """The text of the README's section that lists what CI does not run."""
    lines = readme.splitlines()
    out, inside, level = [], False, 0
    for line in lines:
        m = re.match(r"(#+) (.*)", line)
        if m and inside and len(m.group(1)) <= level:
            break
        if m and m.group(2).strip() == NOT_RUN_HEADING:
            inside, level = True, len(m.group(1))
            continue
        if inside:
            out.append(line)
    return "\n".join(out), inside


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("record")
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    skips = skipped(args.record)
    print(f"\n== tests skipped in this run: {len(skips)} ==")
    for binary, test, reason in skips:
        print(f"  SKIPPED {binary} {test}: {reason}")
    ignores = ignored()
    print(f"== tests marked #[ignore] (run elsewhere): {len(ignores)} ==")
    for path, test, reason in ignores:
        print(f"  IGNORED {path} {test}: {reason}")
    if not args.check:
        return 0

    readme = pathlib.Path(args.readme).read_text()
    section, found = not_run_section(readme)
    bad = []
    for binary, test, reason in skips:
        name = test.rsplit("::", 1)[-1]
        if not re.search(rf"\b{re.escape(name)}\b", readme):
            continue
        if not found or not re.search(rf"\b{re.escape(name)}\b", section):
            bad.append((binary, test, reason))
    for binary, test, reason in bad:
        print(
            f"ERROR: {test} ({binary}) skipped ({reason}), and the README cites it without "
            f'listing it under "{NOT_RUN_HEADING}"',
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

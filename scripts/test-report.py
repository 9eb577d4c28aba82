#!/usr/bin/env python3
"""The tests that failed, and those that failed once and passed when run
again (flaky), each with its failure's message: printed at the end of a
run, where a log cut in the middle still shows them.

    scripts/test-report.py JUNIT

JUNIT is the report cargo-nextest writes (.config/nextest.toml). For each
test: its panic message (up to the backtrace) and the last lines the test
wrote to stderr before it.
"""

import pathlib
import sys
import xml.etree.ElementTree as ET

MESSAGE_LINES = 15
STDERR_LINES = 6


def excerpt(stderr):
    """The lines before the panic, and the panic message up to the backtrace."""
    lines = (stderr or "").splitlines()
    at = next((i for i, l in enumerate(lines) if " panicked at " in l), None)
    if at is None:
        return [l for l in lines if l.strip()][-MESSAGE_LINES:]
    before = [l for l in lines[:at] if l.strip()][-STDERR_LINES:]
    message = []
    for line in lines[at:]:
        if line.startswith("stack backtrace:") or line.startswith("note: run with"):
            break
        message.append(line)
    if len(message) > MESSAGE_LINES:
        message = message[:MESSAGE_LINES] + [f"[... {len(message) - MESSAGE_LINES} more lines]"]
    return before + message


def stderr_of(element):
    err = element.find("system-err")
    if err is not None and err.text:
        return err.text
    return element.text or ""


def main():
    path = pathlib.Path(sys.argv[1])
    if not path.exists():
        print(f"== no test report at {path} ==")
        return
    failed, flaky = [], []
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for case in suite.iter("testcase"):
            name = f"{suite.get('name')} {case.get('name')}"
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            if failure is not None:
                # The last run's output is the test case's own.
                failed.append((name, excerpt(stderr_of(case) or failure.text)))
                continue
            first = case.find("flakyFailure")
            if first is not None:
                flaky.append((name, excerpt(stderr_of(first))))
    for title, rows in (
        ("tests that failed", failed),
        ("flaky tests (failed, then passed when run again)", flaky),
    ):
        print(f"== {title}: {len(rows)} ==")
        for name, lines in rows:
            print(f"  {name}")
            for line in lines:
                print(f"    | {line}")


if __name__ == "__main__":
    main()

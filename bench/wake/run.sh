#!/usr/bin/env bash
# Wake (issue 59): a cold start of an app with a health check, as a user
# waits for it. See bench/wake/README.md. Root; about 2 minutes.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../lib/python-bench.sh" wake

#!/usr/bin/env bash
# Scale (issue 59): a thousand instances on one node. See
# bench/scale/README.md. Root; about 15 minutes at 1,000.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../lib/python-bench.sh" scale

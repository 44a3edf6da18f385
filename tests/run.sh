#!/usr/bin/env bash
# The whole test suite, setting up first when needed:  bash tests/run.sh [pytest args]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash setup-utils/install.sh
echo "== ruff"
.venv/bin/ruff check .
echo "== pytest"
df -h "${TMPDIR:-/tmp}" | tail -n 1 | awk '{print "free in the temporary folder: " $4}'
.venv/bin/python -m pytest -q --tb=short --durations=25 "$@"  # the slowest, to keep it under 30 minutes

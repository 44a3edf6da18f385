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
# Two test files at a time (each file's tests in turn, in one worker: they share its
# fixtures): a test's processes keep about one of CI's 2 cores busy on average, so the
# suite is bound by CPU (docs/tests.md). xdist hands out the files with the most tests first, which pairs a long file
# with many short ones; the longest files first paired CPU-bound tests and was slower.
# PFC_TEST_WORKERS=0 runs everything in this process, one test after another.
.venv/bin/python -m pytest -q --tb=short -n "${PFC_TEST_WORKERS:-2}" --dist loadfile \
  --durations=25 "$@"  # the slowest, to keep it under 30 minutes

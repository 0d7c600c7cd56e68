#!/usr/bin/env bash
# Set up .venv (torch, dpex, test extras) and run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k parity -x`.
DPEX_EXTRAS=test,dev,examples,bench
source "$(dirname "$0")/_env.sh"
# DPEX_TEST_PROCESSES=2 runs two test processes (pytest-xdist), each with its own
# embedded Ray, all tests of a file in the same one: 35 min instead of 45 here, but
# two timing tests can fail beside a busy neighbour (README, Development), so the
# default is one process.
if [ "${DPEX_TEST_PROCESSES:-0}" != 0 ]; then
  set -- -n "$DPEX_TEST_PROCESSES" --dist loadfile "$@"
fi
# pytest exits 5 when it collects nothing: with `set -e` that fails the run too.
# The slowest tests are listed at the end (the suite's time is a target: README).
python -m pytest --durations=25 "$@"

#!/usr/bin/env bash
# Set up .venv (torch, dpex, test extras) and run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k parity -x`.
DPEX_EXTRAS=test,dev,examples,bench
source "$(dirname "$0")/_env.sh"
# Two test processes (pytest-xdist), each with its own embedded Ray; all tests of a
# file run in the same one (its module fixtures, e.g. a cluster, start once).
# DPEX_TEST_PROCESSES=0 runs the suite in this process alone.
# pytest exits 5 when it collects nothing: with `set -e` that fails the run too.
# The slowest tests are listed at the end (the suite's time is a target: README).
python -m pytest -n "${DPEX_TEST_PROCESSES:-2}" --dist loadfile --durations=25 "$@"

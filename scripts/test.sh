#!/usr/bin/env bash
# Set up .venv (torch, dpex, test extras) and run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k parity -x`.
# Two test processes (pytest-xdist), each with its own embedded Ray, all tests of a
# file in the same one: the suite is bound by CPU and one process leaves the cores
# idle about 30 % of the time (README, Development). DPEX_TEST_PROCESSES=1 runs one.
PROCESSES="${DPEX_TEST_PROCESSES:-2}"
case "$PROCESSES" in
  ""|*[!0-9]*) echo "DPEX_TEST_PROCESSES must be a number of test processes, got '$PROCESSES'" >&2
               exit 2 ;;
esac
# A first argument `fast`, `ray` or `e2e` runs one tier (README, Development): fast
# needs neither Ray nor a subprocess, ray is the shared Ray instance, e2e the rest.
case "${1:-}" in
  fast) shift; set -- -m "not ray and not e2e" "$@" ;;
  ray)  shift; set -- -m "ray" "$@" ;;
  e2e)  shift; set -- -m "e2e" "$@" ;;
esac
DPEX_EXTRAS=test,dev,examples,bench
source "$(dirname "$0")/_env.sh"
if [ "$PROCESSES" -gt 1 ]; then
  set -- -n "$PROCESSES" --dist loadfile "$@"
fi
# pytest exits 5 when it collects nothing: with `set -e` that fails the run too.
# The slowest tests are listed at the end (the suite's time is a target: README).
python -m pytest --durations=25 "$@"

#!/usr/bin/env bash
# Set up .venv (torch, dpex, the demo's progress bar) and run the demo on a local Ray.
# Extra arguments go to scripts/demo.py, e.g. `scripts/demo.sh --workers 4 --epochs 3`.
DPEX_EXTRAS=demo
source "$(dirname "$0")/_env.sh"
python scripts/demo.py "$@"

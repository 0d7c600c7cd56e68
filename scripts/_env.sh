# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv and installs dpex into it.
# torch goes in first, pinned: a bare `torch` requirement with no torch installed would
# pull the newest CUDA build (several GB) where a local CPU wheel of 2.13.0 exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "dpex: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  echo "dpex: installing torch==${DPEX_TORCH_VERSION:-2.13.0}"
  python -m pip install --quiet "torch==${DPEX_TORCH_VERSION:-2.13.0}"
fi
echo "dpex: installing dpex and its ${DPEX_EXTRAS:-default} dependencies"
# Pinned to the torch just installed: no dependency may swap it for another build.
TORCH_NOW="$(python -c 'import importlib.metadata as m; print(m.version("torch"))')"
python -m pip install --quiet -e ".${DPEX_EXTRAS:+[$DPEX_EXTRAS]}" "torch==$TORCH_NOW"

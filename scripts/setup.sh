#!/usr/bin/env bash
# Set up keraunos from nothing: a virtual environment in .venv with torch 2.13.0 (the CPU build on
# this machine's disk; pip is never left to choose a CUDA build), keraunos itself (editable) and
# its test dependencies. Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install torch==2.13.0
fi
if ! .venv/bin/python -c "import keraunos, litgpt, pytest, expecttest, transformers" 2>/dev/null; then
  "${PIP[@]}" install -c scripts/constraints.txt -e ".[test]"
fi
.venv/bin/python -c "import torch, keraunos; print('keraunos', keraunos.__version__, 'with torch', torch.__version__)"

#!/usr/bin/env bash
# Set up keraunos from nothing: a virtual environment in .venv with torch 2.13.0 (the CPU build on
# this machine's disk; pip is never left to choose a CUDA build), keraunos itself (editable), its
# test dependencies and the bench extra. Safe to run again: it installs only what is missing.
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
# The test extra, and the bench extra so that `keraunos bench` runs and draws its chart.
if ! .venv/bin/python -c "import keraunos, litgpt, pytest, xdist, expecttest, transformers, \
    accelerate, lightning, matplotlib" 2>/dev/null; then
  "${PIP[@]}" install -c scripts/constraints.txt -e ".[test,bench]"
fi
# torchvision (the vision extra) beside the environment, not in it: the wheel pip picks beside
# the CPU torch 2.13 is a CUDA build whose import fails, and lightning, torchmetrics and litgpt
# import torchvision whenever it is installed. In .venv/vendor only keraunos.testing.vision finds
# it (it defines the two missing operator schemas first; see that module).
if [ ! -d .venv/vendor/torchvision ]; then
  "${PIP[@]}" install --no-deps --target .venv/vendor torchvision==0.28.0
fi
# timm (pure Python; it imports torchvision) beside it, for `benchmarks/sweep.py --suite timm`
# and tests/test_sweep.py.
if [ ! -d .venv/vendor/timm ]; then
  "${PIP[@]}" install --no-deps --target .venv/vendor timm==1.0.31
fi
# Headless Chromium for the report's browser tests (tests/test_report.py): Debian's package, only
# when missing, only where apt-get can run as root. Any failure is reported and the tests skip.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium </dev/null >/dev/null 2>&1 \
      || { apt-get update -q </dev/null >/dev/null 2>&1 \
           && apt-get install -y -q chromium </dev/null >/dev/null 2>&1; } \
      || echo "setup.sh: could not install chromium with apt-get; the browser tests will skip"
  else
    echo "setup.sh: chromium is not installed (needs root and apt-get); the browser tests will skip"
  fi
fi
# The native hit path (keraunos/runtime/native): compiled here once (about 10 s of one core) into
# ~/.cache/keraunos-native, so that the tests and the first jitted call find it built. Without a
# compiler keraunos uses the Python hit path, so a failure here is reported and nothing more.
.venv/bin/python -m keraunos.runtime.native || echo "setup.sh: keraunos will use the Python hit path"
.venv/bin/python -c "import torch, keraunos; print('keraunos', keraunos.__version__, 'with torch', torch.__version__)"

#!/usr/bin/env bash
# A virtual environment with another torch release than .venv's, for running the suite on every
# torch keraunos supports (.ci/run; docs/compatibility.md). Usage: scripts/torch_env.sh 2.14.1
# or scripts/torch_env.sh 2.15.0; prints the environment's python.
#
# The environment is kept in $KERAUNOS_ENV_CACHE (default ~/.cache/keraunos-envs)/torch-VERSION
# and reused while its torch is that release (torch 2.15.0's CUDA build is about 2.7 GB from
# PyPI). keraunos itself is installed editable from this checkout on every run, so the cached
# environment always tests the code beside this script.
#
# - 2.14.1 with torchvision 0.29.1: both lie on this machine's disk.
# - 2.15.0 from PyPI, without torchvision (no torchvision release for torch 2.15 is on PyPI yet:
#   tests/test_vision.py skips there, and runs beside 2.13 and 2.14).
# Both with the test extra's pins (transformers 5.3.0 beside litgpt 0.5.13).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:?usage: scripts/torch_env.sh TORCH_VERSION}"
PYTHON="${PYTHON:-python3}"
CACHE="${KERAUNOS_ENV_CACHE:-$HOME/.cache/keraunos-envs}"
ENV="$CACHE/torch-$VERSION"
case "$VERSION" in
  2.14.1) EXTRA=(torchvision==0.29.1) ;;
  2.15.0) EXTRA=() ;;
  *) echo "torch_env.sh: no recipe for torch $VERSION" >&2; exit 2 ;;
esac
# The machine's pip configuration may cap torch at the release on its disk: a release above the
# cap comes from PyPI with that configuration set aside.
export PIP_CONFIG_FILE=/dev/null
PIP=("$ENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$ENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" \
    2>/dev/null; then
  rm -rf "$ENV"
  mkdir -p "$CACHE"
  "$PYTHON" -m venv "$ENV"
  "${PIP[@]}" install "torch==$VERSION" >&2
fi
if ! "$ENV/bin/python" -c "import litgpt, pytest, xdist, expecttest, transformers, accelerate, \
    lightning, matplotlib" 2>/dev/null; then
  "${PIP[@]}" install -e ".[test,bench]" "torch==$VERSION" "${EXTRA[@]}" >&2
fi
# This checkout, editable (its entry point registers torch.compile's "keraunos" backend).
"${PIP[@]}" install --no-deps -e . >&2
"$ENV/bin/python" -m keraunos.runtime.native >&2 || echo "torch_env.sh: the native hit path did not build" >&2
echo "$ENV/bin/python"

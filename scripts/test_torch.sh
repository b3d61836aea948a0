#!/usr/bin/env bash
# The suite on another torch release than .venv's: scripts/test_torch.sh VERSION [full|slice]
# (.ci/run runs it for every supported release besides 2.13; docs/compatibility.md). The
# environment comes from scripts/torch_env.sh (cached between runs). "slice" runs the test files
# that reach each part of torch's private machinery keraunos uses (keraunos/torch_internals):
# what a torch release that changed them fails first.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:?usage: scripts/test_torch.sh TORCH_VERSION [full|slice]}"
WHAT="${2:-full}"
PY="$(bash scripts/torch_env.sh "$VERSION")"
SLICE=(
  tests/test_torch_internals.py tests/test_fast_paths.py   # the boundary, the fast paths
  tests/test_symbolic.py                                   # fake tensors, ShapeEnv
  tests/test_inplace_alias.py tests/test_ambient_state.py  # dispatch, torch function, settings
  tests/test_autograd.py tests/test_distributed.py         # autograd.Function, DTensor
  tests/test_dynamo.py tests/test_native_hit_path.py       # dynamo's guards and backend route
  tests/test_program_store.py                              # guards' state in the store's keys
  tests/test_one_build.py tests/test_compile_workers.py    # Inductor: compile, bindings, caches
  tests/test_kernel_store.py tests/test_tiers.py
  tests/test_isolation.py tests/test_fuzz.py               # fx's tracing flag, process state
  tests/test_transformers.py                               # libraries on top of torch
)
case "$WHAT" in
  full) TESTS=() ;;
  slice) TESTS=("${SLICE[@]}") ;;
  *) echo "test_torch.sh: full or slice, not $WHAT" >&2; exit 2 ;;
esac
echo "== the suite ($WHAT) on torch $VERSION: $PY"
set +e
"$PY" -m pytest -n auto --dist worksteal -p no:cacheprovider "${TESTS[@]}"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "test_torch.sh: pytest collected no tests on torch $VERSION" >&2
  exit 1
fi
exit "$status"

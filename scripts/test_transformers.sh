#!/usr/bin/env bash
# The tests that run transformers' models, on transformers' newest release (docs/compatibility.md):
# scripts/test_transformers.sh [VERSION]. The test extra pins transformers 5.3.0, the newest
# that installs beside litgpt 0.5.13 (which requires huggingface-hub < 1.4); this environment
# has no litgpt, so it takes the newest transformers and the hub it requires. torch is 2.13.0,
# the CPU build on this machine's disk. The environment is kept in $KERAUNOS_ENV_CACHE (default
# ~/.cache/keraunos-envs)/transformers-VERSION and reused; keraunos is installed editable from
# this checkout on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-5.25.0}"
PYTHON="${PYTHON:-python3}"
CACHE="${KERAUNOS_ENV_CACHE:-$HOME/.cache/keraunos-envs}"
ENV="$CACHE/transformers-$VERSION"
PIP=("$ENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$ENV/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '$VERSION')" \
    2>/dev/null; then
  rm -rf "$ENV"
  mkdir -p "$CACHE"
  "$PYTHON" -m venv "$ENV"
  # The test extra without litgpt, its transformers and hub pins: read from pyproject.toml.
  mapfile -t DEPS < <("$PYTHON" - <<'PY'
import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]
skip = ("litgpt", "transformers", "huggingface-hub")
print("\n".join(d for d in extra if not d.startswith(skip)))
PY
)
  "${PIP[@]}" install -c scripts/constraints.txt torch==2.13.0 "transformers==$VERSION" \
    "${DEPS[@]}" >&2
fi
"${PIP[@]}" install --no-deps -e . >&2
"$ENV/bin/python" -m keraunos.runtime.native >&2 || echo "test_transformers.sh: the native hit path did not build" >&2
PY="$ENV/bin/python"
echo "== the transformers tests on transformers $VERSION: $PY"
run() {
  set +e
  "$PY" -m pytest -n auto --dist worksteal -p no:cacheprovider "$@"
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "test_transformers.sh: pytest collected no tests ($*)" >&2
    exit 1
  fi
  [ "$status" -eq 0 ] || exit "$status"
}
# The files whose every test builds a transformers model: the zoo, generation and integrations.
run tests/test_model_zoo.py tests/test_transformers.py tests/test_program_store_models.py \
  tests/test_integrations.py tests/test_never_wrong_3.py
# The transformers tests of files that test more: generate() with every cache, and several
# models through torch.compile(backend="keraunos") in one process.
run tests/test_symbolic.py tests/test_isolation.py -k "hf_ or transformers or either_name"

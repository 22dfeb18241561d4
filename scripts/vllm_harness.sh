#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run, inside vLLM's own test harness (its conftest.py fixtures, markers and
# utils) and against the installed, patched vLLM:
#   - the tests that the series adds to vLLM's tests/ tree (the interface's);
#   - this project's tests written for that harness (tests/vllm_harness/),
#     copied into vLLM's tests/models/language/generation/: the series does
#     not carry them, they are the plugin's.
# The v0.32.0 source tree is fetched once (.cache/vllm-src), the series
# applied there as commits, and its tests/ copied to a scratch directory
# without vllm/, so that the installed package is the one imported.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

TREE=$("$ROOT/scripts/build_vllm.sh" --no-install)
BASE=$(git -C "$TREE" rev-list --max-parents=0 HEAD)
mapfile -t TESTS < <(git -C "$TREE" diff --name-only "$BASE" HEAD -- 'tests/*test_*.py')
if [[ ${#TESTS[@]} -eq 0 ]]; then
    echo "[vllm_harness] the series adds no tests to vLLM's tree" >&2
    exit 1
fi

RUN=$ROOT/.cache/vllm-tests
rm -rf "$RUN"
mkdir -p "$RUN"
git -C "$TREE" archive HEAD tests pyproject.toml | tar -x -C "$RUN"
HARNESS_DIR=tests/models/language/generation
for test in "$ROOT"/tests/vllm_harness/test_*.py; do
    cp "$test" "$RUN/$HARNESS_DIR/"
    TESTS+=("$HARNESS_DIR/$(basename "$test")")
done
cd "$RUN"
exec "$PY" -m pytest -v -rs "${TESTS[@]}"

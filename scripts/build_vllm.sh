#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The upstream flow: vLLM v0.32.0 source tree -> the series as git commits ->
# vLLM built and installed from that tree (what a vLLM PR branch looks like).
#
#   scripts/build_vllm.sh                 # build, install into the venv
#   scripts/build_vllm.sh --no-install    # only the tree: prints its path
#   scripts/build_vllm.sh --metadata DIR  # only the package metadata (pip's
#                                         # report in DIR): prints the version
#
# VLLM_TARGET_DEVICE picks the flavour (default cuda: the CUDA toolkit with
# nvcc, a C++ compiler and cmake; hours on 2 cores; cpu: the CPU flavour).
# Needs no GPU to build. For running the tests on a CPU, scripts/setup.sh
# (patching the PyPI wheel) is the quick way.
# The tree stays in .cache/vllm-src/vllm-0.32.0 (VLLM_MEGAKERNEL_SRC names
# another folder for it) with the series on top of the base commit; `git log`
# there shows the commits a PR would carry.
#
# Version: vLLM's setup.py asks setuptools-scm, which reads the tree's git
# history; it has no release tag, so the build would be 0.1.devN+g<hash>, a
# vLLM that scripts/apply_patches.py refuses. The build therefore runs with
# SETUPTOOLS_SCM_PRETEND_VERSION=0.32.0, and setup.py adds its flavour suffix
# as for vLLM's own wheels (0.32.0+cpu: vLLM's CPU platform detection reads
# that suffix, so do not set VLLM_SKIP_VERSION_SUFFIX for cpu). Not used:
# tagging the base v0.32.0 (setuptools-scm then gives 0.32.1.devN for the
# commits on top), SETUPTOOLS_SCM_PRETEND_VERSION_FOR_VLLM (setup.py calls
# get_version() without a dist name, so it is ignored) and
# VLLM_VERSION_OVERRIDE (it drops the +cpu suffix). --metadata runs setup.py
# through pip's PEP 517 metadata step with the same settings, without
# compiling (VLLM_TARGET_DEVICE defaults to empty there: a cuda one needs a
# CUDA build of torch), so it tells the version the real build gets.
#
# Needs from the package registries: the sdist (the index pip uses,
# sha256-pinned) and vLLM's build and runtime dependencies from PyPI;
# --metadata needs only vLLM's build requirements, in a helper venv
# (.cache/vllm-build-env, made once: ~1 GB, 30-50 s where pip finds torch
# 2.13.0 on disk; PyPI's own torch 2.13.0 is a CUDA build of several GB).
# Needs from outside the registries (the script prints this before building;
# on a machine that reaches only the registries these steps fail):
#   cuda: the CUDA toolkit on the machine; CMake fetches from GitHub CUTLASS,
#     vllm-flash-attn, triton_kernels, FlashMLA, FlashKDA, DeepGEMM,
#     DeepSelect, qutlass, fmha_sm100 and tml-fa4, unless *_SRC_DIR variables
#     name local checkouts (VLLM_CUTLASS_SRC_DIR, VLLM_FLASH_ATTN_SRC_DIR, ...).
#   cpu: triton (triton-cpu), a runtime requirement on x86_64, is a wheel on a
#     GitHub release (requirements/cpu.txt); torch==2.13.0+cpu is on
#     PyTorch's own wheel index, not on PyPI; CMake fetches oneDNN from
#     GitHub unless FETCHCONTENT_SOURCE_DIR_ONEDNN names a local checkout (and
#     on aarch64 the Arm Compute Library, unless ACL_ROOT_DIR).
#   both: the Rust frontend (vllm-rs) needs crates.io and GitHub for cargo;
#     it is optional, so without them the build goes on without it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { sed -n '6,9s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
MODE=install
case ${1:-} in
    "") ;;
    --no-install) MODE=tree ;;
    --metadata)
        MODE=metadata
        [[ -n ${2:-} ]] || { usage >&2; exit 2; }
        META_DIR=$2
        ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
esac

VERSION=$(python3 -c 'import sys; sys.path.insert(0, sys.argv[1])
import vllm_source; print(vllm_source.VERSION)' "$ROOT/scripts")
TREE=$(python3 "$ROOT/scripts/vllm_source.py" \
    --dest "${VLLM_MEGAKERNEL_SRC:-$ROOT/.cache/vllm-src}")
BASE=$(git -C "$TREE" rev-list --max-parents=0 HEAD)
# Start from the pristine base so the tree carries exactly this series.
git -C "$TREE" reset -q --hard "$BASE"
python3 "$ROOT/scripts/apply_patches.py" apply --tree "$TREE" >&2
git -C "$TREE" log --oneline "$BASE..HEAD" >&2

if [[ $MODE == tree ]]; then
    echo "$TREE"
    exit 0
fi

# What a build of flavour $1 fetches from outside the package registries:
# what vLLM's build is known to fetch, then the requirements in the tree that
# pip fetches from elsewhere than the index (direct URLs, other indexes).
print_needs() {
    local flavour=$1
    echo "[build_vllm] the $flavour flavour needs from outside the package registries:"
    case $flavour in
        cuda)
            echo "  - the CUDA toolkit (nvcc) installed on the machine"
            echo "  - CMake fetches from GitHub: CUTLASS, vllm-flash-attn," \
                "triton_kernels, FlashMLA, FlashKDA, DeepGEMM, DeepSelect," \
                "qutlass, fmha_sm100, tml-fa4 (not those whose *_SRC_DIR" \
                "names a local checkout: VLLM_CUTLASS_SRC_DIR," \
                "VLLM_FLASH_ATTN_SRC_DIR, TRITON_KERNELS_SRC_DIR, ...)"
            ;;
        cpu)
            echo "  - triton (triton-cpu) on x86_64: a wheel on a GitHub release," \
                "a runtime requirement (below); pip fails without GitHub"
            echo "  - torch==2.13.0+cpu: on PyTorch's own wheel index, not on" \
                "PyPI; pip finds it only where an index or --find-links has it"
            echo "  - CMake fetches oneDNN from GitHub (unless" \
                "FETCHCONTENT_SOURCE_DIR_ONEDNN names a local checkout), on" \
                "aarch64 also the Arm Compute Library (unless ACL_ROOT_DIR)"
            ;;
        empty) echo "  - nothing to compile" ;;
        *) echo "  - not checked for this flavour: see vLLM's CMake files" ;;
    esac
    if [[ $flavour != empty ]]; then
        echo "  - the Rust frontend vllm-rs: cargo fetches crates.io and GitHub;" \
            "optional: the build goes on without it where they are missing"
    fi
    local reqs=$TREE/requirements/$flavour.txt
    [[ $flavour == empty ]] && reqs=$TREE/requirements/common.txt
    [[ -f $reqs ]] && outside_requirements "$reqs"
    return 0
}

# Lines of a requirements file (and those it includes with -r) that pip
# fetches from outside its index.
outside_requirements() {
    local line
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%%[[:space:]]#*}
        case $line in
            "#"*) ;;
            "-r "*) outside_requirements "$(dirname "$1")/${line#-r }" ;;
            *"@ http"* | *"@http"* | --index-url* | --extra-index-url* | -i\ * | --find-links* | -f\ *)
                echo "  - ${1#"$TREE"/}: $line"
                ;;
        esac
    done <"$1"
}

# The settings vLLM's build runs with; --metadata uses the same.
BUILD_SETTINGS=(SETUPTOOLS_SCM_PRETEND_VERSION="$VERSION")

if [[ $MODE == metadata ]]; then
    export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-empty}
    print_needs "$VLLM_TARGET_DEVICE" >&2
    # vLLM's build requirements (pyproject.toml), as pip's isolated build
    # environment for the real build has them; made again when they change.
    BUILD_ENV=$ROOT/.cache/vllm-build-env
    REQUIRES=$(python3 -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
        "$TREE/pyproject.toml")
    if [[ ! -f $BUILD_ENV/requires.txt || $(cat "$BUILD_ENV/requires.txt") != "$REQUIRES" ]]; then
        echo "[build_vllm] making $BUILD_ENV with vLLM's build requirements" >&2
        rm -rf "$BUILD_ENV"
        python3 -m venv "$BUILD_ENV"
        printf '%s\n' "$REQUIRES" >"$BUILD_ENV/requires.in"
        "$BUILD_ENV/bin/python" -m pip install --quiet -r "$BUILD_ENV/requires.in" >&2
        mv "$BUILD_ENV/requires.in" "$BUILD_ENV/requires.txt"
    fi
    if [[ $VLLM_TARGET_DEVICE == cuda ]] && ! "$BUILD_ENV/bin/python" -c \
        'import sys, torch; sys.exit(torch.version.cuda is None)'; then
        echo "[build_vllm] --metadata for cuda needs a CUDA build of torch in" \
            "$BUILD_ENV; its torch is CPU-only (setup.py would fail)" >&2
        exit 1
    fi
    mkdir -p "$META_DIR"
    echo "[build_vllm] metadata of vLLM ($VLLM_TARGET_DEVICE) from $TREE" >&2
    env "${BUILD_SETTINGS[@]}" "$BUILD_ENV/bin/python" -m pip install \
        --dry-run --no-deps --no-build-isolation \
        --ignore-installed --quiet --report "$META_DIR/report.json" "$TREE" >&2
    "$BUILD_ENV/bin/python" -c 'import json, sys
print(json.load(open(sys.argv[1]))["install"][0]["metadata"]["version"])' \
        "$META_DIR/report.json"
    exit 0
fi

export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cuda}
print_needs "$VLLM_TARGET_DEVICE" >&2
VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
echo "[build_vllm] building vLLM $VERSION ($VLLM_TARGET_DEVICE) from $TREE into $VENV" >&2
# SETUPTOOLS_SCM_PRETEND_VERSION reaches any other package this pip builds
# from source with setuptools-scm too; pip then stops on its version mismatch.
env "${BUILD_SETTINGS[@]}" "$VENV/bin/python" -m pip install "$TREE"
"$VENV/bin/python" -m pip install -e "${ROOT}[test]"
echo "$TREE"

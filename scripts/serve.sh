#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up (idempotent), then serve a model with decode through the megakernel:
#
#   scripts/serve.sh [MODEL] [vllm serve args...]
#
# With no MODEL (or an argument starting with "-" first), a tiny demo model
# (random weights, Llama architecture, local tokenizer) is built and served.
# On a machine without an NVIDIA GPU of compute capability 9.0 or newer, the
# megakernel's reference executor is turned on (VLLM_MEGAKERNEL_INTERPRET=1).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup.sh"
VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

if [[ $# -eq 0 || $1 == -* ]]; then
    MODEL=$("$PY" -m vllm_ext.demo_models --arch llama --out "$ROOT/.cache/models/llama")
    echo "[serve] no model given: serving the demo model $MODEL" >&2
else
    MODEL=$1
    shift
fi

has_hopper() {
    command -v nvidia-smi >/dev/null 2>&1 || return 1
    local cap
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)
    [[ -n $cap && ${cap%%.*} -ge 9 ]]
}
if [[ -z ${VLLM_MEGAKERNEL_INTERPRET:-} ]] && ! has_hopper; then
    echo "[serve] no NVIDIA GPU of compute capability >= 9.0 here: decode runs" \
        "through the megakernel's reference executor (VLLM_MEGAKERNEL_INTERPRET=1)" >&2
    export VLLM_MEGAKERNEL_INTERPRET=1
fi
# Small defaults for a CPU; any of them can be overridden by the arguments.
if [[ ${VLLM_MEGAKERNEL_INTERPRET:-0} == 1 ]]; then
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    set -- --max-model-len 1024 "$@"
else
    # The GPU kernel runs bf16 (the demo model is saved in fp32).
    set -- --dtype bfloat16 "$@"
fi
exec "$VENV/bin/vllm" serve "$MODEL" --decode-backend megakernel "$@"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The one-call GPU check. Here (no GPU needed): build the megakernel for the
# H200 (sm_90a) for a 1B-class and an 8B-class Llama shape at batch 1, 4,
# 16 and 64, Qwen2 (QKV bias) and Qwen3 (QK-norm) shapes at batch 1, an
# FP8 W8A8 Llama-3.1-8B at batch 1, a tensor-parallel case (every rank in
# one launch), the
# variants and kernels with planted bugs that the check must reject (below), into
# .device/ (git-ignored), with the programs, a manifest and FlashInfer's
# decode for the baseline. On the GPU machine (Python, torch with CUDA; no
# CuTe DSL, no vLLM):
#
#   python3 scripts/device_run.py .device "$OUT"
#
# checks every case instruction by instruction (stray writes included; the
# batch-1 defaults also against the interpreter, FlashInfer and in CUDA-graph
# replays), rejects the planted bugs, runs memcheck and racecheck, times each
# correct case against vLLM's default decode stood in for by a CUDA-graph
# per-op step (split-KV FlashInfer decode) and the weight-read floor, checks
# that a hung wait aborts its step (the step ends, the context lives on), and
# writes $OUT/device_check.{json,md} with a verdict. Record its figures in
# docs/perf.md and the report in docs/gpu-runs/.
#
#   scripts/device_check.sh [--dry-run]   # --dry-run: build and report size only
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VLLM_MEGAKERNEL_VENV:-$ROOT/.venv}
# (DEVICE_CHECK_BUNDLE: another folder, e.g. a dry run beside a test's.)
BUNDLE=${DEVICE_CHECK_BUNDLE:-$ROOT/.device}
MODELS=${DEVICE_CHECK_MODELS:-"llama-3.2-1b llama-3.1-8b"}
# Every bucket the backend may take (issue 17: it opens only those the
# kernel measured faster than the per-op baseline): tensor-core GEMVs from
# batch 4 up, the CUDA-core GEMV at 1.
BATCHES=${DEVICE_CHECK_BATCHES:-"1 4 16 64"}
# Further shapes, MODEL:BATCH: the device code only they run (QKV bias,
# QK-norm). Empty: none.
COVERAGE=${DEVICE_CHECK_COVERAGE-"qwen2.5-0.5b:1 qwen3-0.6b:1"}
# The experimental kernel variant and the comparison cases, checked and
# timed beside the default in the same call: MODEL:BATCH:CASE[:LAYERS],
# built into MODEL-bBATCH-CASE with the case's build flags (below), run
# with its first LAYERS layers where given (as its default twin among the
# mixtures below). The breakdown tells their parts apart.
# The GPU side runs the cases smallest shape first, each default before its
# variants, and the variants of a shape in the order listed here: what the
# call's deadline cuts is the end of this list.
# (Not the cases an H200 already decided, 8816f5d: 1B batch 1's wide and
# heads within 2.5% of the default, 1B batch 16's legacy 1.9x slower; the
# bundle must fit one carry.)
VARIANTS=${DEVICE_CHECK_VARIANTS-"llama-3.2-1b:1:legacy llama-3.2-1b:16:wide llama-3.1-8b:1:legacy llama-3.1-8b:1:heads llama-3.1-8b:16:legacy llama-3.1-8b:16:wide qwen3-0.6b:1:heads qwen3-30b-a3b:1:heads:4"}
variant_flags() {
    case $1 in
        # the previous control (thread 0 waits, CTA barriers, CUDA-core
        # GEMVs from global memory) in whole QKV heads as it ran (its
        # COMBINE in today's dim parts), timed beside the warp roles (the
        # default; tensor-core GEMVs from batch 4 up)
        legacy) echo --legacy-control --whole-heads ;;
        # the wide attention (the one experimental variant: ATTN read KV
        # at 0.1 TB/s on the H200, 2026-11-30)
        wide) echo --wide-attn ;;
        # QKV in whole heads (48 tiles a layer on the Llama shapes, where the
        # default's head parts make 96; with QK-norm, as Qwen3, QKV finishes
        # q and k, not ATTN): the tiling the cost model replaced, 2026-12-02
        heads) echo --whole-heads ;;
        *) echo "device_check: unknown variant $1" >&2; exit 2 ;;
    esac
}
# Planted bugs (build.py --plant-bug): deliberately wrong kernels of the
# smallest shape, built into MODEL-b1-plant-BUG, which the GPU check must
# reject in the same call (manifest "planted": {case: bug}). Empty: none.
PLANTED=${DEVICE_CHECK_PLANTED-"kv-slot oob-store"}
PLANTED_MODEL=llama-3.2-1b
# Mixtures of experts, MODEL:BATCH:LAYERS: built like the others and run
# with their first LAYERS layers (all 48 of Qwen3-30B-A3B are 61 GB of
# random weights to draw), each instruction checked (ROUTE, TOPK,
# EXPERT_UP, EXPERT_DOWN included) and the step timed against vLLM's
# fused-MoE Triton path, carried as moe_baseline/ (its kernel source copied
# from the installed vLLM at build time). Four layers: at eight, the check
# of batch 1 did not end in 166 s on an H200 (each step judged in 24 s and
# interpreted in 33 s). Empty: none.
MOE=${DEVICE_CHECK_MOE-"qwen3-30b-a3b:1:4 qwen3-30b-a3b:16:4"}
# ---- multi-head latent attention (MLA) ----
# MODEL:BATCH:LAYERS, built and run like the mixtures above: the model's
# real widths, random weights, its first LAYERS layers; each instruction
# checked (MLA_QKV_A, MLA_Q, MLA_APPEND, MLA_ATTN per head group and chunk,
# MLA_COMBINE; a sparse layer's mixture too), the attention also unsplit
# against the torch absorbed attention, the step timed at a 4k-token
# context against a per-op step (scripts/baseline/mla_per_op.py; vLLM's
# fused MoE for a sparse layer, prepared below when LAYERS reach one) and
# the attention's roofline. FlashInfer's MLA decode (vLLM's FLASHINFER_MLA
# kernel; DEVICE_CHECK_FLASHINFER=0 skips it, ~30 s and 1.2 MB) is built
# for the per-op attention and compared with the kernel's in the timing.
# Each case: DeepSeek-V3's three dense layers and its first sparse one
# (256 experts), Kimi-K2's dense layer and its first sparse one (384).
# Random weights drawn on the GPU (bf16 parameters; the LM head is the
# embedding): DeepSeek-V3 0.93 G embedding + 3 x 0.58 G + 11.5 G = 14.2 G,
# 28 GB; Kimi-K2 1.17 G + 0.50 G + 17.1 G = 18.7 G, 37 GB; the experts'
# list and its stack both live while one is drawn: ~51 and ~71 GB at the
# peak, of the H200's 139 GiB. The draw is a few passes over those bytes
# (seconds), once for the correctness and once for the timing. A case's
# program is 4 and 2 layers (~4000 and ~2000 instructions for the
# interpreter's pass). Empty: none.
MLA=${DEVICE_CHECK_MLA-"deepseek-v3:1:4 kimi-k2:1:2"}
# ---- end MLA ----
# Quantized checkpoints, MODEL:BATCH[:LAYERS]: by default FP8 W8A8
# (compressed-tensors float-quantized: e4m3 weights with an fp32 scale an
# output row, inputs quantized per token as they enter; the KernelShape.fp8
# kernel); llama-3.1-8b-w4a16 (INT4) and qwen3-8b-fp8 (FP8 blocks) build
# and are checked the same way, with no per-op baseline yet (correctness
# only; each adds ~2 MiB: trim another list to fit). Built like the
# defaults, run with their first LAYERS layers where given, on random weights
# drawn on the GPU; each instruction checked (the references quantize the
# linears' inputs), the batch-1 cases also against the interpreter,
# FlashInfer and in graph replays; timed against the per-op step with
# vLLM's FP8 linears in torch (per_op.py's per-op-fp8-scaled-mm: opens no
# bucket) and the floor of the FP8 weight bytes. Eight layers: the kernel
# is the same for any number (layers are data), and the first, a middle
# and the last still get every attention chunk checked; the 8B bf16
# batch-1 case took 65-71 s to check and 25-30 s to time on an H200, most
# of it its 32 layers' local checks and interpreter pass, which scale with
# the layers (the per-op compile, ~20 s, does not); and the weights drawn
# (codes, scales, the references' fp32 dequantization, bf16 embedding and
# LM head) are 11 GB, 14 GB at the draw's peak, where 32 layers are 37 and
# 51 GB. The step then reads 1.75 GB of FP8 layers beside the 1.05 GB
# bf16 LM head: the breakdown's per-kind rows give the FP8 GEMVs' bandwidth
# apart. DEVICE_CHECK_QUANT="llama-3.1-8b-fp8:1" runs all 32. Empty: none.
# Quantized mixtures (not in the default, 59.4 MiB at 76e978f: ~2.2 MiB
# each, so leave others out, e.g. DEVICE_CHECK_VARIANTS=""), e.g.
# "qwen3-30b-a3b-fp8:1:4 qwen3-30b-a3b-gptq-int4:1:4": FP8-block or INT4
# routed experts, random codes and scales (testing.quantized_layer), built
# and run like the bf16 mixture above with every instruction checked
# (EXPERT_UP's and EXPERT_DOWN's references quantize their inputs as the
# kernel does), the weight guard over the experts' codes and scales, and
# FP8's ARRIVE counts back at zero after every step; correctness only: no
# fair per-op MoE without vLLM's kernels (the timing names none).
QUANT=${DEVICE_CHECK_QUANT-"llama-3.1-8b-fp8:1:8"}
# Tensor parallel, MODEL:BATCH:TP: every rank of a TP program in one launch
# on the one GPU (build.py --tp TP --one-gpu-ranks; device_ranks.py), built
# into MODEL-bBATCH-tpTP and run after the defaults: the ranks' outputs
# bit-equal, against the rank set interpreted and the one-rank program, the
# step timed with and without the ALL_REDUCE work. Empty: none.
RANKS=${DEVICE_CHECK_RANKS-"llama-3.2-1b:1:2"}
# Speculative verify steps, MODEL:BATCH:TOKENS: the default kernel of that
# bucket on verify-step inputs (requests of TOKENS rows at consecutive
# positions, causal over the entries the step writes; the last request
# fewer rows in later steps), built into MODEL-bBATCH-verifyTOKENS, each
# instruction checked, the kernel's step timed beside the model's batch-1
# decode step, its decode step of as many rows and a per-op verify step.
# Default: Llama-3.1-8B, one request of 1 + k tokens for k = 3 (issue 41's
# target: at most 1.15x the one-token step), 1 and 7. Empty: none.
VERIFY=${DEVICE_CHECK_VERIFY-"llama-3.1-8b:4:4 llama-3.1-8b:2:2 llama-3.1-8b:8:8"}
# Racecheck's own cases, checked by racecheck alone: the planted bugs'
# model (below) with its LM head cut to RACECHECK_VOCAB rows, at each of
# these batches (1: the CUDA-core GEMV's pages; 4: the tensor-core GEMV's),
# run one layer deep (device_run.py SANITIZERS): racecheck instruments every
# shared-memory access, and one step of two layers and the whole 1B LM head
# did not end in 240 s on an H200. Empty: racecheck on the first case.
RACECHECK=${DEVICE_CHECK_RACECHECK-"1 4"}
RACECHECK_VOCAB=2048
# Quantized racecheck cases: the same one-layer model at batch 1 with the
# quantization_config of each config listed (its FP8 or INT4 kernel: the
# staged codes and the input scales' shared memory). Each racecheck run may
# take its 240 s: opt-in, e.g. "llama-3.1-8b-fp8 llama-3.1-8b-w4a16".
RACECHECK_QUANT=${DEVICE_CHECK_RACECHECK_QUANT-""}
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
cd "$ROOT"

build_one() {  # MODEL BATCH OUT [build flags]
    local model=$1 batch=$2 out=$3
    shift 3
    "$VENV/bin/python" -m vllm_ext.megakernel.build --config "$model" \
        --batch "$batch" --arch sm_90a --out "$out" --json "$@" | tail -1 >"$out.json"
    # Only the library, the program and the manifest travel.
    rm -rf "$out/dump" "$out"/*.o "$out"/*.h
    mv "$out.json" "$out/build.json"
}
# Builds run in the background, DEVICE_CHECK_JOBS at a time (each is one
# single-threaded compile); the steps between them run beside them.
JOBS=${DEVICE_CHECK_JOBS:-$(nproc)}
builds=()
build_case() {  # MODEL BATCH OUT [build flags]
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
    build_one "$@" &
    builds+=($!)
}
wait_builds() {  # (a reaped job's status is still known to wait PID)
    local pid failed=0
    for pid in "${builds[@]}"; do wait "$pid" || failed=1; done
    if ((failed)); then
        echo "device_check: a build failed (its error is above)" >&2
        exit 1
    fi
}

for model in $MODELS; do
    for batch in $BATCHES; do
        build_case "$model" "$batch" "$BUNDLE/$model-b$batch"
    done
done
for pair in $COVERAGE; do
    IFS=: read -r model batch <<<"$pair"
    build_case "$model" "$batch" "$BUNDLE/$model-b$batch"
done
order=""
layers=""
for triple in $VARIANTS; do
    IFS=: read -r model batch variant depth <<<"$triple"
    flags=$(variant_flags "$variant")
    # shellcheck disable=SC2086  # the flags are words
    build_case "$model" "$batch" "$BUNDLE/$model-b$batch-$variant" $flags
    order="$order $model-b$batch-$variant"
    if [[ -n $depth ]]; then
        layers="$layers $model-b$batch-$variant=$depth"
    fi
done
declare -A moe_models=() moe_batches=()
for triple in $MOE; do
    IFS=: read -r model batch depth <<<"$triple"
    build_case "$model" "$batch" "$BUNDLE/$model-b$batch"
    layers="$layers $model-b$batch=$depth"
    moe_models[$model]=1
    moe_batches[$batch]=1
done
# ---- MLA cases (DEVICE_CHECK_MLA, above) ----
for triple in $MLA; do
    IFS=: read -r model batch depth <<<"$triple"
    build_case "$model" "$batch" "$BUNDLE/$model-b$batch"
    layers="$layers $model-b$batch=$depth"
    # A sparse layer among the first LAYERS: the MoE baseline's shapes too.
    dense=$("$VENV/bin/python" -c 'import json, sys
c = json.load(open(sys.argv[1]))
print(c.get("first_k_dense_replace", 0) if c.get("n_routed_experts") else 1 << 30)' \
        "$ROOT/vllm_ext/configs/$model.json")
    if ((depth > dense)); then
        moe_models[$model]=1
        moe_batches[$batch]=1
    fi
done
if [[ -n ${MLA// /} && ${DEVICE_CHECK_FLASHINFER:-1} == 1 ]]; then
    "$VENV/bin/python" "$ROOT/scripts/baseline/build_flashinfer_mla.py" \
        "$BUNDLE" >/dev/null
fi
# ---- end MLA ----
# vLLM's fused-MoE Triton path for every mixture above, MLA cases' included.
if ((${#moe_models[@]})); then
    args=()
    for model in "${!moe_models[@]}"; do args+=(--model "$model"); done
    batches=$(IFS=,; echo "${!moe_batches[*]}")
    "$VENV/bin/python" "$ROOT/scripts/baseline/moe_baseline.py" "$BUNDLE" \
        "${args[@]}" --batches "$batches" >/dev/null
fi
for triple in $QUANT; do
    IFS=: read -r model batch depth <<<"$triple"
    build_case "$model" "$batch" "$BUNDLE/$model-b$batch"
    if [[ -n $depth ]]; then
        layers="$layers $model-b$batch=$depth"
    fi
done
for triple in $RANKS; do
    IFS=: read -r model batch tp <<<"$triple"
    build_case "$model" "$batch" "$BUNDLE/$model-b$batch-tp$tp" --tp "$tp" \
        --one-gpu-ranks
    order="$order $model-b$batch-tp$tp"
done
verify=""
for triple in $VERIFY; do
    IFS=: read -r model batch tokens <<<"$triple"
    build_case "$model" "$batch" "$BUNDLE/$model-b$batch-verify$tokens"
    order="$order $model-b$batch-verify$tokens"
    verify="$verify $model-b$batch-verify$tokens=$tokens"
done
planted=""
for bug in $PLANTED; do
    build_case "$PLANTED_MODEL" 1 "$BUNDLE/$PLANTED_MODEL-b1-plant-$bug" \
        --plant-bug "$bug"
    planted="$planted $PLANTED_MODEL-b1-plant-$bug=$bug"
done
racecheck=""
if [[ -n ${RACECHECK// /} ]]; then
    config=$(mktemp --suffix=.json)
    "$VENV/bin/python" - "$ROOT/vllm_ext/configs/$PLANTED_MODEL.json" "$config" \
        "$RACECHECK_VOCAB" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["vocab_size"] = int(sys.argv[3])
json.dump(config, open(sys.argv[2], "w"))
PY
    for batch in $RACECHECK; do
        name=$PLANTED_MODEL-v$RACECHECK_VOCAB-b$batch-racecheck
        build_case "$config" "$batch" "$BUNDLE/$name"
        racecheck="$racecheck $name"
    done
fi
for quant in $RACECHECK_QUANT; do
    config=$(mktemp --suffix=.json)
    "$VENV/bin/python" - "$ROOT/vllm_ext/configs/$PLANTED_MODEL.json" "$config" \
        "$RACECHECK_VOCAB" "$ROOT/vllm_ext/configs/$quant.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["vocab_size"] = int(sys.argv[3])
config["quantization_config"] = json.load(open(sys.argv[4]))["quantization_config"]
json.dump(config, open(sys.argv[2], "w"))
PY
    name=$PLANTED_MODEL-v$RACECHECK_VOCAB-b1-$quant-racecheck
    build_case "$config" 1 "$BUNDLE/$name"
    racecheck="$racecheck $name"
done
# FlashInfer's paged decode attention: the attention reference and the
# per-op baseline's attention on the GPU (DEVICE_CHECK_FLASHINFER=0 skips).
if [[ ${DEVICE_CHECK_FLASHINFER:-1} == 1 ]]; then
    "$VENV/bin/python" "$ROOT/scripts/baseline/build_flashinfer.py" "$BUNDLE" >/dev/null
fi
wait_builds
rm -f "${config:-}"
# shellcheck disable=SC2086  # the cases are words
# "first": the case the GPU side runs first, with the abort and sanitizers on
# its kernel: the planted bugs' correct twin.
PLANTED_CASES=$planted CASE_LAYERS=$layers VERIFY_CASES=$verify FIRST=$PLANTED_MODEL-b1 \
    RACECHECK_CASES=$racecheck \
    "$VENV/bin/python" - "$BUNDLE" \
    "$(git -C "$ROOT" rev-parse --short HEAD)" $order <<'PY'
import json, os, sys, pathlib
bundle, commit, order = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
builds = {p.parent.name: json.loads(p.read_text()) for p in bundle.glob("*/build.json")}
planted = dict(c.split("=", 1) for c in os.environ["PLANTED_CASES"].split())
layers = {c.split("=")[0]: int(c.split("=")[1])
          for c in os.environ["CASE_LAYERS"].split()}
verify = {c.split("=")[0]: int(c.split("=")[1])
          for c in os.environ["VERIFY_CASES"].split()}
manifest = {"commit": commit, "builds": builds, "variant_order": order,
            "planted": planted, "layers": layers, "verify": verify,
            "first": os.environ["FIRST"],
            "racecheck": os.environ["RACECHECK_CASES"].split()}
(bundle / "manifest.json").write_text(json.dumps(manifest))
PY
# The cost model's step for each case, written beside it: the report puts
# the measurement next to it (issue 16).
"$VENV/bin/python" "$ROOT/scripts/device_run.py" --predict "$BUNDLE"
size=$(du -sb "$BUNDLE" | cut -f1)
echo "[device_check] bundle $BUNDLE: $((size / 1024)) KiB (limit 60 MiB)"
# It travels with the working tree, 64 MiB in all (the device tool's carry).
if ((size > 60 << 20)); then
    echo "device_check: the bundle is over 60 MiB: leave cases out" \
        "(DEVICE_CHECK_VARIANTS, ..._MOE, ..._MLA, ..._VERIFY, ..._QUANT)" >&2
    exit 1
fi
if [[ ${1:-} == --dry-run ]]; then
    exit 0
fi
echo "[device_check] now run on the GPU machine, carrying .device:" >&2
echo "  python3 scripts/device_run.py .device \"\$OUT\"" >&2

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""GPU side of scripts/device_check.sh: runs the AOT-built megakernel with
torch + ctypes only (no CuTe DSL, no vLLM on the GPU machine).

    python3 scripts/device_run.py BUNDLE_DIR OUT_DIR [--quick]

Each case (model shape x batch bucket, variant or planted bug) runs in a
process of its own, so a fault in one cannot take the others down. First
what every later figure rests on, then the rest smallest shape first, each
default before its variants, within DEVICE_CHECK_BUDGET_S (330 s: two calls
fit in the lent time):
  1. the first case checked and timed (below), then the abort: a program
     with a wait that is never met must end its step with the abort record
     naming that wait, the process and its CUDA context alive, and a
     correct step after it in the same process must be correct;
  2. the planted bugs (a KV append to a wrong slot, a store past a buffer's
     end): the check must reject each, or the run fails;
  3. compute-sanitizer memcheck and racecheck on two steps of a two-layer
     program of the first case's kernel (waits' spin bound raised);
  4. every other case: correctness, then timing if correct.
Correctness: three decode steps (counters never reset) on fresh random
inputs, workspace poisoned with NaN and followed by a poisoned guard. Each
instruction is judged against its PyTorch reference on the inputs the
kernel gave it, the attention on a copy of the cache taken before the step
plus the entries the step had to write, element-wise where magnitudes allow;
and nothing may change where the step must not write (other cache entries,
the guards, its inputs, the weights). Default batch-1 cases also run the
whole step through the program interpreter (drift, greedy tokens), the
attention against FlashInfer's, and the step as CUDA-graph replays.
Timing (CUDA events, median of several runs): the megakernel step, graph
captured, against the per-op step that stands for vLLM's default decode
(scripts/baseline: compiled pieces, cuBLAS GEMMs, one KV-append kernel,
FlashInfer's split-KV paged decode, one CUDA graph), the GEMMs and attention
alone, and the weight-read floor; then a breakdown of the step.
A multi-head latent attention case (DeepSeek-V3, Kimi-K2: device_mla.py)
has its own instructions checked, its attention held to the torch
absorbed attention, and its per-op step from scripts/baseline/mla_per_op.py.
A tensor-parallel case (device_ranks.py) runs every rank in one launch.
An FP8 W8A8 case (e4m3 weights with a scale an output row, inputs quantized
per token: ``KernelShape.fp8``) draws random FP8 weights and is checked
like the dense cases (the references quantize the linears' inputs as the
kernel does), its weight guard over the codes and scales the kernel reads;
it is timed against the per-op step with vLLM's FP8 linears in torch
(``per_op.FP8_BASELINE``: torch._scaled_mm, named apart: it opens no
bucket) and the floor of its FP8 weight bytes. FP8-block and INT4 cases
likewise, against PyTorch's blockwise scaled GEMM and tinygemm
(``per_op.QUANT_BASELINES``, named apart too). A quantized mixture (FP8
blocks or INT4 routed experts) is checked the same way, its weight guard
over the experts' codes and scales, FP8's ARRIVE counts zero after each
step; it has no per-op MoE step (QUANT_MOE_BASELINE): correctness only.
Writes OUT_DIR/device_check.json and .md as each part ends, with a verdict:
passed, incomplete (a required check did not run) or failed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "baseline"))
sys.path.insert(0, str(ROOT / "scripts"))

import device_mla  # noqa: E402
import device_ranks  # noqa: E402
import flashinfer_baseline  # noqa: E402
import mla_per_op  # noqa: E402
import torch  # noqa: E402
from flashinfer_baseline import flashinfer_attend  # noqa: E402
from flashinfer_mla import FlashInferMla, flashinfer_attention  # noqa: E402
from per_op import QUANT_BASELINES, per_op_step  # noqa: E402

from vllm_ext.megakernel.calibrate import (  # noqa: E402
    LATENCIES_US,
    kernel_lookahead_bytes,
    probe,
)
from vllm_ext.megakernel.cost import DEVICES, predict  # noqa: E402
from vllm_ext.megakernel.interpret import ProgramInterpreter, pad_inputs  # noqa: E402
from vllm_ext.megakernel.isa import NO_COUNTER, Instruction, Op  # noqa: E402
from vllm_ext.megakernel.kernel.launcher import (  # noqa: E402
    KernelExecutor,
    KernelLibrary,
    decode_route,
)
from vllm_ext.megakernel.kernel.shape import AbortWhat, AbortWord  # noqa: E402
from vllm_ext.megakernel.measured import FAIR_BASELINE, verdict  # noqa: E402
from vllm_ext.megakernel.ops import (  # noqa: E402
    attn,
    combine,
    down,
    embed,
    expert_down,
    expert_up,
    final_norm,
    gate_up,
    lm_head,
    o_proj,
    qkv,
    route,
    topk,
)
from vllm_ext.megakernel.planner import plan, qkv_parts_to_fill  # noqa: E402
from vllm_ext.megakernel.variants import KERNEL  # noqa: E402
from vllm_ext.megakernel.verify import stuck_heads  # noqa: E402
from vllm_ext.model_spec import MlaSpec, ModelSpec, MoeSpec  # noqa: E402
from vllm_ext.quant import QuantFormat  # noqa: E402
from vllm_ext.runner import DecodeInputs  # noqa: E402
from vllm_ext.testing import (  # noqa: E402
    BLOCK_SIZE,
    random_decode_inputs,
    random_verify_inputs,
    random_weights,
)
from vllm_ext.weights import QUANT_LINEARS  # noqa: E402

DEVICE = "cuda"  # the tests run the correctness path on "cpu" with a stand-in
STEPS = 3
CONTEXT = 600  # longest history of the correctness steps (crosses chunks)
BENCH_CONTEXT = 512  # every request's history in the timings
# Relative error (max |a - b| / max |b|) allowed of each instruction against
# its reference on the very inputs the kernel gave it. bf16 outputs may round
# the other way where fp32 sums in another order land near a rounding
# boundary: one step of bf16 is up to 2^-7 of a value, and RoPE and SiLU-mul
# combine two such values before their own rounding, so up to four steps of
# the largest element. fp32 outputs differ only by the summation order.
# MLA_ATTN's partial o is fp32, but its P goes to the tensor cores rounded
# to bf16 (as FlashAttention rounds it): up to 2^-9 of each term, 5e-3 of
# an element at worst in tests/megakernel/test_mla_attn_mapping.py's
# float64 emulation, so it is held to the attention's bound.
# An FP8 W8A8 case's linears (QKV, O_PROJ, GATE_UP, DOWN) are held to the
# same bounds: the kernel quantizes its staged inputs as quantize_input does
# (bit for bit, from the same bf16 inputs the check reads), its e4m3 x e4m3
# products are exact (on sm_90 ptxas turns the e4m3 MMA into f16 HMMAs),
# summed in fp32 and scaled after the sum, a_scale * (w_scale * sum), where
# the reference multiplies the dequantized operands: fp32 rounding apart,
# so the bf16 outputs differ as a bf16 kernel's do. A kernel that skips
# the input quantization, or reads one row's scale from its neighbour, is
# far outside them (tests/megakernel/test_device_check.py).
TOLERANCE = {"bf16": 2**-5, "fp32": 1e-3, "attn": 2**-6}
# Element-wise, each output is also held to |a - b| <= tol * (|b| + f * max|b|)
# (see judge()), where f is the fraction below: the rounding of one output
# element scales with that element, except where an output combines two
# rounded values (RoPE in QKV and the K half of KV_APPEND, SiLU-mul in
# GATE_UP), whose error scales with the larger input: there magnitudes do
# not allow it, and the bound is the max-based one.
ELEMENT_FLOOR = {
    "QKV": 1.0,
    "KV_APPEND": 1.0,
    "GATE_UP": 1.0,
    "EXPERT_UP": 1.0,
    **device_mla.ELEMENT_FLOOR,
}
# TOPK's choices are integers: a request whose experts (or their slots)
# differ from the reference's on the kernel's own logits fails, unless the
# reference's selection scores put the choice within this of a tie (the
# GPU's exp and a warp's summation order differ from PyTorch's in the last
# bits).
TOPK_TIE = 1e-5
DEFAULT_ELEMENT_FLOOR = 1 / 8
# Bytes of poison after each workspace buffer (guard_workspace): a store
# past a buffer's end lands there. Each byte 0x7F: a large finite bf16 or
# fp32 value that no step computes.
GUARD_BYTES = 256
GUARD_BYTE = 0x7F
# FlashInfer against the kernel's (and the interpreter's) attention: fp32
# softmax on both sides, bf16 output.
ATTN_TOLERANCE = 2**-6
# The abort check's step after the aborted one, against the interpreter: a
# liveness check (a dead context raises, a garbage step is ~100% off), not
# the correctness check, so wider than the drift of a correct step.
ALIVE_TOL = 0.1
# The whole step against the interpreter run on its own is reported, not
# judged: each layer feeds the last one's rounding differences forward, so
# that drift grows with depth (a few percent after 32 random layers) even
# between two correct implementations. The local checks above judge.
# The abort check's spin bounds (the kernel's waits' max_spins): an H200
# took 8.0 s over the aborted step at 2^16 (docs/perf.md), where the
# nanosleeps alone would take 2 ms: the time per bound tells what the
# production bound (launcher.DEFAULT_MAX_SPINS, 2^24) costs a hung step.
ABORT_SPINS = (1 << 12, 1 << 16)
# The per-op baseline of a speculative verify step (timing()): not the
# fair one, which reads a request's cache once.
VERIFY_BASELINE = "vllm-default-split-kv-rows-as-requests"
# A quantized mixture's per-op MoE (timing()): none. vLLM's FP8-block and
# GPTQ mixtures run its CUTLASS / Marlin MoE kernels and its input
# quantization from _C, which does not travel; the bf16 Triton fused MoE
# would time another model. Its cases are correctness only (the kernel's
# step and breakdown still timed, no per-op figure).
QUANT_MOE_BASELINE = "none (quantized experts: no fair baseline without vLLM's kernels)"
# The per-op steps whose figures the report's main table shows: vLLM's
# default decode, and a quantized case's (the same step, its linears by
# PyTorch's quantized GEMMs: named below the table).
MAIN_TABLE_BASELINES = (FAIR_BASELINE, *QUANT_BASELINES.values())
# Wall-clock budget of the whole check. The machine's start takes 1-2 of the
# 15 lent minutes, so a call runs at most 6 minutes and a second one still
# fits; what the deadline cuts is listed, and the report is written as each
# part ends.
BUDGET_S = int(os.environ.get("DEVICE_CHECK_BUDGET_S", "330"))


def saved_spec(meta: dict) -> ModelSpec:
    """The model shape build.save_program saved (bf16; an FP8 checkpoint's
    format too: its bytes are the floor's, its linears the references')."""
    fields = dict(meta["spec"])
    fields["dtype"] = torch.bfloat16
    if fields.get("quant") is not None:  # saved as a dict
        quant = dict(fields["quant"])
        unquantized = frozenset(quant.pop("unquantized", ()))
        fields["quant"] = QuantFormat(**quant, unquantized=unquantized)
    if fields.get("moe") is not None:  # saved as a dict
        moe = dict(fields["moe"], sparse_layers=tuple(fields["moe"]["sparse_layers"]))
        fields["moe"] = MoeSpec(**moe)
    if fields.get("mla") is not None:
        fields["mla"] = MlaSpec(**fields["mla"])
    return ModelSpec(**fields)


def case_layers(case_dir: Path) -> int | None:
    """The layers the bundle runs a case with, where fewer than its model
    has (device_check.sh: the mixtures' full depth is 61 GB of weights)."""
    manifest = case_dir.parent / "manifest.json"
    if not manifest.exists():
        return None
    return json.loads(manifest.read_text()).get("layers", {}).get(case_dir.name)


def case_verify_tokens(case_dir: Path) -> int | None:
    """The rows a request of a speculative verify case (device_check.sh's
    DEVICE_CHECK_VERIFY: 1 + the drafts), None for a decode case."""
    manifest = case_dir.parent / "manifest.json"
    if not manifest.exists():
        return None
    return json.loads(manifest.read_text()).get("verify", {}).get(case_dir.name)


def case_inputs(case_dir: Path, spec: ModelSpec, rows: int, seed: int,
                max_len: int) -> DecodeInputs:  # fmt: skip
    """A step's random inputs: a decode step of ``rows`` requests (one token
    each), or for a verify case requests of its tokens (the last one fewer:
    ragged)."""
    tokens = case_verify_tokens(case_dir) or 1
    return random_verify_inputs(spec, rows, tokens, seed=seed, max_len=max_len)


def load_case(case_dir: Path, layers: int | None = None):
    """The case's model shape and program; with ``layers``, the program of
    that many layers instead (layers are data to the kernel: shape.py)."""
    meta = torch.load(case_dir / "program.pt")
    if layers is None:
        layers = case_layers(case_dir)
    spec = saved_spec(meta)
    if layers is not None:
        spec = spec.with_layers(layers)
    shape = meta["shape"]
    program = plan(spec, meta["batch"], DEVICES["h200"], with_lm_head=True,
                   qkv_parts=shape.get("qkv_parts", 1),
                   combine_parts=shape.get("combine_parts", 1))  # fmt: skip
    table, lengths = program.encode()
    if layers is None and not (
        torch.equal(table, meta["queues"]) and torch.equal(lengths, meta["lengths"])
    ):
        raise SystemExit("the program planned here differs from the bundle's")
    return spec, program


def bench_context(spec: ModelSpec) -> int:
    """Every request's history in a case's timing (an MLA case at the
    issue's 4k tokens: device_mla.py), and in its prediction."""
    return BENCH_CONTEXT if spec.mla is None else device_mla.BENCH_CONTEXT


def program_record(program) -> dict:
    """What a timing records of the program that ran: what calibrate
    re-plans it from, and what tells it the same program (the digest)."""
    return {"digest": program.digest(), "qkv_parts": program.qkv_parts,
            "combine_parts": program.combine_parts,
            "queue_lengths": [len(q) for q in program.queues]}  # fmt: skip


# The cost model's step beside each case's measurement (issue 16), at
# calibrate's LATENCIES_US per dependency.
PREDICTED = "predicted.json"


def predictions(case_dir: Path) -> dict:
    """The cost model's step for the case as the GPU side runs and times it:
    its program (its layers), the timing's context, its kernel's lookahead,
    the H200's figures, at each of LATENCIES_US. Computed where the
    bundle is built (``--predict``, on the CPU): the model knows programs,
    not kernel flags, so a wide-attention case predicts as its default."""
    spec, program = load_case(case_dir)
    context = bench_context(spec)
    program = dataclasses.replace(program, context=context)
    lookahead = kernel_lookahead_bytes(torch.load(case_dir / "program.pt")["shape"])
    h200, steps = DEVICES["h200"], {}
    for us in LATENCIES_US:
        device = dataclasses.replace(h200, dependency_latency_s=us * 1e-6)
        steps[str(us)] = predict(program, device, lookahead).step_s * 1e3
    floor_ms = program.weight_bytes() / h200.hbm_bytes_per_s * 1e3
    return {"context": context, "step_ms": steps, "floor_ms": floor_ms}


def write_predictions(bundle: Path) -> None:
    """Every case's ``predictions`` into its folder (a planted bug's is its
    twin's: not written)."""
    for case in sorted(p for p in bundle.iterdir() if (p / "program.pt").exists()):
        # (The cost model has no one-GPU ranks: a TP case is not predicted;
        # nor a verify case, which it plans as its default twin.)
        if not (planted_bug(case) or _ranks_case(case) or case_verify_tokens(case)):
            (case / PREDICTED).write_text(json.dumps(predictions(case)))


def make_executor(case_dir: Path, program, weights, max_blocks: int):
    lib = KernelLibrary(
        case_dir / "libmegakernel_sm_90a.so", torch.cuda.current_device()
    )
    return KernelExecutor(
        program, weights, lib.launch, block_size=BLOCK_SIZE, max_blocks=max_blocks
    ), lib


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if (torch.isnan(a) != torch.isnan(b)).any() or (
        torch.isinf(a) != torch.isinf(b)
    ).any():
        return float("inf")  # a NaN (unwritten) or an infinity where none belongs
    both = ~(torch.isnan(b) | torch.isinf(b))
    if not both.any():
        return 0.0  # the same NaN / infinity pattern and nothing else
    scale = b[both].abs().max().item()
    return (a[both] - b[both]).abs().max().item() / max(scale, 1e-6)


def elem_err(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """The worst |a - b| / (|b| + floor * max|b|) over finite entries: 1.0
    times the tolerance is the element-wise bound (NaN mismatches are
    rel_err's to report)."""
    a, b = a.double(), b.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    if not both.any():
        return 0.0
    a, b = a[both], b[both]
    scale = max(b.abs().max().item(), 1e-6)
    return ((a - b).abs() / (b.abs() + floor * scale)).max().item()


def passes(check: dict) -> bool:
    """One check of a step: within its max-based tolerance and, where it
    has one, the element-wise bound."""
    return check["max"] <= check["tol"] and check.get("elem", 0.0) <= check["tol"]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the finite entries (reported beside rel_err)."""
    a, b = a.double(), b.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    ref = b[both].norm().item()
    return (a[both] - b[both]).norm().item() / ref if ref else 0.0


class FlashInferDecode(flashinfer_baseline.FlashInferDecode):
    """The per-op baseline's attention kernels (FlashInfer's split-KV paged
    decode, the KV append: scripts/baseline/flashinfer_baseline.py) through
    ctypes; None where the bundle lacks them or the check runs on CPU (the
    tests)."""

    @classmethod
    def load(cls, bundle: Path) -> FlashInferDecode | None:
        return super().load(bundle) if DEVICE == "cuda" else None


def is_variant(case_dir: Path) -> bool:
    """A case built with the experimental kernel variant, the legacy control
    or in whole heads (build flags)."""
    meta = torch.load(case_dir / "program.pt")
    shape, flags = meta["shape"], (*KERNEL, "legacy_control")
    parts = qkv_parts_to_fill(saved_spec(meta), DEVICES["h200"].num_sms)
    return any(shape.get(f) for f in flags) or shape.get("qkv_parts", 1) != parts


# Default cases whose whole step is also run against the interpreter (drift,
# greedy agreement) and whose attention is held against FlashInfer. The
# other default cases (batch 4 and 16: both ran twice, 2026-11-30) and every
# variant run the local checks, which judge every case; the call's time goes
# to the variants' timings.
FULL_CHECK_BATCHES = (1,)


def correctness(case_dir: Path) -> dict:
    """A variant case runs the local checks only (they judge every case):
    its default twin in the same call reports drift, greedy agreement and
    FlashInfer, which a variant (GEMVs, weight movement) does not change,
    and the call's time goes to timing it. So do default cases at batches
    not in FULL_CHECK_BATCHES and speculative verify cases (the default's
    program on verify-step inputs)."""
    spec, program = load_case(case_dir)
    dev = DEVICE
    weights = random_weights(spec, seed=1, device=dev)
    max_blocks = (CONTEXT + BLOCK_SIZE - 1) // BLOCK_SIZE
    ex, _ = make_executor(case_dir, program, weights, max_blocks)
    guards = guard_workspace(ex)
    local = (
        is_variant(case_dir)
        or bool(planted_bug(case_dir))
        or case_verify_tokens(case_dir) is not None
        or program.batch not in FULL_CHECK_BATCHES
    )
    interp = None if local else ProgramInterpreter(program, weights, seed=0)
    flashinfer = None if local else FlashInferDecode.load(case_dir.parent)
    progress(f"{case_dir.name}: weights and executor ready")
    steps = []
    for step in range(STEPS):
        progress(f"{case_dir.name}: step {step}")
        # A full bucket, then fewer requests (padded rows) on later steps.
        n = program.batch if step == 0 else max(1, program.batch - step)
        inputs = case_inputs(case_dir, spec, n, seed=100 + step, max_len=CONTEXT)
        inputs = _to(inputs, dev)
        mine = _to(inputs, dev, clone_kv=True)
        poison(ex)
        before = StepGuard(ex, guards, mine)
        ex.step(mine)
        sync()
        counters_ok = bool(ex.counters[-1].item() == step + 1)
        progress(f"{case_dir.name}: step {step} ran")
        errs = local_errors(ex, spec, mine, n, before)
        progress(f"{case_dir.name}: step {step} judged")
        if local:
            ok = all(passes(v) for v in errs.values())
            progress(f"{case_dir.name}: step {step} ok={ok}")
            steps.append({"batch": n, "errors": errs, "ok": ok,
                          "counters_ok": counters_ok})  # fmt: skip
            continue
        interp.step(pad_inputs(inputs, program.batch))
        progress(f"{case_dir.name}: step {step} interpreted")
        ref = interp.buf
        drift = {}
        for name in DRIFT_BUFFERS:
            if name not in ex.ws:  # (an MLA program has no q, a dense no q_lat)
                continue
            per_layer = [
                rel_err(a[:n], b[:n]) for a, b in _pairs(ex.ws[name], ref[name], name)
            ]
            worst = max(range(len(per_layer)), key=per_layer.__getitem__)
            drift[name] = {"max": per_layer[worst], "layer": worst}
        drift["logits"] = {"max": rel_err(ex.logits[:n], interp.logits[:n])}
        if spec.mla is not None:
            errs.update(mla_attention_check(ex, spec, mine, n))
        elif flashinfer is not None:
            errs.update(flashinfer_checks(flashinfer, ex, interp, mine, inputs, n))
        top_k = ex.logits[:n].argmax(-1)
        top_r = interp.logits[:n].argmax(-1)
        ref_sorted = interp.logits[:n].sort(-1, descending=True).values
        margin = (ref_sorted[:, 0] - ref_sorted[:, 1]).tolist()
        abs_err = (ex.logits[:n] - interp.logits[:n]).abs().max().item()
        # A disagreement counts only where the reference's top two are
        # further apart than the logits' error (not a near tie).
        clear = [m > 2 * abs_err for m in margin]
        agree = [
            bool(a == b) for a, b in zip(top_k.tolist(), top_r.tolist(), strict=True)
        ]
        if errs.get("flashinfer_vs_reference", {}).get("max", 0) > ATTN_TOLERANCE:
            # The baseline library itself disagrees with the reference: its
            # verdict on the kernel means nothing (reported, not counted).
            errs.pop("attn_vs_flashinfer")
            errs["flashinfer_vs_reference"]["counted"] = False
        ok = all(passes(v) for v in errs.values() if v.get("counted", True))
        ok = ok and all(a or not c for a, c in zip(agree, clear, strict=True))
        progress(f"{case_dir.name}: step {step} ok={ok}")
        steps.append({
            "batch": n, "errors": errs, "drift": drift,
            "greedy_agree": f"{sum(agree)}/{n}",
            "logits_max_abs_err": abs_err, "ok": ok,
            "counters_ok": counters_ok,
        })  # fmt: skip
    result = {"ok": all(s["ok"] and s["counters_ok"] for s in steps), "steps": steps}
    if not local:
        result["graph"] = graph_replays(ex, spec, program.batch, guards)
        result["ok"] = result["ok"] and result["graph"]["ok"]
    return result


# The buffers whose drift from the interpreter is reported (those the
# case's program has).
DRIFT_BUFFERS = ("h", "hmid", "q", "qkv_a", "q_lat", "q_pe", "attn", "act",
                 "part_o", "part_lse")  # fmt: skip
GRAPH_REPLAYS = 2


def capture_step(fn):
    """The step as vLLM's FULL CUDA graphs run it: captured once, replayed
    (None if capture fails). Without CUDA (the tests), the step itself."""
    return graphed(fn) if DEVICE == "cuda" else fn


def graph_replays(ex, spec: ModelSpec, n: int, guards: dict) -> dict:
    """The step captured in a CUDA graph over fixed input buffers, then
    replayed on new inputs written into them in place (requests, block
    tables, caches), as vLLM's decode loop does: each replay judged by the
    local checks, and the step number bumped by each replay."""
    src = _to(random_decode_inputs(spec, n, seed=200, max_len=CONTEXT), DEVICE,
              clone_kv=True)  # fmt: skip
    replay = capture_step(lambda: ex.step(src))
    if replay is None:
        return {"ok": False, "why": "capture failed"}
    replays = []
    for k in range(GRAPH_REPLAYS):
        new = _to(random_decode_inputs(spec, n, seed=300 + k, max_len=CONTEXT), DEVICE)
        fields = ("input_ids", "positions", "block_table", "seq_lens", "slot_mapping")
        for name in fields:
            getattr(src, name).copy_(getattr(new, name))
        for dst, val in zip(src.kv_caches, new.kv_caches, strict=True):
            dst.copy_(val)
        poison(ex)
        sync()
        step = int(ex.counters[-1].item())
        before = StepGuard(ex, guards, src)
        replay()
        sync()
        errs = local_errors(ex, spec, src, n, before)
        replays.append({
            "errors": errs, "counters_ok": int(ex.counters[-1].item()) == step + 1,
            "ok": all(passes(v) for v in errs.values()),
        })  # fmt: skip
    ok = all(r["ok"] and r["counters_ok"] for r in replays)
    return {"ok": ok, "replays": replays}


def _finished_q(ex, q: torch.Tensor, layer: int, positions: torch.Tensor):
    """A q buffer as attention reads it: where QKV left QK-norm and RoPE to
    ATTN (``Program.qk_in_attn``), finished as ATTN does."""
    if not ex.program.qk_in_attn:
        return q
    w = ex.weights
    cos, sin = w.cos_sin[positions.long()].chunk(2, -1)
    return qkv.finish(q, w.layers[layer].q_norm, ex.program.spec, cos, sin)


def flashinfer_checks(flashinfer, ex, interp, mine, ref, n: int) -> dict:
    """FlashInfer's split-KV decode attention (the per-op baseline's, on the
    plan it times) as an independent reference for ATTN + COMBINE, on the
    first and last layer: on the kernel's own q and updated cache against
    the kernel's output, and on the interpreter's against the interpreter's
    (which vouches for the FlashInfer library itself). Then the baseline's
    ``kv_append`` (reported, not counted: it judges the baseline, not the
    kernel). A baseline that fails to run is reported the same way."""
    worst = {"attn_vs_flashinfer": 0.0, "flashinfer_vs_reference": 0.0}
    scale = interp.weights.attn_scale
    nq, d = ex.ws["q"][0].shape[1:]
    try:
        plan = flashinfer.split_plan(mine.block_table[:n], mine.seq_lens[:n],
                                     BLOCK_SIZE, nq, mine.kv_caches[0].shape[1],
                                     d)  # fmt: skip
        for layer in (0, len(ex.weights.layers) - 1):
            for key, q, cache, want in (
                ("attn_vs_flashinfer", ex.ws["q"][layer], mine.kv_caches[layer],
                 ex.ws["attn"][layer]),
                ("flashinfer_vs_reference", interp.buf["q"][layer],
                 ref.kv_caches[layer], interp.buf["attn"][layer]),
            ):  # fmt: skip
                out = torch.empty(n, nq, d, dtype=torch.bfloat16, device=q.device)
                q = _finished_q(ex, q[:n], layer, ref.positions[:n])
                got = flashinfer(q, cache, plan, out, scale)
                worst[key] = max(worst[key], rel_err(want[:n], got))
        append = flashinfer.append_error(ref.kv_caches[0], ref.slot_mapping[:n])
    except (RuntimeError, ValueError) as e:
        # Read by correctness() as a baseline that disagrees: not counted.
        bad = {"max": float("inf"), "tol": ATTN_TOLERANCE}
        return {"attn_vs_flashinfer": bad,
                "flashinfer_vs_reference": {**bad, "error": repr(e)[:500]}}  # fmt: skip
    errs = {k: {"max": v, "tol": ATTN_TOLERANCE} for k, v in worst.items()}
    errs["flashinfer_vs_reference"]["work_items"] = plan["work_items"]
    errs["baseline_kv_append"] = {"max": append, "tol": 0.0, "counted": False}
    return errs


def mla_attention_check(ex, spec: ModelSpec, inputs: DecodeInputs, n: int) -> dict:
    """An MLA case's attention (MLA_ATTN + MLA_COMBINE) on the first and last
    layer against the unsplit torch absorbed attention on the kernel's own
    queries and cache: what flashinfer_checks is for the dense cases.
    FlashInfer's MLA decode is compared in the timing (flashinfer_mla_check),
    after this verdict is printed: a library never run on a GPU must not
    cost it."""
    worst = 0.0
    for layer in (0, spec.num_layers - 1):
        got, want = device_mla.unsplit_attention(ex, spec, inputs, n, layer)
        worst = max(worst, rel_err(got, want))
    check = {"max": worst, "tol": ATTN_TOLERANCE}
    return {"mla_attn_vs_torch": {**check, "reference": device_mla.ATTENTION_REFERENCE}}


def flashinfer_mla_check(flashinfer, ex, spec: ModelSpec, inputs: DecodeInputs,
                         n: int) -> dict:  # fmt: skip
    """FlashInfer's MLA decode on the kernel's own queries and cache (first
    and last layer) against the kernel's attention (``mla_attn_vs_flashinfer``)
    and its latent output against the torch reference's
    (``flashinfer_mla_vs_torch``, which vouches for the library). Reported
    beside the verdict, not in it: the library has not run on a GPU yet."""
    kernel = library = 0.0
    try:
        for layer in (0, spec.num_layers - 1):
            outputs = device_mla.flashinfer_outputs(
                flashinfer, ex, spec, inputs, n, layer
            )
            got, out, o, ref = outputs
            kernel, library = (
                max(kernel, rel_err(got, out)),
                max(library, rel_err(o, ref)),
            )
        sync()
    except (RuntimeError, ValueError) as e:
        return {"ok": None, "error": repr(e)[:500]}
    return {
        "mla_attn_vs_flashinfer": {"max": kernel, "tol": ATTN_TOLERANCE},
        "flashinfer_mla_vs_torch": {"max": library, "tol": ATTN_TOLERANCE},
        # The kernel agrees with FlashInfer, and FlashInfer with the torch
        # reference (else its verdict on the kernel means nothing).
        "ok": kernel <= ATTN_TOLERANCE if library <= ATTN_TOLERANCE else None,
    }


def local_errors(
    ex, spec: ModelSpec, inputs: DecodeInputs, n: int, before: StepGuard
) -> dict:
    """Every instruction against its reference on the inputs the kernel
    itself gave it (its own upstream buffers, and the cache as it was
    before the step plus the entries the step had to write): a failure
    names the instruction and layer, rounding differences do not compound
    over layers, and a write to a wrong cache slot cannot reach a
    reference. Then what the step must not have written (``before``).
    ``{op: {max, layer, tol, ...}}``; ``passes`` judges each."""
    w, ws, dt, hidden = ex.weights, ex.ws, spec.dtype, spec.hidden_size
    cos, sin = w.cos_sin[inputs.positions[:n].long()].chunk(2, -1)
    out: dict = {}
    attn_layers = {0, spec.num_layers // 2, spec.num_layers - 1}

    def note(op: str, layer: int, got, want, kind: str = "bf16") -> None:
        e = rel_err(got, want)
        elem = elem_err(got, want, ELEMENT_FLOOR.get(op, DEFAULT_ELEMENT_FLOOR))
        prev = out.get(op, {"max": -1.0, "elem": 0.0, "l2": 0.0})
        if e > prev["max"]:
            out[op] = {**prev, "max": e, "layer": layer, "tol": TOLERANCE[kind]}
        out[op]["elem"] = max(prev["elem"], elem)
        out[op]["l2"] = max(prev["l2"], rel_l2(got, want))

    note("EMBED", 0, ws["h"][0][:n],
         embed.reference(w.embed, inputs.input_ids[:n], 0, hidden, dt))  # fmt: skip
    for i, lw in enumerate(w.layers):
        h, hmid = ws["h"][i][:n], ws["hmid"][i][:n]
        if lw.mla is not None:
            cache = before.cache_after_step(i, inputs.kv_caches[i], inputs, n)
            device_mla.layer_errors(ex, spec, inputs, n, i, cache, cos, sin, note,
                                    every_chunk=i in attn_layers)  # fmt: skip
        else:
            _attention_errors(ex, spec, inputs, n, i, before, cos, sin, note,
                              every_chunk=i in attn_layers)  # fmt: skip
        attn_flat = ws["attn"][i][:n].reshape(n, -1)
        # (FP8: each linear's input quantized per token, as the kernel does;
        # QKV's and GATE_UP's references read spec.quant themselves.)
        note("O_PROJ", i, hmid,
             o_proj.reference(attn_flat, h, lw.o_proj, 0, hidden, dt,
                              spec.quant))  # fmt: skip
        if lw.moe is not None:
            out.update(_mixture_errors(ex, spec, i, n, note))
            continue
        act = ws["act"][i][:n]
        note("GATE_UP", i, act,
             gate_up.reference(hmid, lw, spec, 0, spec.intermediate_size))  # fmt: skip
        note("DOWN", i, ws["h"][i + 1][:n],
             down.reference(act, hmid, lw.down, 0, hidden, dt, spec.quant))  # fmt: skip
    last = ws["h"][spec.num_layers][:n]
    note("FINAL_NORM", spec.num_layers, ws["out"][:n],
         final_norm.reference(last, w.final_norm, spec.rms_norm_eps, 0, hidden,
                              dt))  # fmt: skip
    note("LM_HEAD", spec.num_layers, ex.logits[:n],
         lm_head.reference(ws["out"][:n], w.lm_head, 0, spec.vocab_size),
         "fp32")  # fmt: skip
    out.update(before.stray_writes(ex, inputs, n))
    return out


def _attention_errors(
    ex, spec: ModelSpec, inputs: DecodeInputs, n: int, i: int, before: StepGuard,
    cos, sin, note, every_chunk: bool,
) -> None:  # fmt: skip
    """A grouped-query layer's QKV, KV_APPEND, ATTN (every chunk with
    ``every_chunk``) and COMBINE, recorded through ``note``."""
    w, ws = ex.weights, ex.ws
    lw, nq, nkv = w.layers[i], spec.num_q_heads, spec.num_kv_heads
    g, chunks = nq // nkv, ex.program.attn_chunks
    table, lens, dt = inputs.block_table[:n], inputs.seq_lens[:n], spec.dtype
    h, q = ws["h"][i][:n], ws["q"][i][:n]
    heads = qkv.reference(h, lw, spec, 0, nq + 2 * nkv, cos, sin)
    kind = "fp32"
    if ex.program.qk_in_attn:
        # QKV stores q as projected; ATTN finishes it in registers, where
        # the check cannot see it: the reference finishes the kernel's q
        # itself, and an element may round one bf16 step apart (the GPU's
        # rsqrt, another summation order), so ATTN is held to attention's
        # bf16-input tolerance.
        note("QKV", i, q, qkv.reference(h, lw, spec, 0, nq, cos, sin, True))
        q = qkv.finish(q, lw.q_norm, spec, cos, sin)
        kind = "attn"
    else:
        note("QKV", i, q, heads[:, :nq])
    new_kv = torch.cat((heads[:, nq : nq + nkv], heads[:, nq + nkv :]), -1)
    note("KV_APPEND", i, _new_kv(inputs.kv_caches[i], inputs, n), new_kv.float())
    cache = before.cache_after_step(i, inputs.kv_caches[i], inputs, n)
    for a in range(nkv):
        part_o, part_lse = ws["part_o"][i][:, a, :n], ws["part_lse"][i][:, a, :n]
        # Every chunk of the first, middle and last layer: the same code
        # for every layer, and one reference call per (head, chunk).
        for c in range(chunks if every_chunk else 0):
            o, lse = attn.reference(q[:, a * g : (a + 1) * g], cache, a, table,
                                    lens, c, chunks, w.attn_scale)  # fmt: skip
            note("ATTN", i, part_o[c], o, kind)
            note("ATTN_LSE", i, part_lse[c], lse, kind)
        note("COMBINE", i, ws["attn"][i][:n, a * g : (a + 1) * g],
             combine.reference(part_o, part_lse, dt))  # fmt: skip


def _mixture_errors(ex, spec: ModelSpec, i: int, n: int, note) -> dict:
    """A sparse layer's ROUTE, TOPK, EXPERT_UP and EXPERT_DOWN against their
    references, each on the kernel's own inputs (its logits, its routing,
    its activations); returns TOPK's own check (``note`` records the rest)."""
    ws, lw, moe = ex.ws, ex.weights.layers[i], spec.moe
    hmid, e = ws["hmid"][i][:n], moe.num_experts
    logits = ws["router"][i][:, :e]
    note("ROUTE", i, logits[:n], route.reference(hmid, lw, spec, 0, e))
    weights, slots, experts = decode_route(ws["route"][i], ex.shape)
    want = topk.reference(logits, lw, spec, ex.seq_lens, ex.program.num_slots)
    valid = bool(((slots >= -1) & (slots < len(experts))).all()) and bool(
        ((experts >= -1) & (experts < e)).all()
    )
    if not valid:  # slot or expert ids out of range: nothing to read by
        return {"TOPK": {"max": float(n), "tol": 0.0, "layer": i,
                         "invalid_ids": True}}  # fmt: skip
    # Choices: each real request's experts, best first (the slots follow
    # from the experts: the distinct ones ascending).
    mine_ids = torch.where(slots[:n] >= 0, experts[slots[:n].clamp(min=0).long()], -1)
    want_ids = want.experts[want.slots[:n].clamp(min=0)]
    wrong = (mine_ids.long() != want_ids).any(-1)
    near = _near_tie(logits[:n], lw, spec)
    clear = int((wrong & ~near).sum())
    check = {"max": float(clear), "tol": 0.0, "rows": int(wrong.sum()),
             "near_ties": int((wrong & near).sum()), "layer": i}  # fmt: skip
    if not bool(wrong.any()):
        # The same choices: then the same slots (padding rows' -1 included),
        # the same distinct experts, and weights equal to rounding.
        same = torch.equal(slots.long(), want.slots) and torch.equal(
            experts.long(), want.experts
        )
        check["max"] = 0.0 if same else 1.0
        note("TOPK_WEIGHTS", i, weights[:n], want.weights[:n], "fp32")
    # The experts on the kernel's routing (whatever it chose).
    routing = topk.Routing(weights[:n], slots[:n].long(), experts.long())
    xact = ws["xact"][i]
    inter = moe.expert_intermediate
    for slot, expert in enumerate(routing.experts.tolist()):
        if expert < 0:
            break
        rows = (routing.slots == slot).any(-1).nonzero().flatten()
        note("EXPERT_UP", i, xact[slot, rows, :inter],
             expert_up.reference(hmid, lw, spec, expert, rows, 0, inter))  # fmt: skip
    if moe.shared_intermediate:
        rows, width = torch.arange(n, device=hmid.device), moe.shared_intermediate
        note("EXPERT_UP", i, xact[ex.program.num_slots, :n, :width],
             expert_up.reference(hmid, lw, spec, None, rows, 0, width))  # fmt: skip
    note("EXPERT_DOWN", i, ws["h"][i + 1][:n],
         expert_down.reference(xact[:, :n], hmid, lw, routing, 0, spec.hidden_size,
                               spec.dtype, spec.quant))  # fmt: skip
    return {"TOPK": check}


def _near_tie(logits: torch.Tensor, lw, spec: ModelSpec) -> torch.Tensor:
    """Per request: whether the reference's selection scores (moe.route's,
    before any grouping) hold the top_k-th and the next choice within
    TOPK_TIE of each other."""
    moe, x = spec.moe, logits.float()
    scores = x.softmax(-1) if moe.scoring == "softmax" else x.sigmoid()
    if lw.moe.correction_bias is not None:
        scores = scores + lw.moe.correction_bias.float()
    top = scores.topk(min(moe.top_k + 1, scores.shape[-1]), dim=-1).values
    if top.shape[-1] <= moe.top_k:
        return torch.zeros(len(x), dtype=torch.bool, device=x.device)
    return (top[:, moe.top_k - 1] - top[:, moe.top_k]).abs() <= TOPK_TIE


def _pairs(mine: torch.Tensor, ref, name: str):
    """(kernel, reference) per layer, batch-first where the buffer is."""
    for i, r in enumerate(ref):
        m = mine[i]
        if name in ("part_o", "part_lse"):  # [chunks, kv, B, ...] -> B first
            m, r = m.movedim(2, 0), r.movedim(2, 0)
        yield m, r


def _at_slots(cache: torch.Tensor, slots: torch.Tensor) -> tuple:
    """The index of the slots' entries in a layer's cache: a grouped-query
    one ``[blocks, kv heads, block, 2 * head_dim]`` (the LBNHC view), or a
    latent one ``[blocks, block, width]`` (MLA: one row per token)."""
    if cache.dim() == 3:
        return slots // cache.shape[1], slots % cache.shape[1]
    return slots // cache.shape[2], slice(None), slots % cache.shape[2]


def _new_kv(cache: torch.Tensor, inputs: DecodeInputs, n: int) -> torch.Tensor:
    """The entries the step's real requests had to write ([n, kv heads,
    2 * head_dim], or [n, width] in a latent cache)."""
    return cache[_at_slots(cache, inputs.slot_mapping[:n].long())].float()


def poison(ex) -> None:
    """Every workspace buffer NaN before a step, so a value read before it
    is written shows; but for FP8 experts' ARRIVE counts, which the kernel
    needs at zero between steps (``StepGuard.stray_writes`` checks that
    each step leaves them so)."""
    for t in ex.ws.values():
        if t.is_floating_point():
            t.fill_(float("nan"))


def guard_workspace(ex) -> dict[str, torch.Tensor]:
    """Move each workspace buffer into an allocation with GUARD_BYTES of
    poison after it and point the kernel's address table at the moved
    buffers: a store past a buffer's end then changes its guard. Returns
    the guards by buffer name. (Before the first step: the table's KV
    entries are bound again by the next step.)"""
    guards = {}
    for name, t in list(ex.ws.items()):
        extra = GUARD_BYTES // t.element_size()
        # (ARRIVE's int32 counts start at zero, as the executor's do.)
        fill = float("nan") if t.is_floating_point() else 0
        store = torch.full((t.numel() + extra,), fill, dtype=t.dtype,
                           device=t.device)  # fmt: skip
        store[: t.numel()].view(t.shape).copy_(t)
        store[t.numel() :].view(torch.uint8).fill_(GUARD_BYTE)
        ex.ws[name] = store[: t.numel()].view(t.shape)
        guards[name] = store[t.numel() :]
    ex.ptrs_host.copy_(ex._table())
    ex.ptrs.copy_(ex.ptrs_host)
    ex.kv_caches = None
    return guards


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (NaN == NaN), same shape and strides."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                   8: torch.int64}[t.element_size()])  # fmt: skip


def _checksum(t: torch.Tensor) -> int:
    return int(_bits(t).sum(dtype=torch.int64).item())


class StepGuard:
    """What one step must leave alone, taken just before it: every KV cache
    entry but those the step writes, the guard after each workspace buffer,
    the executor's copies of the step's inputs, and the weights."""

    def __init__(self, ex, guards: dict[str, torch.Tensor], inputs: DecodeInputs):
        self.caches = [c.clone() for c in inputs.kv_caches]
        self.guards = guards
        self.statics = {name: getattr(ex, name).clone() for name in STATIC_TABLES}
        self.weights = {name: _checksum(t) for name, t in _weights(ex.weights)}

    def cache_after_step(self, layer: int, cache, inputs: DecodeInputs, n: int):
        """The layer's cache as the step had to leave it: the copy from
        before it, with the kernel's entries at the step's slots (those are
        judged by KV_APPEND)."""
        ref = self.caches[layer].clone()
        at = _at_slots(cache, inputs.slot_mapping[:n].long())
        ref[at] = cache[at]
        return ref

    def stray_writes(self, ex, inputs: DecodeInputs, n: int) -> dict:
        """Counts of changed elements where the step must not write, as
        checks with tolerance 0: KV_STRAY (worst layer), GUARD (buffers
        written past their end), INPUTS and WEIGHTS (what changed); with
        FP8 experts, ARRIVE (counts the step left nonzero)."""
        slots = inputs.slot_mapping[:n].long()
        worst, layer = 0, 0
        for i, (cache, old) in enumerate(
            zip(inputs.kv_caches, self.caches, strict=True)
        ):
            changed = _bits(cache) != _bits(old)
            changed[_at_slots(cache, slots)] = False
            count = int(changed.sum().item())
            if count > worst:
                worst, layer = count, i
        past = {name: int((g.view(torch.uint8) != GUARD_BYTE).sum().item())
                for name, g in self.guards.items()}  # fmt: skip
        expected = {**self.statics, **_staged_inputs(ex, inputs, n)}
        statics = [name for name, t in expected.items()
                   if not torch.equal(_bits(getattr(ex, name)), _bits(t))]  # fmt: skip
        weights = [name for name, t in _weights(ex.weights)
                   if _checksum(t) != self.weights[name]]  # fmt: skip
        return {
            "KV_STRAY": {"max": worst, "tol": 0, "layer": layer},
            "GUARD": {"max": sum(past.values()), "tol": 0,
                      "buffers": [name for name, c in past.items() if c]},
            "INPUTS": {"max": len(statics), "tol": 0, "changed": statics},
            "WEIGHTS": {"max": len(weights), "tol": 0, "changed": weights[:8]},
            **arrive_left(ex),
        }  # fmt: skip


def arrive_left(ex) -> dict:
    """FP8 experts: every slot's ARRIVE count back at zero after a step (the
    slot's last EXPERT_UP tile resets it; a count left over makes the next
    step's last tile miscount, so its quantization for EXPERT_DOWN runs
    early or never): ``{"ARRIVE": check}`` naming the first layer and slot
    left nonzero, ``{}`` for a kernel without them."""
    arrive = ex.ws.get("arrive")
    if arrive is None:
        return {}
    left = (arrive != 0).nonzero().tolist()
    check = {"max": len(left), "tol": 0}
    if left:
        (layer, slot), count = left[0], int(arrive[tuple(left[0])])
        check.update(layer=layer, slot=slot, count=count,
                     left=[f"layer {i} slot {s}" for i, s in left[:8]])  # fmt: skip
    return {"ARRIVE": check}


# What the executor holds for every step and the kernel only reads.
STATIC_TABLES = ("cos_sin", "queue", "lengths")


def _staged_inputs(ex, inputs: DecodeInputs, n: int) -> dict[str, torch.Tensor]:
    """The executor's copies of the step's inputs as the kernel must leave
    them: the real rows' values, the padding rows' (token 0, position 0,
    length 0, slot -1, block 0), block-table columns past the inputs' 0."""
    staged = {}
    for name, pad in (("input_ids", 0), ("positions", 0), ("seq_lens", 0),
                      ("slot_mapping", -1)):  # fmt: skip
        t = torch.full_like(getattr(ex, name), pad)
        t[:n] = getattr(inputs, name)[:n]
        staged[name] = t
    table = torch.zeros_like(ex.block_table)
    width = min(inputs.block_table.shape[1], table.shape[1])
    table[:n, :width] = inputs.block_table[:n, :width]
    staged["block_table"] = table
    return staged


def _weights(w):
    """(name, tensor) of every weight the kernel reads: a quantized layer's
    linears and experts as their codes and scales (its dense fields, their
    dequantization, are the references' and not in the kernel's table)."""
    yield "embed", w.embed
    yield "final_norm", w.final_norm
    if w.lm_head is not None:
        yield "lm_head", w.lm_head
    for i, lw in enumerate(w.layers):
        linears = QUANT_LINEARS if lw.quant is not None else ()
        for name in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm",
                     "o_proj", "post_norm", "gate_up", "down"):  # fmt: skip
            t = getattr(lw, name)
            if t is not None and name not in linears:
                yield f"layer {i} {name}", t
        for name in linears:
            f = getattr(lw.quant, name)
            if f is None:  # (a sparse layer's MLP: its experts, below)
                continue
            yield f"layer {i} {name} codes", f.codes
            yield f"layer {i} {name} scales", f.scale
        if lw.moe is not None:
            yield from _mixture_weights(i, lw.moe)
        for name, t in device_mla.mla_weights(lw):
            yield f"layer {i} {name}", t


def _mixture_weights(i: int, m):
    """A sparse layer's router, experts and shared expert, as ``_weights``
    names them; those ``MoeWeights.quant`` holds as their codes and scales
    (the dense fields beside them are the references'). (TOPK reads the
    launcher's fp32 copy of the correction bias.)"""
    yield f"layer {i} router", m.router
    for name in ("w13", "w2", "shared_gate_up", "shared_down"):
        f = getattr(m.quant, name, None)
        if f is not None:
            yield f"layer {i} experts {name} codes", f.codes
            yield f"layer {i} experts {name} scales", f.scale
        elif getattr(m, name) is not None:
            yield f"layer {i} experts {name}", getattr(m, name)


def _to(inputs: DecodeInputs, dev, clone_kv: bool = False) -> DecodeInputs:
    return DecodeInputs(
        input_ids=inputs.input_ids.to(dev),
        positions=inputs.positions.to(dev),
        block_table=inputs.block_table.to(dev),
        seq_lens=inputs.seq_lens.to(dev),
        slot_mapping=inputs.slot_mapping.to(dev),
        kv_caches=tuple(
            c.clone().to(dev) if clone_kv else c.to(dev) for c in inputs.kv_caches
        ),
    )


# ---------------------------------------------------------------- timing


def time_ms(fn, iters: int = 20, repeats: int = 5) -> float:
    runs = time_runs(fn, iters, repeats)
    return sorted(runs)[len(runs) // 2]


def time_runs(fn, iters: int = 20, repeats: int = 5) -> list[float]:
    """``repeats`` timings (CUDA events) of ``iters`` calls each, in ms per
    call: their median is the figure, their spread the run's noise
    (vllm_ext.megakernel.measured weighs a win against it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / iters)
    return runs


def timed(result: dict, key: str, fn) -> None:
    """``result[key]``: the median of ``fn``'s timings (None without a
    function), and ``result[key without _ms + _runs_ms]``: the timings."""
    runs = time_runs(fn) if fn is not None else None
    result[key] = sorted(runs)[len(runs) // 2] if runs else None
    result[key.removesuffix("_ms") + "_runs_ms"] = runs


def graphed(fn):
    """``fn`` captured in a CUDA graph (replay), or None if capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as e:  # reported, then timed eagerly
        print(f"graph capture failed: {e}", file=sys.stderr)
        return None


def per_op_baseline(spec: ModelSpec) -> str | None:
    """The name of a decode case's per-op step: vLLM's default decode
    (measured.FAIR_BASELINE), or for a quantized dense model the same step
    with its linears by PyTorch's GEMM of its format (per_op.QUANT_BASELINES:
    torch._scaled_mm, the blockwise F.scaled_mm, tinygemm), which stands for
    vLLM's GEMMs without being them: it opens no bucket. None for a
    quantized mixture, timed with no per-op step (``per_op_moe``)."""
    if spec.quant is None:
        return FAIR_BASELINE
    if spec.moe is not None:
        return None
    return QUANT_BASELINES.get(spec.quant.name)


def per_op_moe(spec: ModelSpec) -> str | None:
    """The per-op step's mixture: vLLM's fused-MoE Triton kernels (bf16
    experts: moe_mixture), QUANT_MOE_BASELINE for quantized experts (none:
    the case is timed without a per-op step), None without a mixture."""
    if spec.moe is None:
        return None
    return QUANT_MOE_BASELINE if spec.quant is not None else "vllm-fused-moe-triton"


def timing(case_dir: Path) -> dict:
    spec, program = load_case(case_dir)
    b = program.batch
    weights = random_weights(spec, seed=1, device="cuda")
    context = bench_context(spec)
    max_blocks = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    ex, _ = make_executor(case_dir, program, weights, max_blocks)
    # Every request attends to `context` tokens in shuffled blocks; a verify
    # case's requests are `tokens` rows each, the last at `context`.
    blocks = torch.randperm(b * max_blocks, device="cuda", dtype=torch.int32)
    row = torch.arange(b, device="cuda")
    tokens = case_verify_tokens(case_dir) or 1
    first = row // tokens * tokens  # each row's request's first row
    table = blocks.view(b, max_blocks)[first]
    rows_of = torch.clamp(b - first, max=tokens)
    positions = context - rows_of + (row - first)
    shape = (b * max_blocks, BLOCK_SIZE, spec.num_kv_heads, 2 * spec.head_dim)
    inputs = DecodeInputs(
        input_ids=torch.randint(0, spec.vocab_size, (b,), device="cuda"),
        positions=positions,
        block_table=table,
        seq_lens=(positions + 1).to(torch.int32),
        slot_mapping=table[row, positions // BLOCK_SIZE].long() * BLOCK_SIZE
        + positions % BLOCK_SIZE,
        kv_caches=tuple(
            torch.randn(shape, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3)
            for _ in range(spec.num_layers)
        )
        if spec.mla is None
        else device_mla.bench_caches(spec, b * max_blocks, BLOCK_SIZE, "cuda"),
    )
    predicted = case_dir / PREDICTED
    result = {"batch": b, "context": context, "layers": spec.num_layers,
              # The model's, from the bundle's build (write_predictions).
              "predicted": json.loads(predicted.read_text())
              if predicted.exists() else None,
              # What the calibration re-plans, and the kernel it models
              # (vllm_ext/megakernel/calibrate.py).
              "program": program_record(program),
              "shape": torch.load(case_dir / "program.pt")["shape"]}  # fmt: skip

    def mk():
        ex.step(inputs)

    replay = graphed(mk)
    result["megakernel_graph"] = replay is not None
    timed(result, "megakernel_ms", replay or mk)
    result["megakernel_eager_ms"] = time_ms(mk)
    result["weight_bytes"] = program.weight_bytes()
    if spec.mla is not None:
        result.update(mla_timing(case_dir, spec, weights, inputs, ex, program, mk,
                                 result["megakernel_ms"]))  # fmt: skip
        return result
    if is_variant(case_dir):
        # The baselines are its default twin's (same shapes, same weights);
        # the call's time goes to the rows of the breakdown the variants move.
        try:
            result["breakdown"] = breakdown(ex, program, mk, result["megakernel_ms"],
                                            VARIANT_ROWS)  # fmt: skip
        except Exception as e:  # reported in the JSON
            result["extras_error"] = repr(e)[:500]
        return result
    if per_op_moe(spec) == QUANT_MOE_BASELINE:
        result["per_op_baseline"] = None
        result["per_op_moe"] = QUANT_MOE_BASELINE
        try:
            result["breakdown"] = breakdown(ex, program, mk, result["megakernel_ms"])
        except Exception as e:  # reported in the JSON
            result["extras_error"] = repr(e)[:500]
        return result
    flashinfer = FlashInferDecode.load(case_dir.parent)
    if flashinfer is None:
        result["per_op_error"] = "no FlashInfer in the bundle: no per-op baseline"
        result["breakdown"] = breakdown(ex, program, mk, result["megakernel_ms"])
        return result
    result["per_op_attention"] = "flashinfer-split-kv"
    # What per_op_graph_ms timed, for vllm_ext.megakernel.measured: compiled
    # pieces, one KV-append kernel and split-KV paged attention (per_op.py).
    result["per_op_baseline"] = per_op_baseline(spec)
    if tokens > 1:
        # A verify step per op: FlashInfer's decode takes each row as a
        # request of its own (the rows share their request's block table,
        # each its own length: causal), so it reads a request's cache once a
        # row where vLLM's attention reads it once a request. Slower than
        # vLLM's by at most those extra reads (kv_extra_bytes at the copy
        # bandwidth), it is named apart and opens no bucket.
        result["per_op_baseline"] = VERIFY_BASELINE
        result["kv_extra_bytes"] = (
            (tokens - 1) * (b // tokens) * context * spec.num_layers
            * 2 * spec.num_kv_heads * spec.head_dim * 2
        )  # fmt: skip
    attend = flashinfer_attend(flashinfer, spec, weights, inputs)
    mixture = None
    if spec.moe is not None:
        # vLLM's fused-MoE Triton path (moe_baseline.py), and one layer of
        # it timed alone, beside the kernel's whole step.
        try:
            mixture, result["moe_layer"] = moe_mixture(case_dir, spec, weights, b)
            result["per_op_moe"] = per_op_moe(spec)
        except Exception as e:  # reported; no per-op baseline without it
            result["per_op_error"] = f"MoE baseline: {e!r}"[:500]
            return result
    try:
        # vLLM's default decode: Inductor-compiled pieces around attention,
        # the step in one CUDA graph (the warm-up before capture compiles).
        start = time.time()
        base = per_op_step(spec, weights, inputs, attend, compile_options={},
                           mixture=mixture)  # fmt: skip
        replay = graphed(base)
        result["per_op_compile_s"] = round(time.time() - start, 1)
        timed(result, "per_op_graph_ms", replay)
        # The same function as the kernel's step, on the same inputs: its
        # logits beside the kernel's (drift over the layers, as reported
        # for the interpreter in the correctness pass).
        result["per_op_vs_megakernel"] = rel_err(base(), ex.logits[:b])
    except Exception as e:  # reported; the figures below still come
        result["per_op_error"] = repr(e)[:500]
    if tokens > 1:
        return result
    try:  # the extras below must not cost the main figures above
        # The same ops eagerly (the per-op figure of the first GPU runs).
        replay = graphed(per_op_step(spec, weights, inputs, attend, mixture=mixture))
        result["per_op_eager_ops_graph_ms"] = time_ms(replay) if replay else None
        bound = per_op_step(spec, weights, inputs, attend, elementwise=False,
                            mixture=mixture)  # fmt: skip
        replay = graphed(bound)
        result["gemm_attn_graph_ms"] = time_ms(replay) if replay else None
        result["breakdown"] = breakdown(ex, program, mk, result["megakernel_ms"])
    except Exception as e:  # reported in the JSON
        result["extras_error"] = repr(e)[:500]
    return result


# torch.compile options of the MLA per-op step's pieces: Inductor, as vLLM
# (the CPU tests trace them with aot_eager instead).
MLA_PER_OP_COMPILE: dict = {}


def mla_timing(case_dir: Path, spec: ModelSpec, weights, inputs: DecodeInputs, ex,
               program, mk, full_ms: float) -> dict:  # fmt: skip
    """An MLA case's figures beside the kernel's step: FlashInfer's MLA
    decode against the kernel's attention of the last timed step (where the
    bundle carries it); the per-op step (scripts/baseline/mla_per_op.py:
    compiled pieces, cuBLAS GEMMs, W_UK/W_UV batched GEMMs, the attention
    by FlashInfer's MLA decode, else in torch ops, vLLM's fused MoE for a
    sparse layer) captured in one CUDA graph, its attention alone, the
    attention's roofline (device_mla.roofline; the report takes the
    bandwidth) and the breakdown's MLA rows. No eager-ops or GEMM-only
    step: the call's time."""
    b = program.batch
    context = int(inputs.seq_lens[0])
    out = {"per_op_baseline": "mla-per-op",
           "roofline": device_mla.roofline(spec, b, context)}  # fmt: skip
    mixture = None
    if spec.moe is not None and any(spec.moe.sparse_layers) and spec.quant:
        # (Quantized experts: no per-op step, as timing()'s.)
        out.update(per_op_baseline=None, per_op_moe=QUANT_MOE_BASELINE)
    elif spec.moe is not None and any(spec.moe.sparse_layers):
        try:
            mixture, out["moe_layer"] = moe_mixture(case_dir, spec, weights, b)
            out["per_op_moe"] = "vllm-fused-moe-triton"
        except Exception as e:  # reported; no per-op baseline without it
            out["per_op_error"] = f"MoE baseline: {e!r}"[:500]

    def per_op(name: str, attend) -> None:
        if out.get("per_op_error", "").startswith("MoE baseline"):
            return
        if out.get("per_op_moe") == QUANT_MOE_BASELINE:
            return
        try:
            start = time.time()
            base = mla_per_op.mla_per_op_step(spec, weights, inputs, attend,
                                              compile_options=MLA_PER_OP_COMPILE,
                                              mixture=mixture)  # fmt: skip
            replay = graphed(base)
            out["per_op_compile_s"] = round(time.time() - start, 1)
            timed(out, "per_op_graph_ms", replay)
            out["per_op_vs_megakernel"] = rel_err(base(), ex.logits[:b])
            alone = graphed(mla_per_op.attention_only(spec, inputs, attend))
            out["per_op_attention_ms"] = time_ms(alone) if alone else None
            out["per_op_attention"] = name
            out.pop("per_op_error", None)
        except Exception as e:  # reported; the figures so far stand
            out["per_op_error"] = f"{name}: {e!r}"[:500]

    # The torch attention's per-op step and the breakdown first, FlashInfer's
    # MLA decode last: a fault in the library (an illegal memory access on
    # its first GPU run) ends the context, and every figure after it.
    per_op(mla_per_op.ATTENTION, mla_per_op.torch_mla_attend(spec, weights, inputs))
    try:
        out["breakdown"] = breakdown(ex, program, mk, full_ms, device_mla.ROWS)
    except Exception as e:  # reported in the JSON
        out["extras_error"] = repr(e)[:500]
    flashinfer = FlashInferMla.load(case_dir.parent) if DEVICE == "cuda" else None
    if flashinfer is not None:
        out["flashinfer_mla"] = flashinfer_mla_check(flashinfer, ex, spec, inputs, b)
        if out["flashinfer_mla"]["ok"] is not None:  # it ran, and agrees
            # The stronger per-op step, when it runs: vLLM's FLASHINFER_MLA.
            kept = {k: out[k] for k in out if k.startswith("per_op")}
            attention = flashinfer_attention(flashinfer, spec, weights, inputs)
            name = "flashinfer-mla (FLASHINFER_MLA's Hopper kernel)"
            per_op(name, mla_per_op.absorbed_attend(spec, weights, inputs, attention))
            if "per_op_error" in out:
                out["per_op_flashinfer_error"] = out.pop("per_op_error")
                out.update(kept)
    return out


def moe_mixture(case_dir: Path, spec: ModelSpec, weights, batch: int):
    """(mixture for per_op_step, one layer's figures): vLLM's fused-MoE
    Triton kernels as the bundle carries them (``moe_baseline.prepare``)."""
    import moe_baseline

    base = moe_baseline.MoeBaseline.load(case_dir.parent)
    sparse = [lw.moe for lw in weights.layers if lw.moe is not None]

    def mixture(layer: int, x: torch.Tensor) -> torch.Tensor:
        return moe_baseline.moe_layer(base, x, weights.layers[layer].moe, spec.moe)

    x = torch.randn(batch, spec.hidden_size, device="cuda", dtype=spec.dtype)
    # Several layers, so what they read outweighs the L2.
    alone = moe_baseline.time_layer(base, x, sparse[:4], spec.moe)
    return mixture, alone


# What the breakdown times: the whole program without its waits (what the
# dependencies cost), each instruction kind alone on the SMs the plan gives
# it, an all-NOP program (launch and queue walk), and the all-NOP program
# with the program's waits and signals (what the phase boundaries cost with
# no data to move: polls, atomics, the slowest SM's queue walk).
# name -> (kinds kept, waits kept)
BREAKDOWN = {
    "no waits": (None, False),
    "EMBED": ((Op.EMBED,), False),
    "QKV": ((Op.QKV,), False),
    "ATTN": ((Op.ATTN,), False),
    "COMBINE": ((Op.COMBINE,), False),
    "O_PROJ": ((Op.O_PROJ,), False),
    "GATE_UP": ((Op.GATE_UP,), False),
    "DOWN": ((Op.DOWN,), False),
    "FINAL_NORM": ((Op.FINAL_NORM,), False),
    "LM_HEAD": ((Op.LM_HEAD,), False),
    # A mixture's kinds (a routed tile alone routes on the logits the last
    # step left: valid, if not this step's).
    "ROUTE": ((Op.ROUTE,), False),
    "TOPK": ((Op.TOPK,), False),
    "EXPERT_UP": ((Op.EXPERT_UP,), False),
    "EXPERT_DOWN": ((Op.EXPERT_DOWN,), False),
    "NOP": ((), False),
    "NOP, waits": ((), True),
    **device_mla.BREAKDOWN,
}


# A variant case's rows: what the variants change (the waits: the weight
# pipeline, the L2 lookahead; QKV: head parts; ATTN: wide attention; GATE_UP
# and DOWN: the tensor-core GEMV; NOP: the staged queue).
VARIANT_ROWS = ("no waits", "QKV", "ATTN", "GATE_UP", "DOWN", "NOP", "NOP, waits")


def breakdown(ex, program, step, full_ms: float, rows=tuple(BREAKDOWN)) -> dict:
    """{variant: {ms, weight_bytes}}: where the step's time goes, from
    programs that leave parts out (no hardware counters needed); ``rows``:
    which of BREAKDOWN."""
    original = ex.queue
    by_op: dict[int, int] = {}
    for queue in program.queues:
        for i in queue:
            # (A routed tile's bytes as a step expects them filled.)
            w = program.step_cost(i).weight_bytes
            by_op[int(i.op)] = by_op.get(int(i.op), 0) + w
    # About 0.2 s of replays per variant, whatever the model's size.
    iters = max(2, min(20, int(40 / max(full_ms, 0.05))))
    out = {}
    try:
        for name, (keep, waits) in BREAKDOWN.items():
            if name not in rows or (keep and not any(int(o) in by_op for o in keep)):
                continue  # (not asked for, or no such instruction in the program)
            table, _ = probe(program, keep, waits).encode()
            ex.queue = table.to(original.device)
            replay = graphed(step)
            ms = time_ms(replay or step, iters=iters, repeats=5)
            nbytes = sum(by_op.get(int(o), 0) for o in (keep if keep else ()))
            out[name] = {"ms": ms, "weight_bytes": nbytes if keep else None}
    finally:
        ex.queue = original
    return out


def read_bandwidth() -> float:
    """Bytes/s a large device-to-device copy moves (read + write): what a
    stream of weight reads can get at best."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=5)
    return 2 * src.numel() / (ms / 1e3)


def abort_check(case_dir: Path) -> dict:
    """A program with one wait that can never be met: the step ends (every
    CTA leaves: no hang, no trap), its abort record names a wait that this
    hang starves (starved_wait), and the CUDA context survives: a fresh
    executor of the correct program, in this process, runs a step whose
    logits match the program interpreter's (what the server does next:
    vLLM's decode)."""
    spec, program = load_case(case_dir)
    weights = random_weights(spec, seed=1, device=DEVICE)
    ex, _ = make_executor(case_dir, program, weights, 8)
    queue = ex.queue.clone()
    # The hang in the last layer that has a wait: the SMs with no work
    # after it finish, so a record naming one of them fails the check (a
    # hang in layer 0 starves every SM).
    waits = [
        (int(queue[sm, i, 1]), sm, i)
        for sm in range(queue.shape[0])
        for i in range(int(ex.lengths[sm]))
        if queue[sm, i, 4].item() != NO_COUNTER
    ]
    last = max(layer for layer, _, _ in waits)
    _, sm, idx = min(w for w in waits if w[0] == last)
    counter = int(queue[sm, idx, 4])
    queue[sm, idx, 5] += 1  # one signal more than the program ever sends
    # The aborted step's wall time at each spin bound, each on a fresh
    # executor (the record, once set, stays set): how the time to abort
    # grows with the bound, which the production bound is set from.
    seconds, records = {}, {}
    for spins in ABORT_SPINS:
        if spins != ABORT_SPINS[0]:
            ex, _ = make_executor(case_dir, program, weights, 8)
        ex.queue = queue
        ex.max_spins = spins
        inputs = _to(random_decode_inputs(spec, program.batch, seed=3, max_len=40),
                     DEVICE)  # fmt: skip
        start = time.time()
        ex.step(inputs)
        sync()
        seconds[spins] = round(time.time() - start, 3)
        records[spins] = ex.abort.cpu().tolist()
    record = records[ABORT_SPINS[-1]]
    expected = {
        AbortWord.FLAG: 1, AbortWord.SM: sm, AbortWord.INDEX: idx,
        AbortWord.COUNTER: counter, AbortWord.WHAT: AbortWhat.INPUTS,
    }  # fmt: skip
    stuck = stuck_heads(
        [
            [Instruction.from_words(w) for w in queue[s, : int(n)].tolist()]
            for s, n in enumerate(ex.lengths.tolist())
        ]
    )
    named = all(starved_wait(r, stuck, queue) for r in records.values())
    # The context is alive: the correct program, from a fresh executor.
    fresh, _ = make_executor(case_dir, program, weights, 8)
    inputs = _to(random_decode_inputs(spec, program.batch, seed=4, max_len=40), DEVICE)
    interp = ProgramInterpreter(program, weights, seed=0)
    interp.step(_to(inputs, DEVICE, clone_kv=True))
    fresh.step(inputs)
    sync()
    after = rel_err(fresh.logits[: program.batch], interp.logits)
    clean = fresh.abort.cpu().tolist()[AbortWord.FLAG] == 0
    return {"ok": named and clean and after < ALIVE_TOL,
            "seconds": seconds[ABORT_SPINS[-1]], "seconds_by_spins": seconds,
            "record": record, "planted": {int(k): int(v) for k, v in expected.items()},
            "names_planted": all(record[w] == v for w, v in expected.items()),
            "starved_sms": len(stuck), "names_starved": named,
            "logits_rel_err_after": after, "fresh_record_clear": clean}  # fmt: skip


# The waits of a CTA's own pipeline (controller, producer, consumers): each
# is starved when the CTA's queue is held by an unmet input wait.
PIPELINE_WAITS = (
    AbortWhat.INSTRUCTION,
    AbortWhat.INSTRUCTION_SLOT,
    AbortWhat.WEIGHT_SLOT,
    AbortWhat.WEIGHT_PAGE,
)


def starved_wait(record: list[int], stuck: dict[int, int], queue) -> bool:
    """Whether an abort record names a wait the planted hang starves. Every
    CTA's waits share one spin bound, and the one that expires first need
    not be the planted wait (on an H200 a producer downstream of it expired
    first), so the record is right if it names an SM that cannot finish
    (``stuck``: verify.stuck_heads of the planted queues) and, for an
    input wait, the very instruction and counter that hold it there."""
    if record[AbortWord.FLAG] != 1 or record[AbortWord.SM] not in stuck:
        return False
    sm, what = record[AbortWord.SM], record[AbortWord.WHAT]
    if what == AbortWhat.INPUTS:
        idx = stuck[sm]
        return (record[AbortWord.INDEX], record[AbortWord.COUNTER]) == (
            idx,
            int(queue[sm, idx, 4]),
        )
    return what in PIPELINE_WAITS


# Layers of the program run under compute-sanitizer: every instruction kind
# and a layer-to-layer handoff, at a fraction of the whole model's time (the
# first call's whole 1B model did not finish under it in 150 s).
SANITIZE_LAYERS = 2


def sanitize_step(case_dir: Path) -> dict:
    """Two kernel steps and nothing else (no interpreter) of the case's kernel
    on a SANITIZE_LAYERS-layer program: what runs under compute-sanitizer,
    which slows every kernel by orders of magnitude. The spin bound is
    raised so slowed producers do not look like a hang."""
    layers = int(os.environ.get("DEVICE_SANITIZE_LAYERS", SANITIZE_LAYERS))
    spec, program = load_case(case_dir, layers=layers)
    weights = random_weights(spec, seed=1, device=DEVICE)
    ex, _ = make_executor(
        case_dir, program, weights, (CONTEXT + BLOCK_SIZE - 1) // BLOCK_SIZE
    )
    ex.max_spins = 1 << 30
    for step in range(int(os.environ.get("DEVICE_SANITIZE_STEPS", "2"))):
        progress(f"sanitize: step {step}")
        n = max(1, program.batch - step)
        ex.step(_to(random_decode_inputs(spec, n, seed=7 + step, max_len=CONTEXT),
                    DEVICE))  # fmt: skip
    sync()
    return {"ok": bool(torch.isfinite(ex.logits[:1]).all()),
            "layers": spec.num_layers}  # fmt: skip


# ---------------------------------------------------------------- driver


LOG_CHARS = 200_000


def progress(what: str) -> None:
    """A child's progress line on stderr: kept in the report's tail when the
    child times out, so it says where."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def run_child(what: str, case: Path, timeout: int, prefix: list[str] | None = None,
              log: Path | None = None):  # fmt: skip
    """A child process's verdict: its last JSON line (a wrapper such as
    compute-sanitizer prints its summary after it), with the JSON lines that
    name a ``part`` under ``parts`` (a ``case`` child reports correctness,
    then timing). A failing exit status or a timeout makes it not ok; the
    parts printed before either are kept."""
    cmd = [*(prefix or []), sys.executable, __file__, "--child", what, str(case)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, rc, why = proc.stdout + proc.stderr, proc.returncode, None
        stdout = proc.stdout
    except subprocess.TimeoutExpired as e:
        # (Captured output comes as bytes here, text=True or not.) stderr
        # holds the child's progress lines: where a timeout struck.
        stdout = (e.stdout or b"").decode(errors="replace")
        out = stdout + (e.stderr or b"").decode(errors="replace")
        rc, why = None, f"timeout after {timeout} s"
    found = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    result = dict(found[-1]) if found else {"ok": False}
    if rc != 0:
        result.update(ok=False, **({"rc": rc} if rc is not None else {"why": why}))
    result["seconds"] = round(time.time() - t0, 1)
    result["tail"] = out[-1500:]
    if log is not None:  # the whole output (a sanitizer's report), capped
        if len(out) > 2 * LOG_CHARS:
            out = out[:LOG_CHARS] + "\n[...]\n" + out[-LOG_CHARS:]
        log.write_text(out)
    parts = {d.pop("part"): d for d in found if "part" in d}
    if parts:
        result["parts"] = parts
    return result


def check_case(case: Path, timed: bool) -> None:
    """One process per case: its correctness, then (if correct) its timing,
    each printed as soon as it is known."""
    parts = (("correctness", correctness), ("timing", timing))
    if _ranks_case(case):  # every rank of a TP program in one launch
        layers = case_layers(case)
        parts = (
            ("correctness",
             lambda c: device_ranks.correctness(c, layers, saved_spec)),
            ("timing",
             lambda c: device_ranks.timing(c, layers, saved_spec, time_ms,
                                           graphed)),
        )  # fmt: skip
    for part, fn in parts:
        start = time.time()
        result = fn(case)
        result["seconds"] = round(time.time() - start, 1)
        print(json.dumps({"part": part, **result}), flush=True)
        if not (timed and result.get("ok", True)):
            return


def child(what: str, case: Path) -> None:
    torch.cuda.init()
    if what in ("case", "correctness"):
        check_case(case, timed=what == "case")
    elif what == "abort":
        print(json.dumps(abort_check(case)))
    elif what == "sanitize":
        print(json.dumps(sanitize_step(case)))
    elif what == "bandwidth":
        print(json.dumps({"ok": True, "read_bytes_per_s": read_bandwidth()}))


def markdown(report: dict) -> str:
    bw = report.get("bandwidth", {}).get("read_bytes_per_s")
    lines = [
        f"verdict: {report.get('verdict')}"
        + (f" ({'; '.join(report['why'])})" if report.get("why") else ""),
        f"GPU: {report['gpu']} ({report['num_sms']} SMs), torch {report['torch']}, "
        f"commit {report['manifest'].get('commit')}",
        f"copy bandwidth (2 GiB d2d, read + write): {bw / 1e12:.2f} TB/s" if bw else "",
        "",
        "| case | correct | megakernel ms | per-op graph ms | per-op, eager ops ms "
        "| GEMM+attn graph ms | floor ms | floor / megakernel | per-op / megakernel "
        "| GEMM+attn / megakernel | per-op logits vs megakernel |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return f"{x:.3f}" if isinstance(x, float) else "-"

    def ratio(a, b):
        return f(a / b) if a and b else "-"

    for name, c in report["cases"].items():
        t = c.get("timing", {})
        mk, po = t.get("megakernel_ms"), t.get("per_op_graph_ms")
        if t.get("per_op_baseline", FAIR_BASELINE) not in MAIN_TABLE_BASELINES:
            po = None  # (a verify case's: in the verify table, named)
        ga, pe = t.get("gemm_attn_graph_ms"), t.get("per_op_eager_ops_graph_ms")
        floor = t["weight_bytes"] / bw * 1e3 if bw and "weight_bytes" in t else None
        err = t.get("per_op_vs_megakernel")
        lines.append(
            f"| {name} | {c['correctness'].get('ok')} | {f(mk)} | {f(po)} | {f(pe)} "
            f"| {f(ga)} | {f(floor)} | {ratio(floor, mk)} | {ratio(po, mk)} "
            f"| {ratio(ga, mk)} | {f'{err:.1e}' if err is not None else '-'} |"
        )
    verify = report["manifest"].get("verify", {})
    # A variant's case is its default's name and "-VARIANT" (device_check.sh).
    variants = [
        (n, n.rsplit("-", 1)[0])
        for n in report["cases"]
        if n.rsplit("-", 1)[0] in report["cases"] and n not in verify
    ]
    if variants:
        lines += [
            "",
            "Variants against the default kernel (same call):",
            "",
            "| variant | correct | default ms | variant ms | default / variant |",
            "|---|---|---|---|---|",
        ]
        for name, base in variants:
            mine = (report["cases"][name].get("timing") or {}).get("megakernel_ms")
            ref = (report["cases"][base].get("timing") or {}).get("megakernel_ms")
            ok = report["cases"][name]["correctness"].get("ok")
            lines.append(
                f"| {name} | {ok} | {f(ref)} | {f(mine)} | {ratio(ref, mine)} |"
            )
    verified = [n for n in report["cases"] if n in verify]
    if verified:
        lines += [
            "",
            "Speculative verify steps (requests of 1 + k rows) against the "
            "model's decode step at batch 1 and its decode step of as many rows "
            "(same call):",
            "",
            "| case | correct | rows a request | verify ms | batch-1 decode ms "
            "| verify / batch 1 | same-rows decode ms | per-op verify ms "
            "(rows as requests) | per-op / verify |",
            "|---|---|---|---|---|---|---|---|---|",
        ]

        def step_ms(case: str) -> float | None:
            timing = report["cases"].get(case, {}).get("timing") or {}
            return timing.get("megakernel_ms")

        for name in verified:
            model, rows = re.fullmatch(r"(.*)-b(\d+)-verify\d+", name).groups()
            mine, one = step_ms(name), step_ms(f"{model}-b1")
            ok = report["cases"][name]["correctness"].get("ok")
            timing = report["cases"][name].get("timing") or {}
            per_op = timing.get("per_op_graph_ms")
            lines.append(
                f"| {name} | {ok} | {verify[name]} | {f(mine)} | {f(one)} "
                f"| {ratio(mine, one)} | {f(step_ms(f'{model}-b{rows}'))} "
                f"| {f(per_op)} | {ratio(per_op, mine)} |"
            )
    modelled = {
        n: c["timing"]
        for n, c in report["cases"].items()
        if (c.get("timing") or {}).get("predicted")
    }
    if modelled:
        lines += [
            "",
            "The cost model beside the measurement (the case's program at its "
            "context, H200 figures; of the kernel, only its lookahead is "
            "modelled):",
            "",
            "| case | context | megakernel ms | model ms at "
            + " / ".join(map(str, LATENCIES_US))
            + " us per wait | megakernel / model at "
            + f"{LATENCIES_US[0]} us |",
            "|---|---|---|---|---|",
        ]
        for name, t in modelled.items():
            p, mk = t["predicted"], t.get("megakernel_ms")
            steps = [p["step_ms"].get(str(us)) for us in LATENCIES_US]
            lines.append(
                f"| {name} | {p['context']} | {f(mk)} | "
                + " / ".join(f(x) for x in steps)
                + f" | {ratio(mk, steps[0])} |"
            )
    timed = {
        n: c["timing"]["breakdown"]
        for n, c in report["cases"].items()
        if "breakdown" in (c.get("timing") or {})
    }
    if timed:
        lines += [
            "",
            "Breakdown (no waits unless named; each kind alone on its planned "
            "SMs): ms (weight TB/s)",
            "",
            "| variant | " + " | ".join(timed) + " |",
            "|---|" + "---|" * len(timed),
        ]
        for variant in [v for v in BREAKDOWN if any(v in b for b in timed.values())]:
            cells = []
            for b in timed.values():
                v = b.get(variant, {})
                ms, nbytes = v.get("ms"), v.get("weight_bytes")
                tbs = f" ({nbytes / ms / 1e9:.2f})" if ms and nbytes else ""
                cells.append(f(ms) + tbs)
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += device_mla.markdown_lines(report, bw)
    lines += device_ranks.markdown_lines(report)
    attention = {
        c["timing"].get("per_op_attention")
        for c in report["cases"].values()
        if isinstance(c.get("timing"), dict) and c["timing"].get("per_op_attention")
    }
    lines += ["", f"per-op attention: {', '.join(sorted(attention)) or '-'}"]

    def timed_with(key: str, value: str) -> list[str]:
        return [
            name
            for name, c in report["cases"].items()
            if isinstance(c.get("timing"), dict) and c["timing"].get(key) == value
        ]

    # A per-op figure in the main table against another step than vLLM's
    # default decode (a quantized case's) says so.
    for baseline in QUANT_BASELINES.values():
        if named := timed_with("per_op_baseline", baseline):
            lines.append(f"per-op step of {', '.join(named)}: {baseline} (vLLM's "
                         "quantized linears by PyTorch's GEMM of the format, not "
                         "vLLM's kernel; opens no bucket)")  # fmt: skip
    if unmatched := timed_with("per_op_moe", QUANT_MOE_BASELINE):
        lines.append(f"per-op MoE of {', '.join(unmatched)}: {QUANT_MOE_BASELINE}")
    sanitizer = "; ".join(
        f"{tool} {r['status']}"
        + (f" on {r['case']}" if r.get("case") else "")
        + (f" ({r['why']})" if r.get("why") else "")
        for tool, r in report["sanitizer"].items()
    )
    planted = "; ".join(
        f"{name} ({p.get('bug')}): "
        + {True: "rejected", False: "PASSED", None: "not run"}[p.get("rejected")]
        + (f" by {', '.join(p['failing'])}" if p.get("failing") else "")
        for name, p in report.get("planted", {}).items()
    )
    graphs = [
        f"{name} {c['correctness']['graph'].get('ok')}"
        for name, c in report["cases"].items()
        if isinstance(c["correctness"].get("graph"), dict)
    ]
    lines += [
        "",
        f"abort: {report.get('abort', {}).get('ok')}",
        f"planted bugs: {planted or 'none in the bundle'}",
        f"sanitizer: {sanitizer}",
        f"CUDA-graph replays checked: {', '.join(graphs) or 'none'}",
        f"skipped (out of time): {', '.join(report['skipped']) or 'none'}",
    ]
    return "\n".join(lines) + "\n"


def _case_order(case: Path, variant_order: list[str]) -> tuple[int, int, int]:
    """Smallest shape first, then smallest batch; the default before its
    variants, and those in the order device_check.sh lists them."""
    meta = torch.load(case / "program.pt")
    size = meta["spec"]["num_layers"] * meta["spec"]["hidden_size"]
    rank = 0
    if is_variant(case) or case_verify_tokens(case):
        listed = case.name in variant_order
        rank = 1 + (variant_order.index(case.name) if listed else len(variant_order))
    return size, meta["batch"], rank


def _ranks_case(case: Path) -> bool:
    return device_ranks.is_ranks_case(torch.load(case / "program.pt"))


def planted_bug(case: Path) -> str:
    """The bug a planted case's kernel was built with ("" for a real one)."""
    return torch.load(case / "program.pt")["shape"].get("planted_bug", "")


# compute-sanitizer tools: their arguments, kernel steps, program layers and
# time limit (s). memcheck (global memory) on two steps of two layers (the
# second step reuses the first's counters); racecheck (shared memory only)
# on one step of one layer, of the bundle's racecheck cases where it has
# them (manifest "racecheck": the first case's model with a short LM head,
# device_check.sh): one step of two layers and the 1B model's LM head,
# 0.77 GB through the weight ring, did not end in 240 s on an H200. Each
# must pass for a passed verdict; each one's whole output is kept beside the
# report (OUT/<tool>.log).
SANITIZERS = {
    "memcheck": (["--tool", "memcheck"], 2, 2, 120),
    "racecheck": (
        ["--tool", "racecheck", "--racecheck-report", "hazard", "--print-limit", "100"],
        1,
        1,
        240,
    ),
}
SANITIZE_WORST = ("failed", "not run", "passed")
# What compute-sanitizer prints when it cannot run on the machine at all
# (gVisor: KINDS.md), as opposed to finding an error.
SANITIZER_UNSUPPORTED = ("Device not supported", "Unable to find injection")


def sanitizer_status(result: dict, limit: int) -> dict:
    """passed / failed / not run, from a sanitize child's result."""
    tail = result.get("tail", "")
    if result.get("ok") is None:
        return {"status": "not run", "why": result.get("why", "skipped")}
    if any(m in tail for m in SANITIZER_UNSUPPORTED):
        return {"status": "not run", "why": "the sanitizer cannot run here",
                "tail": tail[-600:]}  # fmt: skip
    if "why" in result and "timeout" in result["why"]:
        return {"status": "not run", "why": f"timeout after {limit} s",
                "tail": tail[-600:]}  # fmt: skip
    clean = re.search(r"ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards", tail)
    if result.get("ok") and clean:
        return {"status": "passed", "seconds": result.get("seconds")}
    if result.get("ok") and "SUMMARY" not in tail:
        return {"status": "not run", "why": "no sanitizer summary in the output",
                "tail": tail[-600:]}  # fmt: skip
    return {"status": "failed", "rc": result.get("rc"), "tail": tail[-1500:]}


def main() -> int:
    if sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]))
        return 0
    if sys.argv[1] == "--predict":  # device_check.sh, on the build machine
        write_predictions(Path(sys.argv[2]))
        return 0
    bundle, out = Path(sys.argv[1]), Path(sys.argv[2])
    quick = "--quick" in sys.argv
    deadline = time.time() + BUDGET_S
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    manifest = json.loads((bundle / "manifest.json").read_text())
    report = {
        "gpu": props.name, "num_sms": props.multi_processor_count,
        "torch": torch.__version__, "manifest": manifest, "cases": {},
        "planted": {}, "skipped": [],
    }  # fmt: skip
    # What the deadline cuts should be the end of this order: the largest
    # shapes, the last-listed variants.
    order = manifest.get("variant_order", [])
    found = [p for p in bundle.iterdir() if (p / "program.pt").exists()]
    planted = sorted(p for p in found if planted_bug(p))
    # Cases built for racecheck alone (SANITIZERS) are not checked or timed.
    racecheck_cases = [bundle / name for name in manifest.get("racecheck", [])]
    cases = sorted((p for p in found
                    if not planted_bug(p) and p not in racecheck_cases),
                   key=lambda case: _case_order(case, order))  # fmt: skip
    # A second call can take the cases the first one's deadline cut, e.g.
    # DEVICE_CHECK_ONLY="llama-3.1-8b-*" (shell patterns, space-separated);
    # its first case again carries the abort, planted bugs and sanitizers.
    only = os.environ.get("DEVICE_CHECK_ONLY", "").split()
    if only:
        cases = [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in only)]
    # The planted bugs' correct twin goes first (device_check.sh names it):
    # the abort and the sanitizers then run on the kernel the bugs were
    # planted in.
    cases.sort(key=lambda case: case.name != manifest.get("first"))

    def run(what: str, case: Path, limit: int, prefix=None, log=None) -> dict:
        """A child run, or a skip when the call's time is nearly spent (the
        whole check must end inside one device call)."""
        left = int(deadline - time.time())
        if left < 30:
            report["skipped"].append(f"{what} {case.name}")
            return {"ok": None, "why": "skipped: out of time"}
        result = run_child(what, case, min(limit, left), prefix, log)
        parts = result.get("parts") or {what: result}
        verdicts = ", ".join(f"{p} ok={r.get('ok', True)}" for p, r in parts.items())
        print(f"[device_run] {what} {case.name}: {verdicts} in "
              f"{result.get('seconds')} s", flush=True)  # fmt: skip
        return result

    def save() -> None:
        report["verdict"], report["why"] = verdict(report)
        report["ok"] = report["verdict"] == "passed"
        (out / "device_check.json").write_text(json.dumps(report, indent=2))

    def check(case: Path) -> None:
        # One process checks and then times the case (one start-up, one
        # weight draw); without --quick it may run both limits.
        result = run("correctness" if quick else "case", case, 90 if quick else 180)
        parts = result.get("parts", {})
        entry = {"correctness": parts.get("correctness", result)}
        if "timing" in parts:
            entry["timing"] = parts["timing"]
        elif not quick and entry["correctness"].get("ok"):
            entry["timing"] = {key: result.get(key) for key in ("why", "rc", "tail")}
            entry["timing"]["ok"] = False
        report["cases"][case.name] = entry
        save()

    sanitizer = shutil.which("compute-sanitizer")
    why = "queued" if sanitizer else "compute-sanitizer not installed"
    # DEVICE_CHECK_SANITIZE=0 leaves them to another call (they took 160 s
    # and more): the verdict stays incomplete until a call runs them.
    if os.environ.get("DEVICE_CHECK_SANITIZE", "1") == "0":
        sanitizer, why = None, "left to another call (DEVICE_CHECK_SANITIZE=0)"
    report["sanitizer"] = {
        tool: {"status": "not run", "why": why} for tool in SANITIZERS
    }
    # DEVICE_CHECK_BASICS=0: a later call at the same source hash leaves out
    # what an earlier one ran on the first case (its check and timing, the
    # abort, the planted bugs; measured.combine joins the calls) and keeps
    # the sanitizers on its kernel, then the other cases.
    basics = os.environ.get("DEVICE_CHECK_BASICS", "1") != "0"
    if not basics:
        planted = []
    for case in planted:
        report["planted"][case.name] = {"bug": planted_bug(case), "rejected": None}

    # First what every later figure rests on: the first case checked and
    # timed, the abort, the planted bugs rejected, the sanitizers on the
    # first case's kernel. Then the other cases, smallest first.
    if not quick:
        report["bandwidth"] = run("bandwidth", cases[0], 60)
    if basics:
        check(cases[0])
        # (A hang or a dead context fails it: the child's time limit or crash.)
        report["abort"] = run("abort", cases[0], 90)
    save()
    for case in planted:
        result = run("correctness", case, 90)
        rejected = None if result.get("ok") is None else not result.get("ok")
        failing = [
            op
            for step in result.get("steps", [])
            for op, v in step.get("errors", {}).items()
            if not passes(v)
        ]
        report["planted"][case.name].update(
            rejected=rejected, failing=sorted(set(failing)),
            why=result.get("why"), tail=result.get("tail", "")[-600:],
        )  # fmt: skip
        save()

    def sanitize(tool: str, case: Path, log: Path) -> dict:
        args, steps, layers, limit = SANITIZERS[tool]
        # Without torch's caching allocator every buffer is its own
        # allocation, so memcheck sees a store past its end.
        prefix = ["env", "PYTORCH_NO_CUDA_MEMORY_CACHING=1",
                  f"DEVICE_SANITIZE_STEPS={steps}",
                  f"DEVICE_SANITIZE_LAYERS={layers}", sanitizer, *args,
                  "--error-exitcode", "3"]  # fmt: skip
        return sanitizer_status(run("sanitize", case, limit, prefix, log), limit)

    # DEVICE_CHECK_SANITIZERS="memcheck": the tools this call runs.
    tools = os.environ.get("DEVICE_CHECK_SANITIZERS", " ".join(SANITIZERS)).split()
    targets = {"memcheck": [cases[0]], "racecheck": racecheck_cases or [cases[0]]}
    if sanitizer:
        for tool in tools:
            results = {}
            for case in targets[tool]:
                log = (
                    f"{tool}.log"
                    if case == targets[tool][0]
                    else f"{tool}-{case.name}.log"
                )
                results[case.name] = sanitize(tool, case, out / log)
            worst = min(
                results.values(), key=lambda r: SANITIZE_WORST.index(r["status"])
            )
            report["sanitizer"][tool] = {"case": ", ".join(results), **worst}
            if len(results) > 1:
                report["sanitizer"][tool]["cases"] = results
            save()
        # Racecheck on other kernels too, reported apart, not in the verdict:
        # DEVICE_CHECK_RACECHECK_ALSO="llama-3.2-1b-b1-legacy" (no weight
        # ring) tells whether a hazard site is the ring's.
        for name in os.environ.get("DEVICE_CHECK_RACECHECK_ALSO", "").split():
            report.setdefault("racecheck_also", {})[name] = sanitize(
                "racecheck", bundle / name, out / f"racecheck-{name}.log"
            )
            save()
    for case in cases[1:]:
        check(case)
    save()
    (out / "device_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""The GPU check's per-op baseline (scripts/baseline/per_op.py) computes the
decode step the megakernel does: held to the plain reference forward on CPU,
eager and compiled, so a timing against it compares like with like."""

import dataclasses

import pytest
import torch
from test_interpret import SPECS, make_spec

from tests.utils import load_script
from vllm_ext.demo_models import hf_config
from vllm_ext.model_spec import ModelSpec
from vllm_ext.quant import (
    FP8_BLOCK,
    FP8_W8A8,
    INT4_W4A16,
    PACK_QUANTIZED,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    QuantFormat,
    quantize_blocks,
    quantize_input,
    quantize_int4,
    quantize_rows,
)
from vllm_ext.reference import ReferenceExecutor, linear
from vllm_ext.testing import random_decode_inputs, random_weights
from vllm_ext.weights import QUANT_LINEARS

# Logits against the reference's, max |a - b| / max |b|: the baseline's LM
# head rounds to bf16 before widening (as vLLM's does), and its GEMMs sum in
# another order: two layers of bf16 leave 2e-3 (7e-3 through Inductor's CPU
# code, which skips roundings inside a fused kernel, as it does on a GPU).
TOL = 1e-2


def _per_op():
    return load_script("scripts/baseline/per_op.py")


def _reference_logits(spec, weights, inputs) -> torch.Tensor:
    out = ReferenceExecutor(spec, weights).step(inputs)
    return out.float() @ weights.lm_head.float().t()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _clone(inputs):
    kv = tuple(c.clone() for c in inputs.kv_caches)
    return dataclasses.replace(inputs, kv_caches=kv)


@pytest.mark.parametrize("arch", sorted(SPECS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_per_op_step_is_the_reference_step(arch, compiled):
    per_op = _per_op()
    spec = make_spec(arch, torch.bfloat16)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    mine = _clone(inputs)
    ref = _reference_logits(spec, weights, inputs)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # aot_eager: Dynamo and AOTAutograd trace the pieces as Inductor gets
    # them (the GPU check compiles with Inductor), without C++ codegen here.
    options = {"backend": "aot_eager"} if compiled else None
    step = per_op.per_op_step(spec, weights, mine, per_op.paged_attend(weights, mine),
                              compile_options=options)  # fmt: skip
    assert _rel(step(), ref) < TOL
    # The new token's K/V went into the cache where the reference put them.
    for got, want in zip(mine.kv_caches, inputs.kv_caches, strict=True):
        assert _rel(got.float(), want.float()) < 2**-7
    if compiled:
        # One graph per piece, whatever the number of layers: the weights
        # are arguments, so no layer recompiles (past Dynamo's recompile
        # limit a piece would silently run eagerly) and none breaks.
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
        assert not torch._dynamo.utils.counters["graph_break"]
        step()
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3


def test_per_op_step_is_the_reference_verify_step():
    """The GPU check's per-op verify step: each row of a request of 1 + 3
    tokens is a request of its own to the decode attention (its request's
    block table, its own length), after the step's KV writes: the reference
    verify step, so its timing compares like with like (FlashInfer's decode
    stands where paged_attend does here)."""
    from vllm_ext.testing import random_verify_inputs

    per_op = _per_op()
    spec = make_spec("llama", torch.bfloat16)
    weights = random_weights(spec, seed=3)
    inputs = random_verify_inputs(spec, 4, 4, seed=5)
    assert inputs.block_table.unique(dim=0).shape[0] == 1  # one request
    mine = _clone(inputs)
    ref = _reference_logits(spec, weights, inputs)
    step = per_op.per_op_step(spec, weights, mine, per_op.paged_attend(weights, mine))
    assert _rel(step(), ref) < TOL
    for got, want in zip(mine.kv_caches, inputs.kv_caches, strict=True):
        assert _rel(got.float(), want.float()) < 2**-7


def test_the_gemm_and_attention_floor_leaves_the_elementwise_ops_out():
    """The floor variant is not the step (so the comparison above can fail),
    and it keeps every GEMM and the attention (the logits' shape)."""
    per_op = _per_op()
    spec = make_spec("llama", torch.bfloat16)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    ref = _reference_logits(spec, weights, _clone(inputs))
    step = per_op.per_op_step(spec, weights, inputs,
                              per_op.paged_attend(weights, inputs),
                              elementwise=False)  # fmt: skip
    got = step()
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert _rel(got, ref) > TOL


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_mixture_runs_between_the_compiled_pieces(compiled):
    """Qwen3-MoE (a dense layer, then a sparse one): the mixture is an op
    of its own between compiled pieces, and the step is still the
    reference's."""
    per_op = _per_op()
    spec = ModelSpec.from_hf_config(hf_config("qwen3_moe"), torch.bfloat16, 512)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    ref = _reference_logits(spec, weights, _clone(inputs))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    calls = []

    def mixture(layer, x):
        calls.append(layer)
        return per_op.reference_mixture(spec, weights)(layer, x)

    options = {"backend": "aot_eager"} if compiled else None
    step = per_op.per_op_step(spec, weights, inputs,
                              per_op.paged_attend(weights, inputs),
                              compile_options=options, mixture=mixture)  # fmt: skip
    assert _rel(step(), ref) < TOL
    assert calls == [i for i, s in enumerate(spec.moe.sparse_layers) if s]
    if compiled:
        # first, middle (dense layer 0 into 1), moe_in, final: no break.
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4
        assert not torch._dynamo.utils.counters["graph_break"]


# compressed-tensors' per-channel FP8 (W8A8, dynamic per-token activations).
FP8 = QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)
# An FP8 step's logits against the reference's. Each linear agrees to one
# bf16 rounding on the same input (above), but where the two steps' bf16
# inputs to a linear differ by a rounding (another summation order
# upstream), the e4m3 code of that element may round the other way: a
# step of 2^-4 to 2^-3 of it, not 2^-8. At this model's K of 256 one such
# element moves its outputs by up to ~1%, and two layers carry it on:
# 0.2% in most draws, 2% and 5% in two of 24 (llama, qwen2, qwen3,
# mistral, 6 seeds each). Still far from a wrong scale or missing codes.
FP8_TOL = 0.06


def test_per_token_quantization_is_the_references():
    """The FP8 baseline's input quantization (vLLM's QuantFP8 in torch) is
    the one the references and the kernel apply, bit for bit: rows of very
    different magnitudes, and a zero row (its scale clamped, not 0)."""
    per_op = _per_op()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-4, 3, 5)[:, None]
    x = x.to(torch.bfloat16)
    x[2] = 0
    codes, scale = per_op.quantize_per_token(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (5, 1)
    assert torch.equal(codes.float() * scale, quantize_input(x, FP8))
    assert scale[2].item() == torch.tensor(1 / (448 * 512)).item()


def test_an_fp8_linear_is_the_references():
    """One FP8 linear on the same input: torch._scaled_mm's fp32 sums of
    e4m3 products, scaled after the sum and rounded to bf16 once, against
    the reference's quantized input times the dequantized weight in fp32
    (the same products, scaled before the sum): fp32 rounding apart, so
    within one bf16 rounding of each output (2^-8 of it, with a floor for
    outputs near 0); the bias (qwen2's) added to the fp32 sums."""
    per_op = _per_op()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    w = quantize_rows(torch.randn(384, 512, generator=g) * 0.05)
    bias = torch.randn(384, generator=g).to(torch.bfloat16)
    for b in (None, bias):
        got = per_op.fp8_linear(x, w.codes, w.scale, b)
        want = linear(quantize_input(x, FP8), w.dequantize(), b)
        assert got.dtype == torch.bfloat16
        err = (got.float() - want).abs() / (want.abs() + want.abs().max() / 64)
        assert err.max() <= 2**-8 * 1.01  # (fp32 sums in another order: slack)


def test_an_fp8_step_needs_the_codes():
    """FP8 weights without their codes (the dense dequantization alone) are
    refused, not run as bf16 GEMMs: that would time another model."""
    per_op = _per_op()
    spec = dataclasses.replace(make_spec("llama", torch.bfloat16), quant=FP8)
    weights = random_weights(spec, seed=3)
    bare = dataclasses.replace(weights, layers=tuple(
        dataclasses.replace(lw, quant=None) for lw in weights.layers))  # fmt: skip
    inputs = random_decode_inputs(spec, 1, seed=5)
    with pytest.raises(ValueError, match="codes and scales"):
        per_op.per_op_step(spec, bare, inputs, per_op.paged_attend(bare, inputs))


FP8_BLOCKS = QuantFormat(FP8_BLOCK, "fp8", 8, 128, PER_TOKEN_GROUP)
INT4 = QuantFormat(INT4_W4A16, PACK_QUANTIZED, 4, 32)


def _blockwise_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, *,
                         output_dtype):  # fmt: skip
    """``F.scaled_mm``'s 1 x 128 by 128 x 128 contract as cuBLASLt takes it
    (no CPU kernel has it): ``a`` [M, K] e4m3 with ``scale_a`` [M, K / 128]
    outer-dim major, ``b`` [K, N] (a row-major [N, K] transposed) with
    ``scale_b`` [K / 128, N / 128]; each K block's fp32 sums times both
    scales, summed in fp32, out in ``output_dtype``."""
    import torch.nn.functional as F

    m, k = a.shape
    n = b.shape[1]
    assert (recipe_a, recipe_b) == (F.ScalingType.BlockWise1x128,
                                    F.ScalingType.BlockWise128x128)  # fmt: skip
    assert scale_a.shape == (m, k // 128) and scale_a.stride(0) == 1
    assert scale_b.shape == (k // 128, n // 128) and b.stride(0) == 1
    out = torch.zeros(m, n)
    for kb in range(k // 128):
        cols = slice(kb * 128, (kb + 1) * 128)
        part = a[:, cols].float() @ b[cols].float()
        out += part * scale_a[:, kb, None] * scale_b[kb].repeat_interleave(128)
    return out.to(output_dtype)


def test_per_token_group_quantization_is_the_references():
    """The FP8-block baseline's input quantization (vLLM's group
    quantization in torch) is the references' and the kernel's, bit for
    bit: groups of very different magnitudes, and a zero group."""
    per_op = _per_op()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 512, generator=g) * torch.logspace(-4, 3, 512)[None, :]
    x = x.to(torch.bfloat16)
    x[1, 128:256] = 0
    codes, scale = per_op.quantize_per_token_group(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 4)
    dequantized = codes.float().view(3, 4, 128) * scale[..., None]
    assert torch.equal(dequantized.view(3, 512), quantize_input(x, FP8_BLOCKS))
    assert scale[1, 1].item() == torch.tensor(1 / (448 * 512)).item()


def test_an_fp8_block_linear_is_the_references(monkeypatch):
    """One FP8-block linear through ``F.scaled_mm``'s blockwise contract
    (emulated: no CPU kernel has it; the emulation also checks the scales'
    layouts cuBLASLt takes) against the reference's group-quantized input
    times the dequantized blocks: within one bf16 rounding of each output."""
    per_op = _per_op()
    monkeypatch.setattr(per_op.F, "scaled_mm", _blockwise_scaled_mm)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    w = quantize_blocks(torch.randn(384, 512, generator=g) * 0.05)
    got = per_op.fp8_block_linear(x, w.codes, w.scale)
    want = linear(quantize_input(x, FP8_BLOCKS), w.dequantize(), None)
    err = (got.float() - want).abs() / (want.abs() + want.abs().max() / 64)
    assert got.dtype == torch.bfloat16 and err.max() <= 2**-8 * 1.01


def test_an_int4_linear_is_marlins_weight():
    """tinygemm on ``int4_operand``'s packing (its CPU kernel here) reads
    each weight as ``(q - 8) * s`` rounded to bf16, Marlin's, exactly: the
    identity through it gives the dequantized weight bit for bit; on random
    inputs its outputs stay within 1% of the largest (this CPU kernel's
    precision, not fp32 sums: 4% of a small output at K = 32)."""
    per_op = _per_op()
    g = torch.Generator().manual_seed(2)
    w = quantize_int4((torch.randn(256, 512, generator=g) * 0.05).bfloat16(), 32)
    packed, scales_zeros = per_op.int4_operand(w)
    assert scales_zeros.shape == (512 // 32, 256, 2) and not scales_zeros[..., 1].any()
    eye = torch.eye(512, dtype=torch.bfloat16)
    got = per_op.int4_linear(eye, packed, scales_zeros).t()
    assert torch.equal(got, w.dequantize())
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    want = linear(x, w.dequantize(), None)
    assert _rel(per_op.int4_linear(x, packed, scales_zeros).float(), want) < 1e-2


@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-block", "int4"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_quantized_per_op_step_is_the_reference_step(monkeypatch, fmt, compiled):
    """An FP8 W8A8, an FP8-block and an INT4 model's per-op steps (their
    linears by torch._scaled_mm, the CPU's here and the GPU's on the H200;
    by the blockwise scaled GEMM, emulated; by tinygemm) compute the
    reference forward's step (inputs quantized by quantize_input,
    dequantized weights) from the layers' codes and scales: the dense fields
    are NaN. Each still three compiled graphs (a quantized weight is a pair
    of tensor arguments; INT4's packed once at set-up). (A QKV bias through
    the FP8 GEMM: test_an_fp8_linear_is_the_references.)"""
    per_op = _per_op()
    monkeypatch.setattr(per_op.F, "scaled_mm", _blockwise_scaled_mm)
    quant = {"fp8-channel": FP8, "fp8-block": FP8_BLOCKS, "int4": INT4}[fmt]
    spec = dataclasses.replace(make_spec("llama", torch.bfloat16), quant=quant)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    mine = _clone(inputs)
    ref = _reference_logits(spec, weights, inputs)
    nan = dataclasses.replace(weights, layers=tuple(
        dataclasses.replace(lw, **{n: torch.full_like(getattr(lw, n), float("nan"))
                                   for n in QUANT_LINEARS})
        for lw in weights.layers))  # fmt: skip
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"backend": "aot_eager"} if compiled else None
    step = per_op.per_op_step(spec, nan, mine, per_op.paged_attend(nan, mine),
                              compile_options=options)  # fmt: skip
    # (INT4: tinygemm's CPU kernel, 1% of a linear's largest output, above.)
    assert _rel(step(), ref) < (2 * TOL if fmt == "int4" else FP8_TOL)
    for got, want in zip(mine.kv_caches, inputs.kv_caches, strict=True):
        assert _rel(got.float(), want.float()) < 2**-7
    if compiled:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
        assert not torch._dynamo.utils.counters["graph_break"]

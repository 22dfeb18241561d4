# SPDX-License-Identifier: Apache-2.0
"""The per-op decode step that the GPU check times the megakernel against:
what vLLM's default decode runs on CUDA, kernel by kernel, in PyTorch.

vLLM 0.32's default decode on an H200, and the stand-in for each part
(each chosen to be no slower than what it stands for; argued, not yet timed
against vLLM on a GPU):

- the GEMMs (fused QKV, O, fused gate/up, down, LM head): cuBLAS through
  ``F.linear``, here too: the same library and calls.
- an FP8 W8A8 model's linears (``quant.FP8_W8A8``: e4m3 weights with a
  scale an output row, inputs quantized per token; the LM head stays
  bf16): vLLM's ``Fp8LinearOp``, its input quantized per token by
  ``QuantFP8``'s torch code (which Inductor fuses with the norm before
  it), then CUTLASS's ``cutlass_scaled_mm`` (sm90: the
  ``KernelTmaWarpSpecializedPingpongFP8FastAccum`` schedule,
  ``csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh:107``
  of the 0.32.0 sdist). Here: the same quantization in torch (``quantize_per_token``,
  compiled with its piece), then ``torch._scaled_mm`` with row-wise scales
  and fast accumulation (``fp8_linear``): PyTorch's FP8 GEMM, not vLLM's
  CUTLASS one, so the step is named apart (``FP8_BASELINE``) and opens no
  bucket (``measured.FAIR_BASELINE``).
- an FP8-block model's linears (``quant.FP8_BLOCK``: 128 x 128 weight
  blocks, inputs per token in groups of 128): vLLM's
  ``W8A8BlockFp8LinearOp``, the input quantized by its group quantization,
  then CUTLASS's blockwise scaled GEMM on Hopper. Here: the same
  quantization in torch (``quantize_per_token_group``), then PyTorch's
  blockwise scaled GEMM (``F.scaled_mm`` with 1 x 128 and 128 x 128 scales:
  cuBLASLt; ``fp8_block_linear``). Named apart (``FP8_BLOCK_BASELINE``).
- an INT4 W4A16 model's linears (``quant.INT4_W4A16``): vLLM's Machete or
  Marlin GEMM. Here: PyTorch's tinygemm (``torch._weight_int4pack_mm``:
  bf16 activations, a weight ``(q - 8) * s`` with zero offsets 0, as
  Marlin's; ``int4_linear``) on the codes packed once (``int4_operand``).
  Named apart (``INT4_BASELINE``). Neither replacement is vLLM's kernel,
  and neither has been timed against it.
- the elementwise work between them (residual add + RMSNorm, QK-norm, RoPE
  with its cos/sin lookup, SiLU-mul): Inductor-fused kernels of the model
  compiled piecewise, split at attention. Here: the same pieces compiled by
  ``torch.compile`` with Inductor (below).
- the cache write: ``reshape_and_cache_flash``, one kernel per layer. Here:
  ``kv_append`` (``flashinfer_baseline.py``), one kernel per layer doing the
  same copies.
- decode attention: FlashAttention 3 with split-KV scheduling (each long KV
  cut so the batch's CTAs fill the SMs, the splits then merged). Here:
  FlashInfer's paged decode with split-KV, chunked as FlashInfer's planner
  chunks it to fill the SMs, merged by its merge-states kernel
  (``flashinfer_baseline.py``).
- a sparse layer's mixture of experts: vLLM's fused MoE, an op of its own
  that Inductor does not trace into (on Hopper its Triton ``fused_moe``
  path). Here: ``mixture``, the same Triton kernels on the GPU
  (``moe_baseline.moe_layer``), the reference's ``moe_mlp`` elsewhere.
- the step replayed from one FULL CUDA graph: here too (the caller
  captures it).

vLLM 0.32 compiles the model piecewise, split at attention: between two
attentions, Inductor fuses the elementwise work around the cuBLAS GEMMs;
the KV append and the paged decode attention are kernels of their own; and
a decode step is replayed from one FULL CUDA graph. Here the pieces are the
same: ``first`` (embedding, layer 0 up to attention), ``middle`` (layer i
after attention, layer i + 1 up to attention: one compiled graph serves
every layer, the weights are arguments), ``last`` (the last layer after
attention, final norm, LM head), each ``torch.compile``d with
``fullgraph=True`` (a graph break would split a fusion), and ``attend``
between them. The caller captures the whole step in one CUDA graph.

The arithmetic is the reference's (``vllm_ext/reference.py``): bf16
activations between ops, fp32 reductions, so both compute one function and
``tests/megakernel/test_per_op_baseline.py`` holds this step to the
reference forward on CPU, compiled and not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vllm_ext.model_spec import ModelSpec
from vllm_ext.paged_kv import write_kv
from vllm_ext.quant import BLOCK, FP8_BLOCK, FP8_W8A8, INT4_W4A16, PackedInt4
from vllm_ext.reference import decode_attention, moe_mlp
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import QUANT_LINEARS, DecodeWeights, LayerWeights

# attend(layer, q, k, v): append k, v [B, kv heads, d] to the layer's paged
# cache, return the attention of q [B, q heads, d] as [B, q heads * d].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# mixture(layer, x): a sparse layer's mixture of experts on its normed input
# x [B, hidden] -> [B, hidden], both in the model dtype.
Mixture = Callable[[int, torch.Tensor], torch.Tensor]


# What the GPU check names the per-op step of a quantized model (its linears
# by PyTorch's quantized GEMMs): none is vLLM's kernel, so none is
# measured.FAIR_BASELINE.
FP8_BASELINE = "per-op-fp8-scaled-mm"
FP8_BLOCK_BASELINE = "per-op-fp8-blockwise-scaled-mm"
INT4_BASELINE = "per-op-int4-tinygemm"
QUANT_BASELINES = {FP8_W8A8: FP8_BASELINE, FP8_BLOCK: FP8_BLOCK_BASELINE,
                   INT4_W4A16: INT4_BASELINE}  # fmt: skip
# tinygemm's k tiles a packed row is laid out in (torchao's default): K a
# multiple of 16 times it.
INT4_INNER_K_TILES = 8
# A linear layer's weight as the pieces take it: a tensor in the model dtype
# (``F.linear``), or a quantized layer's pair: FP8's (e4m3 codes [N, K],
# fp32 scales: [N] a row, ``fp8_linear``; [N / 128, K / 128] a block,
# ``fp8_block_linear``), INT4's tinygemm operands (``int4_operand``).
# Tensors, not an ``Fp8Weight``: the compiled pieces take the weights as
# arguments, so one graph serves every layer.
Weight = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] quantized per token to e4m3 as vLLM's dynamic ``QuantFP8``
    does in torch: (codes [M, K], fp32 scales [M, 1]), each row's scale its
    amax / 448, at least 1 / (448 * 512), the row times its reciprocal. The
    codes times the scales are ``quant.quantize_input``'s, bit for bit."""
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / top).clamp(min=1.0 / (top * 512.0))
    codes = (x.float() * scale.reciprocal()).clamp(-top, top).to(fp8)
    return codes, scale


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """An FP8 W8A8 linear on ``x`` [M, K] (model dtype) as a GPU runs it:
    ``x`` quantized per token, then one FP8 GEMM of the codes, both scales
    applied to its fp32 sums (``scale_a`` a row's, ``scale_b`` a column's),
    out in ``x``'s dtype. Fast accumulation, as vLLM's sm90 CUTLASS
    schedules (``...FP8FastAccum``) sum."""
    q, s = quantize_per_token(x)
    return torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale.view(1, -1),
                            bias=bias, out_dtype=x.dtype,
                            use_fast_accum=True)  # fmt: skip


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (K whole groups) quantized per token in groups of 128 as
    vLLM's ``per_token_group_quant_fp8``: (codes [M, K], fp32 scales [M, K /
    128]), each group's scale its amax / 448, at least 1 / (448 * 512), the
    group divided by it. The codes times the scales are
    ``quant.quantize_input``'s, bit for bit."""
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max
    groups = x.view(x.shape[0], -1, BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / top).clamp(min=1.0 / (top * 512.0))
    codes = (groups / scale).clamp(-top, top).to(fp8)
    return codes.view(x.shape), scale[..., 0]


def fp8_block_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """An FP8-block linear on ``x`` [M, K] (model dtype) as a GPU runs it:
    ``x`` quantized per token in groups of 128, then one blockwise-scaled
    FP8 GEMM (each K block's fp32 sums times the token group's and the
    weight block's scales; cuBLASLt's layouts: the groups' scales outer-dim
    major, the weight's ``[N / 128, K / 128]`` transposed), out in ``x``'s
    dtype."""
    q, s = quantize_per_token_group(x)
    y = F.scaled_mm(q, codes.t(), s.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                    scale.t(), F.ScalingType.BlockWise128x128,
                    output_dtype=x.dtype)  # fmt: skip
    return y if bias is None else y + bias


def int4_operand(w: PackedInt4) -> tuple[torch.Tensor, torch.Tensor]:
    """tinygemm's operands of an INT4 layer's weight: its codes (the value
    plus 8) packed by torch (on a GPU from bytes of two, the even code in the
    high nibble; on a CPU, from the codes), and its scales beside zero
    offsets, ``[K / group, N, 2]`` in the model dtype. Packed once, at
    set-up: tinygemm's weight is then ``(q - 8) * s``, Marlin's."""
    u = w.unpacked()
    q, s = u.codes, u.scales
    if q.is_cuda:
        pairs = (q[:, 0::2] << 4 | q[:, 1::2]).contiguous()
        packed = torch._convert_weight_to_int4pack(pairs, INT4_INNER_K_TILES)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32), INT4_INNER_K_TILES
        )
    scales_zeros = torch.stack([s, torch.zeros_like(s)], -1).transpose(0, 1)
    return packed, scales_zeros.contiguous()


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """An INT4 W4A16 linear by tinygemm on ``int4_operand``'s operands (its
    CPU kernel here), out in ``x``'s dtype."""
    group = x.shape[-1] // scales_zeros.shape[0]
    mm = torch._weight_int4pack_mm if x.is_cuda else torch._weight_int4pack_mm_for_cpu
    y = mm(x, packed, group, scales_zeros)
    return y if bias is None else y + bias


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None):
    """``F.linear``, or a quantized layer's pair by its format's GEMM."""
    if not isinstance(w, tuple):
        return F.linear(x, w, bias)
    if w[0].dtype != torch.float8_e4m3fn:
        return int4_linear(x, *w, bias)
    if w[1].dim() == 2:
        return fp8_block_linear(x, *w, bias)
    return fp8_linear(x, *w, bias)


def operand(lw: LayerWeights, name: str) -> Weight:
    """Layer ``lw``'s linear weight ``name`` as its GEMM reads it: an FP8
    layer's (codes, scale), an INT4 layer's tinygemm operands (packed here:
    once per layer at set-up, ``operands``), else the dense tensor."""
    f = getattr(lw.quant, name, None) if name in QUANT_LINEARS else None
    if isinstance(f, PackedInt4):
        return int4_operand(f)
    if f is not None:
        return f.codes, f.scale
    return getattr(lw, name)


def operands(weights: DecodeWeights) -> Callable[[int, str], Weight | None]:
    """``weight(i, name)``: layer i's ``operand`` ``name`` (a linear's),
    each taken once."""
    taken = [{n: operand(lw, n) for n in QUANT_LINEARS} for lw in weights.layers]
    return lambda i, name: taken[i][name]


def reference_mixture(spec: ModelSpec, weights: DecodeWeights) -> Mixture:
    """The reference's mixture (any device; on the GPU the check passes
    vLLM's fused-MoE Triton path instead: ``moe_baseline.moe_layer``)."""

    def mixture(layer: int, x: torch.Tensor) -> torch.Tensor:
        moe_weights = weights.layers[layer].moe
        assert spec.moe is not None and moe_weights is not None
        return moe_mlp(x, moe_weights, spec.moe)

    return mixture


def paged_attend(weights: DecodeWeights, inputs: DecodeInputs) -> Attend:
    """The reference's KV append and paged decode attention (any device;
    on the GPU the check passes ``flashinfer_baseline.flashinfer_attend``
    instead: one append kernel, split-KV paged decode)."""

    def attend(layer: int, q, k, v) -> torch.Tensor:
        cache = inputs.kv_caches[layer]
        write_kv(cache, k, v, inputs.slot_mapping)
        o = decode_attention(q, cache, inputs.block_table, inputs.seq_lens,
                             weights.attn_scale)  # fmt: skip
        return o.to(q.dtype).flatten(1)

    return attend


def per_op_step(
    spec: ModelSpec,
    weights: DecodeWeights,
    inputs: DecodeInputs,
    attend: Attend,
    elementwise: bool = True,
    compile_options: dict[str, Any] | None = None,
    mixture: Mixture | None = None,
) -> Callable[[], torch.Tensor]:
    """``step() -> fp32 logits [B, vocab]`` over ``inputs`` (read at each
    call, so their tensors may be rewritten in place between replays).

    A sparse layer's MLP is ``mixture`` (the reference's by default), run
    between compiled pieces as vLLM runs its fused MoE: an op of its own
    that Inductor does not trace into.

    ``compile_options``: ``torch.compile`` keyword arguments for the three
    pieces (``{}`` for Inductor), or None to run them eagerly. With
    ``elementwise=False`` the norms, QK-norm, RoPE and SiLU-mul are left
    out: the GEMMs and attention alone, a floor for any per-op decode (an
    FP8 model's per-token quantization stays: its GEMMs' operand).

    A quantized model (``spec.quant``: FP8 W8A8, FP8 blocks, INT4) runs its
    linears by its format's GEMM (``linear``) on its layers' codes and scales
    (``LayerWeights.quant``; the dense fields, their dequantization, are not
    read)."""
    _check_quant(spec, weights)
    weight = operands(weights)
    dt, eps, d = spec.dtype, spec.rms_norm_eps, spec.head_dim
    nq, nkv, inter = spec.num_q_heads, spec.num_kv_heads, spec.intermediate_size

    def norm(x, w):
        if not elementwise:
            return x
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                * w.float()).to(dt)  # fmt: skip

    def rope(x, cos, sin):
        if not elementwise:
            return x
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(dt)

    def pre_attn(h, residual, positions, cos_sin, input_norm, qkv_w, qkv_b,
                 q_norm, k_norm):  # fmt: skip
        residual = h if residual is None else h + residual
        qkv = linear(norm(residual, input_norm), qkv_w, qkv_b)
        q, k, v = qkv.view(-1, nq + 2 * nkv, d).split([nq, nkv, nkv], 1)
        if q_norm is not None:
            q, k = norm(q, q_norm), norm(k, k_norm)
        cos, sin = cos_sin[positions].chunk(2, -1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return rope(q, cos, sin), rope(k, cos, sin), v, residual

    post_attn = dense_mlp(norm, inter, dt, elementwise)
    if mixture is None and spec.moe is not None:
        mixture = reference_mixture(spec, weights)

    def pre(i: int) -> tuple:
        lw = weights.layers[i]
        return (lw.input_norm, weight(i, "qkv"), lw.qkv_bias, lw.q_norm,
                lw.k_norm)  # fmt: skip

    return piecewise_step(weights, inputs, attend, pre_attn, post_attn, norm, pre,
                          compile_options, mixture, weight)  # fmt: skip


def _check_quant(spec: ModelSpec, weights: DecodeWeights) -> None:
    """A quantized model's step needs its codes and scales in every layer
    (``random_weights`` of its spec), and dense layers."""
    if spec.quant is None:
        return
    if spec.quant.name not in QUANT_BASELINES:
        raise ValueError(f"per-op step: no {spec.quant.name} linears")
    if spec.moe is not None or any(lw.quant is None for lw in weights.layers):
        raise ValueError(f"per-op step: a {spec.quant.name} model's dense "
                         "layers need their codes and scales "
                         "(LayerWeights.quant)")  # fmt: skip


def dense_mlp(norm: Callable, inter: int, dt: torch.dtype, elementwise: bool = True):
    """``post_attn(o, residual, o_w, post_norm, gate_up_w, down_w) -> (mlp
    output, residual)``: o_proj and the residual add, the post-attention
    norm, gate/up, SiLU-mul (left out without ``elementwise``), down. Each
    weight a ``Weight``: a tensor, or an FP8 layer's (codes, scale)."""

    def post_attn(o, residual, o_w, post_norm, gate_up_w, down_w):
        residual = linear(o, o_w) + residual
        gate, up = linear(norm(residual, post_norm), gate_up_w).split(inter, -1)
        act = (F.silu(gate.float()) * up.float()).to(dt) if elementwise else gate
        return linear(act, down_w), residual

    return post_attn


def piecewise_step(
    weights: DecodeWeights,
    inputs: DecodeInputs,
    attend: Callable,
    pre_attn: Callable,
    post_attn: Callable,
    norm: Callable,
    pre: Callable[[int], tuple],
    compile_options: dict[str, Any] | None,
    mixture: Mixture | None,
    weight: Callable[[int, str], Weight | None] | None = None,
) -> Callable[[], torch.Tensor]:
    """The step of pieces split at attention (module docstring), for any
    attention: ``pre_attn(h, residual, positions, cos_sin, *pre(i))``
    returns layer i's attention inputs then the residual, ``attend(i,
    *inputs)`` o_proj's input, ``post_attn`` as ``dense_mlp``'s; a sparse
    layer's MLP is ``mixture``, between compiled pieces. ``weight(i,
    name)``: layer i's o_proj, gate_up and down (``operands``; by default
    the layers' dense weights)."""
    layers = weights.layers
    if weight is None:

        def weight(i: int, name: str) -> Weight | None:
            return getattr(layers[i], name)

    def first(ids, positions, cos_sin, embed, *pre_w):
        return pre_attn(embed[ids], None, positions, cos_sin, *pre_w)

    def middle(o, residual, positions, cos_sin, *weights_):
        h, residual = post_attn(o, residual, *weights_[:4])
        return pre_attn(h, residual, positions, cos_sin, *weights_[4:])

    def final(h, residual, final_norm, lm_head):
        return F.linear(norm(h + residual, final_norm), lm_head).float()

    def last(o, residual, final_norm, lm_head, *post_w):
        h, residual = post_attn(o, residual, *post_w)
        return final(h, residual, final_norm, lm_head)

    # A sparse layer: up to the mixture's input, then from its output.
    def moe_in(o, residual, o_w, post_norm):
        residual = linear(o, o_w) + residual
        return norm(residual, post_norm), residual

    def moe_out(y, residual, positions, cos_sin, *pre_w):
        return pre_attn(y, residual, positions, cos_sin, *pre_w)

    if compile_options is not None:
        options = {"fullgraph": True, "dynamic": False, **compile_options}
        first, middle, last, final, moe_in, moe_out = (
            torch.compile(f, **options)
            for f in (first, middle, last, final, moe_in, moe_out)
        )

    def post(i: int) -> tuple:
        return (weight(i, "o_proj"), layers[i].post_norm, weight(i, "gate_up"),
                weight(i, "down"))  # fmt: skip

    def step() -> torch.Tensor:
        ids, pos, cos_sin = inputs.input_ids, inputs.positions.long(), weights.cos_sin
        *q, residual = first(ids, pos, cos_sin, weights.embed, *pre(0))
        for i, lw in enumerate(layers):
            o = attend(i, *q)
            nxt = i + 1 if i + 1 < len(layers) else None
            if lw.moe is None and nxt is None:
                return last(o, residual, weights.final_norm, weights.lm_head,
                            *post(i))  # fmt: skip
            if lw.moe is None:
                *q, residual = middle(o, residual, pos, cos_sin, *post(i), *pre(nxt))
                continue
            assert mixture is not None
            x, residual = moe_in(o, residual, weight(i, "o_proj"), lw.post_norm)
            y = mixture(i, x)
            if nxt is None:
                return final(y, residual, weights.final_norm, weights.lm_head)
            *q, residual = moe_out(y, residual, pos, cos_sin, *pre(nxt))
        raise AssertionError("unreachable: the last layer returns")

    return step

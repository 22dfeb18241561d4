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
from vllm_ext.quant import FP8_W8A8
from vllm_ext.reference import decode_attention, moe_mlp
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import QUANT_LINEARS, DecodeWeights, LayerWeights

# attend(layer, q, k, v): append k, v [B, kv heads, d] to the layer's paged
# cache, return the attention of q [B, q heads, d] as [B, q heads * d].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# mixture(layer, x): a sparse layer's mixture of experts on its normed input
# x [B, hidden] -> [B, hidden], both in the model dtype.
Mixture = Callable[[int, torch.Tensor], torch.Tensor]


# What the GPU check names the per-op step of an FP8 W8A8 model (its linears
# by ``fp8_linear``): not vLLM's CUTLASS GEMM, so not measured.FAIR_BASELINE.
FP8_BASELINE = "per-op-fp8-scaled-mm"
# A linear layer's weight as the pieces take it: a tensor in the model dtype
# (``F.linear``), or an FP8 layer's (e4m3 codes [N, K], fp32 row scales [N])
# pair (``fp8_linear``). Tensors, not an ``Fp8Weight``: the compiled pieces
# take the weights as arguments, so one graph serves every layer.
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


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None):
    """``F.linear``, or ``fp8_linear`` for an FP8 layer's (codes, scale)."""
    if isinstance(w, tuple):
        return fp8_linear(x, *w, bias)
    return F.linear(x, w, bias)


def operand(lw: LayerWeights, name: str) -> Weight:
    """Layer ``lw``'s linear weight ``name`` as its GEMM reads it: an FP8
    layer's (codes, scale), else the dense tensor."""
    if lw.quant is not None and name in QUANT_LINEARS:
        f = getattr(lw.quant, name)
        return f.codes, f.scale
    return getattr(lw, name)


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

    An FP8 W8A8 model (``spec.quant``) runs its linears by ``fp8_linear``
    on its layers' codes and scales (``LayerWeights.quant``; the dense fields,
    their dequantization, are not read)."""
    _check_fp8(spec, weights)
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
        return (lw.input_norm, operand(lw, "qkv"), lw.qkv_bias, lw.q_norm,
                lw.k_norm)  # fmt: skip

    return piecewise_step(weights, inputs, attend, pre_attn, post_attn, norm, pre,
                          compile_options, mixture)  # fmt: skip


def _check_fp8(spec: ModelSpec, weights: DecodeWeights) -> None:
    """A quantized model's step needs FP8 W8A8 codes and scales in every
    layer (``random_weights`` of its spec), and dense layers."""
    if spec.quant is None:
        return
    if spec.quant.name != FP8_W8A8:
        raise ValueError(f"per-op step: no {spec.quant.name} linears (FP8 W8A8's only)")
    if spec.moe is not None or any(lw.quant is None for lw in weights.layers):
        raise ValueError("per-op step: an FP8 W8A8 model's dense layers need "
                         "their codes and scales (LayerWeights.quant)")  # fmt: skip


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
) -> Callable[[], torch.Tensor]:
    """The step of pieces split at attention (module docstring), for any
    attention: ``pre_attn(h, residual, positions, cos_sin, *pre(i))``
    returns layer i's attention inputs then the residual, ``attend(i,
    *inputs)`` o_proj's input, ``post_attn`` as ``dense_mlp``'s; a sparse
    layer's MLP is ``mixture``, between compiled pieces."""

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

    def post(lw: LayerWeights) -> tuple:
        return (operand(lw, "o_proj"), lw.post_norm, operand(lw, "gate_up"),
                operand(lw, "down"))  # fmt: skip

    layers = weights.layers

    def step() -> torch.Tensor:
        ids, pos, cos_sin = inputs.input_ids, inputs.positions.long(), weights.cos_sin
        *q, residual = first(ids, pos, cos_sin, weights.embed, *pre(0))
        for i, lw in enumerate(layers):
            o = attend(i, *q)
            nxt = i + 1 if i + 1 < len(layers) else None
            if lw.moe is None and nxt is None:
                return last(o, residual, weights.final_norm, weights.lm_head,
                            *post(lw))  # fmt: skip
            if lw.moe is None:
                *q, residual = middle(o, residual, pos, cos_sin, *post(lw), *pre(nxt))
                continue
            assert mixture is not None
            x, residual = moe_in(o, residual, operand(lw, "o_proj"), lw.post_norm)
            y = mixture(i, x)
            if nxt is None:
                return final(y, residual, weights.final_norm, weights.lm_head)
            *q, residual = moe_out(y, residual, pos, cos_sin, *pre(nxt))
        raise AssertionError("unreachable: the last layer returns")

    return step

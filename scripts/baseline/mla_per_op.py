# SPDX-License-Identifier: Apache-2.0
"""The per-op decode step of a multi-head latent attention model
(DeepSeek-V3, Kimi-K2) that the GPU check times the megakernel's MLA cases
against: what vLLM's default runs, kernel by kernel, in PyTorch.

What vLLM 0.32.0 runs for such a layer at decode on an H200 (design.md,
"Multi-head latent attention"), and the stand-in for each part:

- the fused q_a/kv_a GEMM, q_b (or q_proj), o_proj, the dense MLP's GEMMs,
  the LM head: cuBLAS through ``F.linear``, here too;
- the norms (input, q_a_layernorm, kv_a_layernorm, post), GPT-J RoPE on
  q_pe and k_pe, SiLU-mul: Inductor-fused pieces between the attention
  ops, here the same pieces under ``torch.compile`` (as per_op.py's);
- inside the MLA attention op: ``q_nope @ W_UK`` and ``@ W_UV`` as cuBLAS
  batched GEMMs over vLLM's contiguous ``W_UK_T``/``W_UV`` copies (here
  ``torch.bmm`` over such copies), the cache write
  (``concat_and_cache_mla``; here one ``index_copy_``), and the decode
  attention FLASH_ATTN_MLA (FlashAttention 3's MLA kernel, split-KV).
  That kernel lives in vLLM's build and cannot travel to the GPU machine
  (no vLLM there). The attention here (``absorbed_attend``'s) is
  FlashInfer's MLA paged decode, vLLM's FLASHINFER_MLA kernel, where the
  bundle carries it (``flashinfer_mla.py``, built here) and it agrees with
  the torch reference on the GPU; else the absorbed MLA in torch ops
  (``torch_mla_attend``): each request's latent rows gathered through its
  block table to the table's full width (masked past its length: fixed
  shapes, so the step can be captured in a CUDA graph), the scores as two
  fp32 matmuls, fp32 softmax, the latent output a matmul. That moves more
  bytes than a fused kernel (the gathered, widened rows); at batch 1 a
  layer's attention weights (374 MB for DeepSeek-V3) dwarf its latent rows
  (4.7 MB at 4096 tokens), so the step's time is the GEMMs' either way, and
  the report says which attention was timed;
- a sparse layer's mixture: ``mixture`` (vLLM's fused-MoE Triton path on
  the GPU, ``moe_baseline.moe_layer``; the reference's elsewhere);
- the step replayed from one CUDA graph (the caller captures it).

The arithmetic and rounding points are ``reference.mla_attention``'s, so
``tests/megakernel/test_device_mla.py`` holds this step to the reference
forward on CPU, compiled and not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_ext.model_spec import ModelSpec
from vllm_ext.reference import rope_gptj
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights

sys.path.insert(0, str(Path(__file__).resolve().parent))

from per_op import Mixture, dense_mlp, piecewise_step, reference_mixture  # noqa: E402

# attend(layer, q_nope [B, heads, nope], q_pe [B, heads, rope] rotated,
# kv_c [B, rank] normed, k_pe [B, rope] rotated) -> o_proj's input
# [B, heads * v_head_dim]: the new latent row written, the attention read.
MlaAttend = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
# What the report names as the per-op step's attention.
ATTENTION = "torch-absorbed-mla"


# attention(layer, q_latent [B, heads, rank], q_pe [B, heads, rope], cache)
# -> the latent output [B, heads, rank] in the model dtype (the new rows
# already in the cache).
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def absorbed_attend(
    spec: ModelSpec, weights: DecodeWeights, inputs: DecodeInputs, attention: Attention
) -> MlaAttend:
    """vLLM's MLA attention op around ``attention``: ``q_nope @ W_UK``, the
    new latent rows written at the slot mapping (one ``index_copy_``: every
    row of ``inputs`` must have a slot), the attention, ``@ W_UV``."""
    mla = spec.mla
    assert mla is not None
    heads, nope = mla.num_heads, mla.qk_nope_head_dim
    # vLLM's process_weights_after_loading: W_UK_T and W_UV, contiguous.
    w_uk = [lw.mla.w_uk(heads, nope).contiguous() for lw in weights.layers]
    w_uv_t = [
        lw.mla.w_uv(heads, nope).transpose(1, 2).contiguous() for lw in weights.layers
    ]

    def attend(layer: int, q_nope, q_pe, kv_c, k_pe) -> torch.Tensor:
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk[layer]).transpose(0, 1)
        cache = inputs.kv_caches[layer]
        rows = torch.cat((kv_c, k_pe), -1).to(cache.dtype)
        cache.view(-1, cache.shape[-1]).index_copy_(0, inputs.slot_mapping.long(), rows)
        o_lat = attention(layer, q_lat, q_pe, cache)
        o = torch.bmm(o_lat.transpose(0, 1), w_uv_t[layer]).transpose(0, 1)
        return o.reshape(q_nope.shape[0], -1)

    return attend


def torch_mla_attend(
    spec: ModelSpec, weights: DecodeWeights, inputs: DecodeInputs
) -> MlaAttend:
    """vLLM's MLA attention op with the attention in torch ops (module
    docstring): each request's rows gathered to the block table's width,
    masked past its length. Every row of ``inputs`` must be a real request
    (a row attending to nothing would be NaN; the timing and the tests have
    none)."""
    rank = spec.mla.kv_lora_rank
    table = inputs.block_table
    block_size = inputs.kv_caches[0].shape[1]
    pos = torch.arange(table.shape[1] * block_size, device=table.device)

    def attention(layer: int, q_lat, q_pe, cache) -> torch.Tensor:
        latent = cache[table.long()].flatten(1, 2).float()  # [B, T, rank + rope]
        scores = q_lat.float() @ latent[..., :rank].transpose(1, 2)
        scores = scores + q_pe.float() @ latent[..., rank:].transpose(1, 2)
        past = pos[None, :] >= inputs.seq_lens[:, None]  # [B, T]
        scores = (scores * weights.attn_scale).masked_fill(past[:, None], float("-inf"))
        return (scores.softmax(-1) @ latent[..., :rank]).to(q_lat.dtype)

    return absorbed_attend(spec, weights, inputs, attention)


def mla_per_op_step(
    spec: ModelSpec,
    weights: DecodeWeights,
    inputs: DecodeInputs,
    attend: MlaAttend,
    compile_options: dict[str, Any] | None = None,
    mixture: Mixture | None = None,
) -> Callable[[], torch.Tensor]:
    """``step() -> fp32 logits [B, vocab]`` over ``inputs`` (read at each
    call). Pieces as per_op.py's: ``first`` (embedding, layer 0 up to the
    attention), ``middle`` (a dense layer after the attention, the next up
    to it: one graph for every layer, the weights arguments), ``last``,
    and around a sparse layer's ``mixture`` ``moe_in``/``moe_out``/
    ``final``; ``compile_options`` as per_op_step's (``per_op.piecewise_step``)."""
    mla = spec.mla
    assert mla is not None
    dt, eps, heads = spec.dtype, spec.rms_norm_eps, mla.num_heads
    lora, rank = mla.q_lora_rank or 0, mla.kv_lora_rank
    split = [mla.qk_nope_head_dim, mla.qk_rope_head_dim]

    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                * w.float()).to(dt)  # fmt: skip

    def pre_attn(h, residual, positions, cos_sin, input_norm, qkv_a_w, q_a_norm,
                 q_b, kv_a_norm):  # fmt: skip
        residual = h if residual is None else h + residual
        x = norm(residual, input_norm)
        kv = F.linear(x, qkv_a_w)  # vLLM's fused q_a/kv_a GEMM
        if lora:
            q_c, kv = kv.split([lora, kv.shape[-1] - lora], -1)
            x = norm(q_c, q_a_norm)
        q_nope, q_pe = F.linear(x, q_b).view(-1, heads, sum(split)).split(split, -1)
        cos, sin = cos_sin[positions].chunk(2, -1)
        kv_c = norm(kv[:, :rank], kv_a_norm)
        k_pe = rope_gptj(kv[:, None, rank:], cos, sin)[:, 0]
        return q_nope, rope_gptj(q_pe, cos, sin), kv_c, k_pe, residual

    # vLLM's fused_qkv_a_proj: one [q_a; kv_a] weight (kv_a alone without a
    # q LoRA).
    fused = [
        lw.mla.kv_a if lw.mla.q_a is None else torch.cat((lw.mla.q_a, lw.mla.kv_a))
        for lw in weights.layers
    ]

    def pre(i: int) -> tuple:
        lw = weights.layers[i]
        return (lw.input_norm, fused[i], lw.mla.q_a_norm, lw.mla.q_b, lw.mla.kv_a_norm)

    if mixture is None and spec.moe is not None:
        mixture = reference_mixture(spec, weights)
    return piecewise_step(weights, inputs, attend, pre_attn,
                          dense_mlp(norm, spec.intermediate_size, dt), norm, pre,
                          compile_options, mixture)  # fmt: skip


def attention_only(
    spec: ModelSpec, inputs: DecodeInputs, attend: MlaAttend, seed: int = 0
) -> Callable[[], torch.Tensor]:
    """Every layer's attention op alone (W_UK, the cache write, the
    attention, W_UV) on fixed random queries and rows: the per-op
    attention's time, beside the kernel's MLA_ATTN + MLA_COMBINE rows."""
    mla, b = spec.mla, inputs.batch_size
    assert mla is not None
    dev = inputs.block_table.device
    gen = torch.Generator(dev).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=spec.dtype)

    q_nope = rand(b, mla.num_heads, mla.qk_nope_head_dim)
    q_pe = rand(b, mla.num_heads, mla.qk_rope_head_dim)
    kv_c, k_pe = rand(b, mla.kv_lora_rank), rand(b, mla.qk_rope_head_dim)

    def run() -> torch.Tensor:
        outs = [attend(i, q_nope, q_pe, kv_c, k_pe) for i in range(spec.num_layers)]
        return outs[-1]

    return run

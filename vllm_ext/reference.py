# SPDX-License-Identifier: Apache-2.0
"""The reference executor: one decode step in plain PyTorch.

It is what ``VLLM_MEGAKERNEL_INTERPRET=1`` runs, and the arithmetic the GPU
kernel must reproduce: weights in the model dtype, every reduction (matmul,
norm, softmax) in fp32, activations rounded to the model dtype where one
kernel instruction hands them to the next (the same points where vLLM's
layers round them), KV read and written through ``paged_kv``.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) runs in the absorbed
form vLLM's MLA backends use for decode (``mla_attention``).
"""

from __future__ import annotations

import torch

from vllm_ext.model_spec import MlaSpec, ModelSpec, MoeSpec
from vllm_ext.moe import route
from vllm_ext.paged_kv import gather_kv, gather_latent, write_kv, write_latent
from vllm_ext.quant import QuantFormat, quantize_input
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights, LayerWeights, MoeWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm, returned in fp32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * weight.float()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` accumulated in fp32, returned in fp32."""
    out = x.float() @ weight.float().t()
    return out if bias is None else out + bias.float()


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary embedding of ``x`` ``[B, heads, d]``; cos/sin ``[B, d/2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved) rotary embedding of ``x`` ``[B, heads, d]`` (model
    dtype): the pair (2i, 2i + 1) turns by frequency i; cos/sin ``[B, d/2]``.
    Rounded as vLLM's DeepSeek YaRN rope rounds (``forward_native`` on a CPU,
    the same arithmetic as its CUDA kernel): cos/sin in ``x``'s dtype, each
    product rounded to it, then their sum. Returned in ``x``'s dtype."""
    dtype = x.dtype
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def swiglu_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    quant: QuantFormat | None = None,
) -> torch.Tensor:
    """A SiLU-gated MLP on ``x`` (model dtype): gate/up and SiLU-mul rounded
    to the model dtype, the down projection returned in fp32. ``quant``:
    the checkpoint's, whose projections may quantize their inputs."""
    dtype = x.dtype
    gate, up = linear(quantize_input(x, quant), gate_up).to(dtype).chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    return linear(quantize_input(act, quant), down)


def moe_mlp(
    x: torch.Tensor, w: MoeWeights, moe: MoeSpec, quant: QuantFormat | None = None
) -> torch.Tensor:
    """A sparse layer's mixture on ``x`` ``[B, hidden]`` (normed, model
    dtype) -> ``[B, hidden]`` in the model dtype. Router logits rounded to
    the model dtype (what vLLM's ``GateLinear`` returns in its generic path,
    the one the CPU takes; on Hopper its small-batch tiers return fp32, to
    be matched when the kernel is held to vLLM on a GPU); routing as
    ``moe.route``; each expert as the dense MLP; the weighted sum of the
    experts (ascending) and any shared expert accumulated in fp32 and
    rounded once."""
    dtype = x.dtype
    weights, ids = route(linear(x, w.router).to(dtype), moe, w.correction_bias)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        y = swiglu_mlp(x[rows], w.w13[expert], w.w2[expert], quant)
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if w.shared_gate_up is not None:
        assert w.shared_down is not None
        out += swiglu_mlp(x, w.shared_gate_up, w.shared_down, quant)
    return out.to(dtype)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request over its whole cached sequence, fp32.

    ``q`` ``[B, q_heads, d]`` -> ``[B, q_heads, d]`` fp32.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    out = torch.empty(
        batch, num_q_heads, head_dim, dtype=torch.float32, device=q.device
    )
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_kv(kv_cache, block_table[i], seq_len)  # [S, kvh, d]
        qi = q[i].float().view(num_kv_heads, -1, head_dim)  # [kvh, group, d]
        scores = torch.einsum("hgd,shd->hgs", qi, k.float()) * scale
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hgs,shd->hgd", probs, v.float()).reshape(
            num_q_heads, head_dim
        )
    return out


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: every head of each request's one query over the
    latent rows of its whole sequence, fp32. ``q_latent`` ``[B, heads,
    kv_lora_rank]``, ``q_pe`` ``[B, heads, rope_dim]`` -> the latent output
    ``[B, heads, kv_lora_rank]`` fp32 (values are the ``kv_c`` part of the
    rows: vLLM's MQA over a 576-wide key, 512-wide value)."""
    rank = q_latent.shape[-1]
    out = torch.empty(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        rows = gather_latent(cache, block_table[i], seq_len).float()  # [S, L + R]
        kv_c, k_pe = rows[:, :rank], rows[:, rank:]
        scores = q_latent[i].float() @ kv_c.t() + q_pe[i].float() @ k_pe.t()
        probs = torch.softmax(scores * scale, dim=-1)  # [heads, S]
        out[i] = probs @ kv_c
    return out


def mla_attention(
    x: torch.Tensor,
    layer: LayerWeights,
    mla: MlaSpec,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    inputs: DecodeInputs,
    scale: float,
    eps: float,
    quant: QuantFormat | None = None,
) -> torch.Tensor:
    """A layer's multi-head latent attention on ``x`` ``[B, hidden]``
    (normed, model dtype) -> the o_proj output in the model dtype, the new
    tokens' latent rows appended to ``cache`` at the slot mapping.

    Absorbed as vLLM's MLA decode (``MLAAttention.forward_impl``): the query
    is taken into the latent space per head (``q_nope @ W_UK``), attention
    runs over the cached ``[kv_c | k_pe]`` rows, the latent output is taken
    out per head (``@ W_UV``), then o_proj. Rounded to the model dtype where
    vLLM's layers hand a tensor on: q_a / kv_a projections (vLLM's fused
    q_a + kv_a GEMM output), q_a_layernorm, kv_a_layernorm, q_b (or q_proj),
    the rotated q_pe and k_pe (``rope_gptj``: each product rounded, as vLLM),
    q_nope @ W_UK, the cache row, the attention's latent output, @ W_UV,
    o_proj; each GEMM accumulated in fp32, scores and softmax in fp32.

    In bf16 the rows it appends in the first layer equal those vLLM's CPU
    prefill writes bit for bit once ``rms_norm`` rounds as vLLM's RMSNorm
    does (the normalised x rounded before the weight multiply); with this
    module's ``rms_norm`` (one rounding) about a quarter of them differ by
    one bf16 step.

    ``quant``: the checkpoint's; FP8 blocks quantize the inputs of q_a,
    kv_a, q_b (q_proj) and o_proj as they enter. kv_b is not a GEMM of
    the decode: vLLM dequantizes it once into W_UK / W_UV (weights.py)."""
    dtype, batch = x.dtype, x.shape[0]
    w = layer.mla
    assert w is not None
    heads, nope, rank = mla.num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank
    xq = quantize_input(x, quant)
    q_in = xq
    if w.q_a is not None:
        q_c = linear(xq, w.q_a).to(dtype)
        q_in = quantize_input(rms_norm(q_c, w.q_a_norm, eps).to(dtype), quant)
    q = linear(q_in, w.q_b).to(dtype).view(batch, heads, mla.qk_head_dim)
    q_nope, q_pe = q.split([nope, mla.qk_rope_head_dim], dim=-1)
    kv = linear(xq, w.kv_a).to(dtype)
    kv_c = rms_norm(kv[:, :rank], w.kv_a_norm, eps).to(dtype)
    k_pe = rope_gptj(kv[:, None, rank:], cos, sin)[:, 0]
    q_pe = rope_gptj(q_pe, cos, sin)
    w_uk = w.w_uk(heads, nope).float()  # [heads, nope, rank]
    q_latent = torch.einsum("bhp,hpl->bhl", q_nope.float(), w_uk).to(dtype)
    write_latent(cache, kv_c, k_pe, inputs.slot_mapping)
    o_latent = mla_decode_attention(
        q_latent, q_pe, cache, inputs.block_table, inputs.seq_lens, scale
    ).to(dtype)
    w_uv = w.w_uv(heads, nope).float()  # [heads, v_head_dim, rank]
    o = torch.einsum("bhl,hvl->bhv", o_latent.float(), w_uv).to(dtype)
    return linear(quantize_input(o.reshape(batch, -1), quant), layer.o_proj).to(dtype)


class ReferenceExecutor:
    """Runs a decode step with PyTorch on whatever device the weights are on."""

    def __init__(self, spec: ModelSpec, weights: DecodeWeights) -> None:
        self.spec = spec
        self.weights = weights

    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        spec, w = self.spec, self.weights
        dtype, eps = spec.dtype, spec.rms_norm_eps
        # (MLA: the cos/sin of the rope dims.)
        cos, sin = w.cos_sin[inputs.positions.long()].chunk(2, dim=-1)

        hidden = w.embed[inputs.input_ids.long()].to(dtype)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(w.layers, inputs.kv_caches, strict=True):
            # Attention block: residual add + RMSNorm + attention (KV append
            # included) + O projection.
            residual = hidden if residual is None else (hidden + residual).to(dtype)
            x = rms_norm(residual, layer.input_norm, eps).to(dtype)
            if spec.mla is not None:
                hidden = mla_attention(
                    x, layer, spec.mla, cos, sin, kv_cache, inputs, w.attn_scale,
                    eps, spec.quant,
                )  # fmt: skip
            else:
                hidden = self._attention(x, layer, cos, sin, kv_cache, inputs)
            residual, hidden = self._mlp(layer, hidden, residual)

        assert residual is not None
        residual = (hidden + residual).to(dtype)
        return rms_norm(residual, w.final_norm, eps).to(dtype)

    def _attention(
        self,
        x: torch.Tensor,
        layer: LayerWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        inputs: DecodeInputs,
    ) -> torch.Tensor:
        """Grouped-query attention: QKV (+ bias, QK norm, RoPE, KV append) +
        attention + O projection, in the model dtype."""
        spec = self.spec
        dtype, eps = spec.dtype, spec.rms_norm_eps
        batch, d = inputs.batch_size, spec.head_dim
        qkv = linear(quantize_input(x, spec.quant), layer.qkv, layer.qkv_bias)
        qkv = qkv.to(dtype)
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = q.reshape(batch, spec.num_q_heads, d)
        k = k.reshape(batch, spec.num_kv_heads, d)
        v = v.reshape(batch, spec.num_kv_heads, d)
        if spec.qk_norm:
            q = rms_norm(q, layer.q_norm, eps).to(dtype)
            k = rms_norm(k, layer.k_norm, eps).to(dtype)
        q = rope_neox(q, cos, sin).to(dtype)
        k = rope_neox(k, cos, sin).to(dtype)
        write_kv(kv_cache, k, v, inputs.slot_mapping)
        attn = decode_attention(
            q, kv_cache, inputs.block_table, inputs.seq_lens, self.weights.attn_scale
        ).to(dtype)
        attn = quantize_input(attn.reshape(batch, -1), spec.quant)
        return linear(attn, layer.o_proj).to(dtype)

    def _mlp(
        self, layer: LayerWeights, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLP block: residual add + RMSNorm + gate/up + SiLU-mul + down, or
        the mixture of experts of a sparse layer -> (residual, output)."""
        spec = self.spec
        dtype = spec.dtype
        residual = (hidden + residual).to(dtype)
        x = rms_norm(residual, layer.post_norm, spec.rms_norm_eps).to(dtype)
        if layer.moe is not None:
            assert spec.moe is not None
            return residual, moe_mlp(x, layer.moe, spec.moe, spec.quant)
        mlp = swiglu_mlp(x, layer.gate_up, layer.down, spec.quant)
        return residual, mlp.to(dtype)

# SPDX-License-Identifier: Apache-2.0
"""The reference executor: one decode step in plain PyTorch.

It is what ``VLLM_MEGAKERNEL_INTERPRET=1`` runs, and the arithmetic the GPU
kernel must reproduce: weights in the model dtype, every reduction (matmul,
norm, softmax) in fp32, activations rounded to the model dtype where one
kernel instruction hands them to the next (the same points where vLLM's
layers round them), KV read and written through ``paged_kv``.
"""

from __future__ import annotations

import torch

from vllm_ext.model_spec import ModelSpec, MoeSpec
from vllm_ext.moe import route
from vllm_ext.paged_kv import gather_kv, write_kv
from vllm_ext.runner import DecodeInputs
from vllm_ext.weights import DecodeWeights, MoeWeights


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


def swiglu_mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """A SiLU-gated MLP on ``x`` (model dtype): gate/up and SiLU-mul rounded
    to the model dtype, the down projection returned in fp32."""
    dtype = x.dtype
    gate, up = linear(x, gate_up).to(dtype).chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    return linear(act, down)


def moe_mlp(x: torch.Tensor, w: MoeWeights, moe: MoeSpec) -> torch.Tensor:
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
        y = swiglu_mlp(x[rows], w.w13[expert], w.w2[expert])
        out.index_add_(0, rows, y * weights[rows, slot, None])
    if w.shared_gate_up is not None:
        assert w.shared_down is not None
        out += swiglu_mlp(x, w.shared_gate_up, w.shared_down)
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


class ReferenceExecutor:
    """Runs a decode step with PyTorch on whatever device the weights are on."""

    def __init__(self, spec: ModelSpec, weights: DecodeWeights) -> None:
        self.spec = spec
        self.weights = weights

    def step(self, inputs: DecodeInputs) -> torch.Tensor:
        spec, w = self.spec, self.weights
        dtype, eps = spec.dtype, spec.rms_norm_eps
        batch, d = inputs.batch_size, spec.head_dim
        cos, sin = w.cos_sin[inputs.positions.long()].chunk(2, dim=-1)

        hidden = w.embed[inputs.input_ids.long()].to(dtype)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(w.layers, inputs.kv_caches, strict=True):
            # Attention block: residual add + RMSNorm + QKV (+ bias, QK norm,
            # RoPE, KV append) + attention + O projection.
            residual = hidden if residual is None else (hidden + residual).to(dtype)
            x = rms_norm(residual, layer.input_norm, eps).to(dtype)
            qkv = linear(x, layer.qkv, layer.qkv_bias).to(dtype)
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
                q, kv_cache, inputs.block_table, inputs.seq_lens, w.attn_scale
            ).to(dtype)
            hidden = linear(attn.reshape(batch, -1), layer.o_proj).to(dtype)

            # MLP block: residual add + RMSNorm + gate/up + SiLU-mul + down,
            # or the mixture of experts of a sparse layer.
            residual = (hidden + residual).to(dtype)
            x = rms_norm(residual, layer.post_norm, eps).to(dtype)
            if layer.moe is not None:
                assert spec.moe is not None
                hidden = moe_mlp(x, layer.moe, spec.moe)
            else:
                hidden = swiglu_mlp(x, layer.gate_up, layer.down).to(dtype)

        assert residual is not None
        residual = (hidden + residual).to(dtype)
        return rms_norm(residual, w.final_norm, eps).to(dtype)

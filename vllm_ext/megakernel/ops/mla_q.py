# SPDX-License-Identifier: Apache-2.0
"""MLA_Q: heads [lo, hi)'s query in the latent space. With a q LoRA each tile
recomputes q_a_layernorm from the whole q_a row (B x q_lora_rank: tiny),
then the heads' q_b rows; without one, RMSNorm(h) and the heads' q_proj
rows. The rope part is rotated GPT-J style, the nope part taken into the
latent space through the heads' W_UK (absorbed decode). Rounded where
``reference.mla_attention`` rounds: q_a_layernorm, q_b, the rotated q_pe,
q_nope @ W_UK. FP8 blocks: q_b's (q_proj's) input quantized per token
group as it enters; W_UK is a plain GEMM (vLLM dequantizes kv_b once)."""

import torch

from vllm_ext.quant import quantize_input
from vllm_ext.reference import linear, rms_norm, rope_gptj


def reference(
    qkv_a: torch.Tensor,  # [B, q_lora_rank + latent] (unread without a q LoRA)
    h: torch.Tensor,  # [B, hidden] (read without a q LoRA)
    layer,
    spec,
    lo: int,
    hi: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_latent ``[B, hi - lo, kv_lora_rank]``, q_pe ``[B, hi - lo,
    rope_dim]``), model dtype."""
    mla, w, dtype, eps = spec.mla, layer.mla, spec.dtype, spec.rms_norm_eps
    batch, nope, d = h.shape[0], mla.qk_nope_head_dim, mla.qk_head_dim
    if w.q_a is not None:
        q_in = rms_norm(qkv_a[:, : mla.q_lora_rank], w.q_a_norm, eps).to(dtype)
    else:
        q_in = rms_norm(h, layer.input_norm, eps).to(dtype)
    q_in = quantize_input(q_in, spec.quant)
    q = linear(q_in, w.q_b[lo * d : hi * d]).to(dtype).view(batch, hi - lo, d)
    q_nope, q_pe = q.split([nope, mla.qk_rope_head_dim], dim=-1)
    q_pe = rope_gptj(q_pe, cos, sin)
    w_uk = w.w_uk(mla.num_heads, nope)[lo:hi].float()  # [n, nope, rank]
    q_latent = torch.einsum("bhp,hpl->bhl", q_nope.float(), w_uk).to(dtype)
    return q_latent, q_pe

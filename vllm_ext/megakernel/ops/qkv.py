# SPDX-License-Identifier: Apache-2.0
"""QKV: RMSNorm fused into the QKV projection of fused heads [lo, hi), with
bias, QK-norm and RoPE in the epilogue (the KV append is the caller's
store). Fused head index: q heads, then k heads, then v heads."""

import torch

from vllm_ext.reference import linear, rms_norm, rope_neox


def reference(
    h: torch.Tensor,  # [B, hidden] residual stream entering the layer
    layer,  # weights.LayerWeights
    spec,  # ModelSpec
    lo: int,
    hi: int,
    cos: torch.Tensor,  # [B, head_dim / 2]
    sin: torch.Tensor,
) -> torch.Tensor:
    """[B, hi - lo, head_dim] in the model dtype."""
    d, dtype, eps = spec.head_dim, spec.dtype, spec.rms_norm_eps
    x = rms_norm(h, layer.input_norm, eps).to(dtype)
    rows = slice(lo * d, hi * d)
    bias = None if layer.qkv_bias is None else layer.qkv_bias[rows]
    out = linear(x, layer.qkv[rows], bias).to(dtype)
    out = out.view(h.shape[0], hi - lo, d)
    nq, nkv = spec.num_q_heads, spec.num_kv_heads
    heads = []
    for j, head in enumerate(range(lo, hi)):
        y = out[:, j : j + 1]
        if head < nq + nkv:  # q or k: QK-norm, then RoPE
            if spec.qk_norm:
                norm = layer.q_norm if head < nq else layer.k_norm
                y = rms_norm(y, norm, eps).to(dtype)
            y = rope_neox(y, cos, sin).to(dtype)
        heads.append(y)
    return torch.cat(heads, dim=1)

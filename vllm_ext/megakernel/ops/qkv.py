# SPDX-License-Identifier: Apache-2.0
"""QKV: RMSNorm fused into the QKV projection of fused heads [lo, hi), with
bias, QK-norm and RoPE in the epilogue (the KV append is the caller's
store), or with QK-norm over head parts QK-norm and RoPE left to ATTN
(isa.py; ``finish``). Fused head index: q heads, then k heads, then v
heads."""

import torch

from vllm_ext.quant import quantize_input
from vllm_ext.reference import linear, rms_norm, rope_neox


def finish(y: torch.Tensor, norm: torch.Tensor | None, spec, cos, sin) -> torch.Tensor:
    """QK-norm by ``norm`` (q_norm or k_norm; None: the model has none), then
    NeoX RoPE, of q or k heads ``y`` ``[B, heads, head_dim]``; model dtype."""
    if norm is not None:
        y = rms_norm(y, norm, spec.rms_norm_eps).to(spec.dtype)
    return rope_neox(y, cos, sin).to(spec.dtype)


def reference(
    h: torch.Tensor,  # [B, hidden] residual stream entering the layer
    layer,  # weights.LayerWeights
    spec,  # ModelSpec
    lo: int,
    hi: int,
    cos: torch.Tensor,  # [B, head_dim / 2]
    sin: torch.Tensor,
    qk_in_attn: bool = False,
) -> torch.Tensor:
    """[B, hi - lo, head_dim] in the model dtype; with ``qk_in_attn``
    (``Program.qk_in_attn``) q and k heads as projected, unfinished."""
    d, dtype, eps = spec.head_dim, spec.dtype, spec.rms_norm_eps
    x = rms_norm(h, layer.input_norm, eps).to(dtype)
    rows = slice(lo * d, hi * d)
    bias = None if layer.qkv_bias is None else layer.qkv_bias[rows]
    out = linear(quantize_input(x, spec.quant), layer.qkv[rows], bias).to(dtype)
    out = out.view(h.shape[0], hi - lo, d)
    nq, nkv = spec.num_q_heads, spec.num_kv_heads
    heads = []
    for j, head in enumerate(range(lo, hi)):
        y = out[:, j : j + 1]
        if head < nq + nkv and not qk_in_attn:  # q or k: QK-norm, then RoPE
            norm = None
            if spec.qk_norm:
                norm = layer.q_norm if head < nq else layer.k_norm
            y = finish(y, norm, spec, cos, sin)
        heads.append(y)
    return torch.cat(heads, dim=1)

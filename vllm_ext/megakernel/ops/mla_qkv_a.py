# SPDX-License-Identifier: Apache-2.0
"""MLA_QKV_A: RMSNorm fused into the query/latent-KV down projection, output
columns [lo, hi) of ``[q_a | kv_a_proj_with_mqa]`` (vLLM's one fused GEMM;
kv_a alone without a q LoRA), rounded to the model dtype as vLLM's GEMM
output is. FP8 blocks: the normed input quantized per token group as it
enters (``quant.quantize_input``)."""

import torch

from vllm_ext.quant import quantize_input
from vllm_ext.reference import linear, rms_norm


def fused_weight_rows(mla_weights, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of ``[q_a; kv_a]`` without building the concatenation
    (a tile's rows lie in one or both)."""
    parts, base = [], 0
    for w in (mla_weights.q_a, mla_weights.kv_a):
        if w is None:
            continue
        a, b = max(lo, base), min(hi, base + w.shape[0])
        if a < b:
            parts.append(w[a - base : b - base])
        base += w.shape[0]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def reference(h: torch.Tensor, layer, spec, lo: int, hi: int) -> torch.Tensor:
    """``[B, hi - lo]`` in the model dtype."""
    x = rms_norm(h, layer.input_norm, spec.rms_norm_eps).to(spec.dtype)
    x = quantize_input(x, spec.quant)
    return linear(x, fused_weight_rows(layer.mla, lo, hi)).to(spec.dtype)

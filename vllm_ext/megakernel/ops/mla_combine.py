# SPDX-License-Identifier: Apache-2.0
"""MLA_COMBINE: one head's latent partials merged by log-sum-exp in chunk
order (COMBINE's arithmetic: ops/combine.py), rounded to the model dtype
(vLLM's attention output), then the V up-projection of value columns
[lo, hi) of the head (its W_UV rows), rounded again: the head's slice of
o_proj's input. The merge is recomputed by each part of a head (B x chunks
x 512 fp32: small next to the W_UV rows)."""

import torch

from vllm_ext.megakernel.ops.combine import reference as merge
from vllm_ext.reference import linear


def reference(
    o: torch.Tensor,  # [chunks, B, kv_lora_rank] fp32: the head's partials
    lse: torch.Tensor,  # [chunks, B]
    w_uv: torch.Tensor,  # [v_head_dim, kv_lora_rank]: the head's W_UV
    lo: int,
    hi: int,
    dtype,
) -> torch.Tensor:
    """``[B, hi - lo]`` in ``dtype``."""
    latent = merge(o[:, :, None], lse[:, :, None], dtype)[:, 0]  # [B, rank]
    return linear(latent, w_uv[lo:hi]).to(dtype)

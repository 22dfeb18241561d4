# SPDX-License-Identifier: Apache-2.0
"""EXPERT_UP: RMSNorm fused into slot s's expert's gate/up projection of
intermediate columns [lo, hi), SiLU-mul in the epilogue, for the requests
routed to that expert (as GATE_UP for the dense MLP)."""

import torch

from vllm_ext.reference import linear, rms_norm


def reference(
    hmid: torch.Tensor, layer, spec, expert: int, rows: torch.Tensor, lo: int, hi: int
) -> torch.Tensor:
    """``[len(rows), hi - lo]`` in the model dtype."""
    dtype, inter = spec.dtype, spec.moe.expert_intermediate
    x = rms_norm(hmid[rows], layer.post_norm, spec.rms_norm_eps).to(dtype)
    w13 = layer.moe.w13[expert]
    gate = linear(x, w13[lo:hi]).to(dtype)
    up = linear(x, w13[inter + lo : inter + hi]).to(dtype)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)

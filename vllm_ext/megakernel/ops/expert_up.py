# SPDX-License-Identifier: Apache-2.0
"""EXPERT_UP: RMSNorm fused into slot s's expert's gate/up projection of
intermediate columns [lo, hi), SiLU-mul in the epilogue, for the requests
routed to that expert: GATE_UP's arithmetic on the expert's weights."""

import torch

from vllm_ext.megakernel.ops.gate_up import normed_swiglu


def reference(
    hmid: torch.Tensor, layer, spec, expert: int, rows: torch.Tensor, lo: int, hi: int
) -> torch.Tensor:
    """``[len(rows), hi - lo]`` in the model dtype."""
    return normed_swiglu(hmid[rows], layer.post_norm, layer.moe.w13[expert], spec,
                         lo, hi)  # fmt: skip

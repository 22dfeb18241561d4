# SPDX-License-Identifier: Apache-2.0
"""EXPERT_UP: RMSNorm fused into slot s's expert's gate/up projection of
intermediate columns [lo, hi), SiLU-mul in the epilogue, for the requests
routed to that expert: GATE_UP's arithmetic on the expert's weights. The
shared expert's slot (``Program.shared_slot``) runs it on the shared
expert's weights for every request."""

import torch

from vllm_ext.megakernel.ops.gate_up import normed_swiglu


def reference(
    hmid: torch.Tensor,
    layer,
    spec,
    expert: int | None,
    rows: torch.Tensor,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """``[len(rows), hi - lo]`` in the model dtype; ``expert`` None: the
    shared expert. Quantized experts (``spec.quant``): the normed input as
    the kernel quantizes it (FP8: per token, or per token and group of 128;
    ``normed_swiglu``), the weights ``MoeWeights.w13``'s dequantization."""
    moe = layer.moe
    gate_up = moe.shared_gate_up if expert is None else moe.w13[expert]
    return normed_swiglu(hmid[rows], layer.post_norm, gate_up, spec, lo, hi)

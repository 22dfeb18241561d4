# SPDX-License-Identifier: Apache-2.0
"""EXPERT_DOWN: hidden columns [lo, hi) of the weighted sum of each
request's experts' down projections (in slot order, so in ascending expert
order), then the shared expert's (weight 1) if the model has one, all
accumulated in fp32 and rounded once, plus the residual."""

import torch

from vllm_ext.quant import QuantFormat, quantize_input
from vllm_ext.reference import linear


def reference(
    xact: torch.Tensor,
    hmid: torch.Tensor | None,
    layer,
    routing,
    lo: int,
    hi: int,
    dtype,
    quant: QuantFormat | None = None,
) -> torch.Tensor:
    """``xact`` ``[slots (+1 shared), B, width]``; ``routing``: ops/topk.py's;
    no residual (``hmid`` None): a tensor-parallel rank's partial sum;
    ``quant``: the checkpoint's (FP8: each slot's rows of its ``inter``
    columns quantized as they enter, per token or per token and group of
    128, as EXPERT_UP's last tile fills XQ and XSCALE)."""
    batch, moe = xact.shape[1], layer.moe
    inter = moe.w2.shape[-1]
    out = torch.zeros(batch, hi - lo, dtype=torch.float32, device=xact.device)
    for slot, expert in enumerate(routing.experts.tolist()):
        if expert < 0:
            break
        rows, choice = (routing.slots == slot).nonzero(as_tuple=True)
        x = quantize_input(xact[slot, rows, :inter], quant)
        y = linear(x, moe.w2[expert][lo:hi])
        out.index_add_(0, rows, y * routing.weights[rows, choice, None])
    if moe.shared_down is not None:
        shared = xact[len(routing.experts), :, : moe.shared_down.shape[-1]]
        out += linear(quantize_input(shared, quant), moe.shared_down[lo:hi])
    if hmid is None:
        return out.to(dtype)
    return (out.to(dtype) + hmid[:, lo:hi]).to(dtype)

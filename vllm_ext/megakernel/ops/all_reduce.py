# SPDX-License-Identifier: Apache-2.0
"""ALL_REDUCE: a tensor-parallel point's columns [lo, hi): the ranks'
partial sums added in rank order in fp32 and rounded once (the same bits on
every rank), then the residual added and rounded, as vLLM's row-parallel
layer all-reduces its output and its next RMSNorm adds the residual."""

import torch


def reference(
    partials: list[torch.Tensor], residual: torch.Tensor | None, dtype
) -> torch.Tensor:
    """``partials``: each rank's ``[B, hi - lo]``, in rank order (one, where
    a collective has already summed them); ``residual``: the point's
    ``[B, hi - lo]`` or None (the embedding's)."""
    total = partials[0].float()
    for part in partials[1:]:
        total = total + part.float()
    total = total.to(dtype)
    return total if residual is None else (total + residual).to(dtype)

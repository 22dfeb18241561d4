# SPDX-License-Identifier: Apache-2.0
"""COMBINE: merge one kv head's attention partials by log-sum-exp, in fp32,
in chunk order (so the result does not depend on which chunk finished
first)."""

import torch


def reference(o: torch.Tensor, lse: torch.Tensor, dtype) -> torch.Tensor:
    """o ``[chunks, B, group, d]``, lse ``[chunks, B, group]`` ->
    ``[B, group, d]`` in ``dtype``."""
    top = lse.amax(dim=0)  # [B, group]
    # A sequence with no tokens (a padded row) has every lse = -inf.
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - top)  # [chunks, B, group]
    num = torch.zeros_like(o[0])
    den = torch.zeros_like(lse[0])
    for c in range(o.shape[0]):
        num = num + w[c, ..., None] * o[c]
        den = den + w[c]
    den = torch.where(den == 0, torch.ones_like(den), den)
    return (num / den[..., None]).to(dtype)

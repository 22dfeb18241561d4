# SPDX-License-Identifier: Apache-2.0
"""O_PROJ: output projection of hidden columns [lo, hi) plus the residual."""

import torch

from vllm_ext.reference import linear


def reference(
    attn: torch.Tensor, h: torch.Tensor, w_o: torch.Tensor, lo: int, hi: int, dtype
) -> torch.Tensor:
    out = linear(attn, w_o[lo:hi]).to(dtype)
    return (out + h[:, lo:hi]).to(dtype)

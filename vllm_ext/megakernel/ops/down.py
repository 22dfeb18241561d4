# SPDX-License-Identifier: Apache-2.0
"""DOWN: down projection of hidden columns [lo, hi) plus the residual."""

import torch

from vllm_ext.reference import linear


def reference(
    act: torch.Tensor, hmid: torch.Tensor, w_down: torch.Tensor, lo: int, hi: int, dtype
) -> torch.Tensor:
    out = linear(act, w_down[lo:hi]).to(dtype)
    return (out + hmid[:, lo:hi]).to(dtype)

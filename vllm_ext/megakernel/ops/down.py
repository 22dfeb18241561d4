# SPDX-License-Identifier: Apache-2.0
"""DOWN: down projection of hidden columns [lo, hi) plus the residual."""

import torch

from vllm_ext.quant import QuantFormat, quantize_input
from vllm_ext.reference import linear


def reference(
    act: torch.Tensor,
    hmid: torch.Tensor | None,
    w_down: torch.Tensor,
    lo: int,
    hi: int,
    dtype,
    quant: QuantFormat | None = None,
) -> torch.Tensor:
    """``quant``: the checkpoint's (quant.py); FP8 W8A8 quantizes each
    request's whole input row as it enters. No residual (None): a tensor-
    parallel rank's partial sum."""
    out = linear(quantize_input(act, quant), w_down[lo:hi]).to(dtype)
    if hmid is None:  # tensor parallel: the partial sum (all_reduce.py)
        return out
    return (out + hmid[:, lo:hi]).to(dtype)

# SPDX-License-Identifier: Apache-2.0
"""O_PROJ: output projection of hidden columns [lo, hi) plus the residual."""

import torch

from vllm_ext.quant import QuantFormat, quantize_input
from vllm_ext.reference import linear


def reference(
    attn: torch.Tensor,
    h: torch.Tensor | None,
    w_o: torch.Tensor,
    lo: int,
    hi: int,
    dtype,
    quant: QuantFormat | None = None,
) -> torch.Tensor:
    """``quant``: the checkpoint's (quant.py); FP8 W8A8 quantizes each
    request's whole input row as it enters. No residual (None): a tensor-
    parallel rank's partial sum."""
    out = linear(quantize_input(attn, quant), w_o[lo:hi]).to(dtype)
    if h is None:  # tensor parallel: the partial sum (all_reduce.py)
        return out
    return (out + h[:, lo:hi]).to(dtype)

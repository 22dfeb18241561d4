# SPDX-License-Identifier: Apache-2.0
"""LM_HEAD: fp32 logits of vocabulary columns [lo, hi)."""

import torch

from vllm_ext.reference import linear


def reference(out: torch.Tensor, w_lm: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return linear(out, w_lm[lo:hi])

# SPDX-License-Identifier: Apache-2.0
"""ROUTE: RMSNorm fused into the router's logits of experts [lo, hi),
rounded to the model dtype (vLLM's gate is a linear layer of that dtype)."""

import torch

from vllm_ext.reference import linear, rms_norm


def reference(hmid: torch.Tensor, layer, spec, lo: int, hi: int) -> torch.Tensor:
    x = rms_norm(hmid, layer.post_norm, spec.rms_norm_eps).to(spec.dtype)
    return linear(x, layer.moe.router[lo:hi]).to(spec.dtype)

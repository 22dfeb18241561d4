# SPDX-License-Identifier: Apache-2.0
"""GATE_UP: RMSNorm fused into the gate/up projection of intermediate
columns [lo, hi), SiLU-mul in the epilogue."""

import torch

from vllm_ext.quant import quantize_input
from vllm_ext.reference import linear, rms_norm


def reference(hmid: torch.Tensor, layer, spec, lo: int, hi: int) -> torch.Tensor:
    return normed_swiglu(hmid, layer.post_norm, layer.gate_up, spec, lo, hi)


def normed_swiglu(
    hmid: torch.Tensor,
    norm: torch.Tensor,
    gate_up: torch.Tensor,
    spec,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """SiLU(x @ Wg[lo:hi].T) * (x @ Wu[lo:hi].T), x = RMSNorm(hmid), in the
    model dtype; ``gate_up`` holds the gate rows, then as many up rows
    (a dense MLP's, or one expert's: EXPERT_UP)."""
    dtype, inter = spec.dtype, gate_up.shape[0] // 2
    x = rms_norm(hmid, norm, spec.rms_norm_eps).to(dtype)
    x = quantize_input(x, spec.quant)  # FP8 W8A8: per token, as it enters
    gate = linear(x, gate_up[lo:hi]).to(dtype)
    up = linear(x, gate_up[inter + lo : inter + hi]).to(dtype)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)

# SPDX-License-Identifier: Apache-2.0
"""GATE_UP: RMSNorm fused into the gate/up projection of intermediate
columns [lo, hi), SiLU-mul in the epilogue."""

import torch

from vllm_ext.reference import linear, rms_norm


def reference(hmid: torch.Tensor, layer, spec, lo: int, hi: int) -> torch.Tensor:
    dtype, inter = spec.dtype, spec.intermediate_size
    x = rms_norm(hmid, layer.post_norm, spec.rms_norm_eps).to(dtype)
    gate = linear(x, layer.gate_up[lo:hi]).to(dtype)
    up = linear(x, layer.gate_up[inter + lo : inter + hi]).to(dtype)
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)

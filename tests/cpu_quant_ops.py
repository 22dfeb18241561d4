# SPDX-License-Identifier: Apache-2.0
"""PyTorch stand-ins for quantized GEMMs of vLLM's CPU build that a
machine's build lacks (test code only).

vLLM's x86 CPU wheel loads one of three op libraries by the CPU's ISA; the
AVX2 one has no ``cpu_gemm_wna16`` (INT4 W4A16), so vLLM cannot serve an
INT4 checkpoint there. So that prefill and vLLM's default decode still run
on every machine of the project's kind, ``install`` puts in its place a
PyTorch GEMM over the same packed operands, with vLLM's GPU numerics for
the format (Marlin's: a weight is ``bf16((q - 8) * s)``, products summed
in fp32, the output rounded to the activations' dtype). Where the real op
exists it is used, and this module does nothing.
"""

from __future__ import annotations

import torch


def has_op(name: str) -> bool:
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, name)


def unpack_cpu_wna16(q_weight: torch.Tensor, input_size: int) -> torch.Tensor:
    """vLLM's CPU W4A16 layout (``CPUWNA16LinearKernel``:
    ``[N / 16, K * 2]`` int32, per block of 16 outputs K rows of two int32
    of eight 4-bit codes along N) -> unsigned codes ``[K, N]``."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    blocks = q_weight.view(-1, input_size, 2).permute(1, 0, 2).reshape(input_size, -1)
    return unpack_quantized_values_into_int32(blocks, scalar_types.uint4b8, 1)


def gemm_wna16(input, q_weight, scales, zeros, bias, pack_factor, isa_hint):
    """``ops.cpu_gemm_wna16`` for symmetric INT4 (uint4b8; scales
    ``[K / group, N]``)."""
    assert zeros is None and pack_factor == 8, "symmetric INT4 only"
    k = input.shape[-1]
    codes = unpack_cpu_wna16(q_weight, k)  # [K, N]
    group = k // scales.shape[0]
    s = scales.repeat_interleave(group, dim=0)
    weight = ((codes - 8).to(scales.dtype) * s).to(input.dtype)
    out = input.float() @ weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(input.dtype)


def install(monkeypatch) -> list[str]:
    """Put the stand-ins in for the ops this machine's vLLM build lacks
    (the engine must run in this process); returns their names."""
    from vllm import _custom_ops as ops

    swapped = []
    if not has_op("cpu_gemm_wna16"):
        monkeypatch.setattr(ops, "cpu_gemm_wna16", gemm_wna16)
        swapped.append("cpu_gemm_wna16")
    return swapped

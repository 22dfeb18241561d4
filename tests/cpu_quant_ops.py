# SPDX-License-Identifier: Apache-2.0
"""PyTorch stand-ins for quantized GEMMs of vLLM's CPU build that a
machine's build lacks or runs with other numerics (test code only).

- INT4 W4A16: vLLM's x86 CPU wheel loads one of three op libraries by the
  CPU's ISA; the AVX2 one has no ``cpu_gemm_wna16``, so vLLM cannot serve
  an INT4 checkpoint there. ``install`` puts in its place a PyTorch GEMM
  over the same packed operands, with vLLM's GPU numerics (Marlin's: a
  weight is ``bf16((q - 8) * s)``, products summed in fp32, the output
  rounded to the activations' dtype); where the op exists it is used.
- FP8 with 128x128 blocks: vLLM's CPU kernel needs AMX, and runs W8A16
  where a GPU runs W8A8 (activations quantized per token in groups of
  128). Always replaced, by the GPU's numerics (vLLM's Triton
  ``w8a8_block_fp8_matmul``: per K block, the e4m3 products summed in fp32,
  times the token group's and the weight block's scales, accumulated in
  fp32), the weights kept as loaded.

So prefill and vLLM's default decode run on every machine of the project's
kind, with the numerics a GPU serves the checkpoint with.
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


FP8_MAX = 448.0
BLOCK = 128


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token group-128 FP8 quantization (QuantFP8's
    group path): (e4m3 ``[M, K]``, fp32 scales ``[M, K / 128]``)."""
    groups = x.view(x.shape[0], -1, BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(x.shape), scale.squeeze(-1)


def block_fp8_matmul(x, weight, weight_scale, out_dtype):
    """``x @ W.T`` as vLLM's GPU block-FP8 GEMM computes it: ``weight``
    e4m3 ``[N, K]``, ``weight_scale`` ``[N / 128, K / 128]``."""
    xq, xs = quantize_groups(x)
    n, k = weight.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float32)
    ws = weight_scale.float().repeat_interleave(BLOCK, dim=0)[:n]  # [N, K/128]
    for kb in range(k // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = xq[:, cols].float() @ weight[:, cols].float().t()
        out += part * xs[:, kb, None] * ws[None, :, kb]
    return out.to(out_dtype)


def _install_fp8_blocks(monkeypatch) -> None:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
        CPUFp8BlockScaledMMKernel as Kernel,
    )
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
        CPUFp8W8A8BlockScaledMMKernel,
    )

    def supported(cls, compute_capability=None):
        return True, None

    def keep_as_loaded(self, layer):
        pass

    def apply_weights(self, layer, x, bias=None, **kwargs):
        x2 = x.reshape(-1, x.shape[-1])
        out = block_fp8_matmul(x2, layer.weight, layer.weight_scale_inv, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    # (The W8A8 AMX-FP8 kernel is tried first: keep it out.)
    monkeypatch.setattr(CPUFp8W8A8BlockScaledMMKernel, "is_supported",
                        classmethod(lambda cls, c=None: (False, "test")))  # fmt: skip
    monkeypatch.setattr(Kernel, "is_supported", classmethod(supported))
    monkeypatch.setattr(Kernel, "process_weights_after_loading", keep_as_loaded)
    monkeypatch.setattr(Kernel, "apply_weights", apply_weights)


def install(monkeypatch) -> list[str]:
    """Put the stand-ins in (the engine must run in this process); returns
    what they replace."""
    from vllm import _custom_ops as ops

    swapped = ["CPUFp8BlockScaledMMKernel"]
    _install_fp8_blocks(monkeypatch)
    if not has_op("cpu_gemm_wna16"):
        monkeypatch.setattr(ops, "cpu_gemm_wna16", gemm_wna16)
        swapped.append("cpu_gemm_wna16")
    return swapped

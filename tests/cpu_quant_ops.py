# SPDX-License-Identifier: Apache-2.0
"""PyTorch stand-ins for quantized GEMMs of vLLM's CPU build that a
machine's build lacks or runs with other numerics (test code only).

- INT4 W4A16: vLLM's x86 CPU wheel loads one of three op libraries by the
  CPU's ISA, and its ``cpu_gemm_wna16`` differs with them: absent from the
  AVX2 one, without fp32 where the CPU has AMX (and there, in bf16, vLLM
  runs W4A8 instead unless ``VLLM_CPU_INT4_W4A8=0``, which ``install``
  sets). Always replaced, by a PyTorch GEMM over the same packed operands
  with vLLM's GPU numerics (Marlin's: a weight is ``bf16((q - 8) * s)``,
  products summed in fp32, the output rounded to the activations' dtype).
- FP8 with 128x128 blocks: vLLM's CPU kernel needs AMX, and runs W8A16
  where a GPU runs W8A8 (activations quantized per token in groups of
  128). Always replaced, by the GPU's numerics (vLLM's Triton
  ``w8a8_block_fp8_matmul``: per K block, the e4m3 products summed in fp32,
  times the token group's and the weight block's scales, accumulated in
  fp32), the weights kept as loaded.

- INT4 W4A16 mixtures of experts: vLLM's CPU experts (``CPUExpertsInt4``)
  need AMX, take only scales of a whole row (no CPU backend of vLLM's
  serves a checkpoint's groups of 32), and compute W4A8 (activations
  quantized to int8) where a GPU's Marlin MoE computes W4A16. Always
  replaced, by Marlin's numerics over
  the checkpoint's packed experts kept as loaded (``[E, N, K / 8]`` int32,
  scales ``[E, N, K / group]``): a weight ``(q - 8) * s`` rounded to the
  activations' dtype, each GEMM summed in fp32 and rounded to it, SiLU of
  the gate times the up rounded to it, the top-k outputs weighted and
  summed in fp32. DeepSeek's routing is let in, as vLLM's CPU FP8 experts
  let it (its router runs before the experts).

- FP8 128x128-block mixtures: vLLM's CPU experts (``CPUExpertsFp8``) need
  AMX and run W8A16. Always replaced, by the GPU's block-FP8 fused MoE
  numerics (vLLM's Triton ``fused_moe`` with block quantization): each
  GEMM as ``block_fp8_matmul`` (inputs per token in groups of 128) rounded
  to the activations' dtype, SiLU-mul rounded to it, the top-k outputs
  weighted and summed in fp32; the experts kept as loaded. DeepSeek's
  routing (grouped sigmoid top-k, correction bias) is vLLM's router's,
  run before the experts: they get its top-k weights and ids; its runner
  scales their output by ``routed_scaling_factor`` and adds the shared
  expert, an FP8-block MLP of its own (``block_fp8_matmul``).

- Per-channel FP8 mixtures (compressed-tensors: e4m3 experts, a scale an
  output channel, activations per token): no CPU experts of vLLM's take
  them (``CPUExpertsFp8`` and ``CPUExpertsFp8W8A8``: 128x128 blocks only),
  so vLLM finds no FP8 MoE backend and fails at load ("Unsupported FP8 MoE
  backend: NONE"). ``CPUExpertsFp8`` is let take them, computing the GPU's
  numerics (vLLM's Triton ``fused_moe`` with ``per_act_token_quant``): each
  GEMM's input quantized per token (``scaled_fp8_quant``), the e4m3
  products summed in fp32 times the token's and the output channel's
  scales, rounded to the activations' dtype; SiLU-mul rounded to it; the
  top-k outputs weighted and summed in fp32; the experts kept as loaded.
- GPTQ mixtures: vLLM's ``AutoGPTQMoEMethod`` transposes its experts to
  compressed-tensors' layout (``[E, N, K / 8]`` words of codes plus 8,
  scales ``[E, N, K / group]``) and hands them to the same CPU experts,
  so the INT4 mixture's stand-in serves them.

So prefill and vLLM's default decode run on every machine of the project's
kind, with the numerics a GPU serves the checkpoint with.
"""

from __future__ import annotations

import torch


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
    group path, a partial last group padded with zeros): (e4m3 ``[M, K]``,
    fp32 scales ``[M, ceil(K / 128)]``)."""
    k = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -k % BLOCK))
    groups = padded.view(x.shape[0], -1, BLOCK)
    amax = groups.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(padded.shape)[:, :k], scale.squeeze(-1)


def block_fp8_matmul(x, weight, weight_scale, out_dtype):
    """``x @ W.T`` as vLLM's GPU block-FP8 GEMM computes it: ``weight``
    e4m3 ``[N, K]``, ``weight_scale`` ``[N / 128, K / 128]``."""
    xq, xs = quantize_groups(x)
    n, k = weight.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float32)
    ws = weight_scale.float().repeat_interleave(BLOCK, dim=0)[:n]  # [N, K/128]
    for kb in range(-(-k // BLOCK)):  # (the last K block possibly partial)
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


def unpack_int4_experts(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` experts ``[E, N, K / 8]`` int32
    and their scales ``[E, N, K / group]`` -> weights ``[E, N, K]`` in the
    scales' dtype, ``q * s`` rounded once (compressed-tensors' own
    unpacking: its codes are the signed values)."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        unpack_from_int32,
    )

    e, n, words = packed.shape
    codes = unpack_from_int32(packed, 4, torch.Size((e, n, words * 8)))
    group = codes.shape[-1] // scales.shape[-1]
    return codes.to(scales.dtype) * scales.repeat_interleave(group, dim=-1)


def int4_fused_experts(x, w13, w2, s13, s2, topk_weights, topk_ids) -> torch.Tensor:
    """Marlin's W4A16 mixture over packed experts, in PyTorch."""
    dtype = x.dtype
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        tokens, slot = (topk_ids == e).nonzero(as_tuple=True)
        up = unpack_int4_experts(w13[e : e + 1], s13[e : e + 1])[0].to(dtype)
        down = unpack_int4_experts(w2[e : e + 1], s2[e : e + 1])[0].to(dtype)
        h = (x[tokens].float() @ up.float().t()).to(dtype)
        gate, val = h.chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate.float()) * val.float()).to(dtype)
        y = (act.float() @ down.float().t()).to(dtype)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slot, None].float())
    return out.to(dtype)


def _install_int4_experts(monkeypatch) -> None:
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.scalar_type import scalar_types

    def keep_as_loaded(quant_config, w13, w2, w13_scale, w2_scale, *args, **kw):
        # (The method then registers zero points for the CPU backend.)
        zeros = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
        return (w13, w2, w13_scale, w2_scale, *zeros, None, None, None, None)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
              *args, **kwargs):  # fmt: skip
        q = self.quant_config
        out = int4_fused_experts(hidden_states, w1, w2, q.w1_scale, q.w2_scale,
                                 topk_weights, topk_ids)  # fmt: skip
        output.copy_(out)

    def int4_groups(weight_key, activation_key):
        # vLLM's CPU experts take kInt4Static (scales of a whole row) only:
        # a checkpoint's groups of 32 meet no CPU backend of vLLM's.
        return activation_key is None and weight_key.dtype == scalar_types.uint4b8

    def routing(method, *args):
        # vLLM's, and DeepSeek's as its CPU FP8 experts take it: its router
        # runs before the experts, which get the top-k weights and ids.
        return method in (RoutingMethodType.Default, RoutingMethodType.Renormalize,
                          RoutingMethodType.RenormalizeNaive,
                          RoutingMethodType.DeepSeekV3)  # fmt: skip

    monkeypatch.setattr(CPUExpertsInt4, "_supports_current_device",
                        staticmethod(lambda: True))  # fmt: skip
    monkeypatch.setattr(CPUExpertsInt4, "_supports_quant_scheme",
                        staticmethod(int4_groups))  # fmt: skip
    monkeypatch.setattr(CPUExpertsInt4, "_supports_routing_method",
                        staticmethod(routing))  # fmt: skip
    monkeypatch.setattr(int_wna16, "_process_weights_cpu", keep_as_loaded)
    monkeypatch.setattr(CPUExpertsInt4, "apply", apply)


def _fused_experts(matmul, x, w13, w2, s13, s2, topk_weights, topk_ids):
    """The GPU's mixture over experts as loaded, in PyTorch: each expert's
    tokens through ``matmul(x, weight, scale, dtype)`` (gate and up, SiLU,
    down), weighted and summed per token."""
    dtype = x.dtype
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        tokens, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = matmul(x[tokens], w13[e], s13[e], dtype)
        gate, up = h.chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
        y = matmul(act, w2[e], s2[e], dtype)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slot, None].float())
    return out.to(dtype)


def fp8_block_fused_experts(x, w13, w2, s13, s2, topk_weights, topk_ids):
    """The GPU's block-FP8 mixture (e4m3 ``[E, N, K]``, scales ``[E, N / 128,
    K / 128]``)."""
    return _fused_experts(block_fp8_matmul, x, w13, w2, s13, s2, topk_weights,
                          topk_ids)  # fmt: skip


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token FP8 quantization (``scaled_fp8_quant`` with
    ``use_per_token_if_dynamic``): (e4m3 ``[M, K]``, fp32 scales ``[M, 1]``),
    a row times its scale's reciprocal."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
    q = (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def channel_fp8_matmul(x, weight, weight_scale, out_dtype):
    """``x @ W.T`` as vLLM's GPU per-channel W8A8 GEMM computes it:
    ``weight`` e4m3 ``[N, K]``, ``weight_scale`` ``[N, 1]``, ``x`` quantized
    per token."""
    xq, xs = quantize_tokens(x)
    out = xq.float() @ weight.float().t()
    return (out * xs * weight_scale.float().view(1, -1)).to(out_dtype)


def fp8_channel_fused_experts(x, w13, w2, s13, s2, topk_weights, topk_ids):
    """The GPU's per-channel FP8 mixture (e4m3 ``[E, N, K]``, scales
    ``[E, N, 1]``)."""
    return _fused_experts(channel_fp8_matmul, x, w13, w2, s13, s2, topk_weights,
                          topk_ids)  # fmt: skip


def _install_fp8_experts(monkeypatch) -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Dynamic128Sym,
        kFp8DynamicTokenSym,
        kFp8Static128BlockSym,
        kFp8StaticChannelSym,
    )

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
              *args, **kwargs):  # fmt: skip
        q = self.quant_config
        # (Of the two schemes let in below, a scale a row: per channel. The
        # W8A16 config vLLM makes for these experts has no block shape.)
        channel = q.w1_scale.shape[-2:] == (w1.shape[-2], 1)
        experts = fp8_channel_fused_experts if channel else fp8_block_fused_experts
        out = experts(hidden_states, w1, w2, q.w1_scale, q.w2_scale,
                      topk_weights, topk_ids)  # fmt: skip
        output.copy_(out)

    schemes = [(kFp8Static128BlockSym, kFp8Dynamic128Sym),
               (kFp8StaticChannelSym, kFp8DynamicTokenSym)]  # fmt: skip
    # (The W8A8 AMX-FP8 experts are tried first: keep them out.)
    monkeypatch.setattr(cpu_moe.CPUExpertsFp8W8A8, "_supports_current_device",
                        staticmethod(lambda: False))  # fmt: skip
    monkeypatch.setattr(cpu_moe.CPUExpertsFp8, "_supports_current_device",
                        staticmethod(lambda: True))  # fmt: skip
    monkeypatch.setattr(cpu_moe.CPUExpertsFp8, "_supports_quant_scheme",
                        staticmethod(lambda w, a: (w, a) in schemes))  # fmt: skip
    monkeypatch.setattr(cpu_moe, "prepare_fp8_moe_layer_for_cpu",
                        lambda w13, w2: (w13, w2))  # fmt: skip
    monkeypatch.setattr(cpu_moe.CPUExpertsFp8, "apply", apply)


def install(monkeypatch) -> list[str]:
    """Put the stand-ins in (the engine must run in this process); returns
    what they replace."""
    from vllm import _custom_ops as ops

    _install_fp8_blocks(monkeypatch)
    _install_int4_experts(monkeypatch)
    _install_fp8_experts(monkeypatch)
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "0")
    monkeypatch.setattr(ops, "cpu_gemm_wna16", gemm_wna16)
    return ["CPUFp8BlockScaledMMKernel", "CPUExpertsInt4", "CPUExpertsFp8",
            "cpu_gemm_wna16"]  # fmt: skip

# SPDX-License-Identifier: Apache-2.0
"""Quantized checkpoints: which formats the backend takes, and their
weights as vLLM loaded them.

Taken, on dense models: INT4 weight-only (W4A16), symmetric, group-wise,
in GPTQ (``quant_method: gptq``, no act-order) and compressed-tensors
``pack-quantized`` checkpoints; FP8 e4m3 with per-channel weight scales
and dynamic per-token activations (W8A8, compressed-tensors
``float-quantized``); FP8 with 128x128 weight blocks and activations per
token in groups of 128 (``quant_method: fp8``). Numerics are vLLM's on a
GPU. W4A16 (Marlin):
activations stay in the model dtype, a weight is ``(q - 8) * s`` rounded
to the model dtype (``s`` the group's scale), products summed in fp32.
FP8 W8A8: each layer's input quantized per token to e4m3 as it enters
(``quantize_input``), products of e4m3 operands summed in fp32 and scaled
by both scales. Every other format is refused at start-up, by name.
A compressed-tensors INT4 checkpoint may leave kinds of projections in
the model dtype by its ``ignore`` list (Kimi-K2-Thinking quantizes its
routed experts only): ``QuantFormat.unquantized`` names them.

FP8 weights are read from vLLM's layers as it keeps them. INT4 weights
are read back from vLLM's layers, whatever layout its kernel repacked them
into: pushing the identity through the layer's own
``quant_method.apply`` gives each dequantized weight exactly (one product
by 1, the rest zeros), and the layer's group scales then give back the
4-bit codes, checked to dequantize to the same weight bit for bit.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's quantization, as the backend runs it."""

    name: str  # INT4_W4A16, FP8_W8A8 or FP8_BLOCK
    checkpoint: str  # "gptq", "compressed-tensors pack-quantized", ...
    bits: int
    group_size: int  # along K; -1: one group per output row
    # How a quantized layer's input is quantized as it enters (None: not).
    activations: str | None = None  # PER_TOKEN or PER_TOKEN_GROUP
    # Kinds of projections (ATTENTION .. ROUTED_EXPERTS) the checkpoint
    # leaves in the model dtype (compressed-tensors' ``ignore``; "some
    # <kind>" where it names some of a kind's layers only); once the model
    # is known (``for_model``) only the kinds it has.
    unquantized: frozenset[str] = frozenset()
    # Set by ``for_model``: the routed experts are the one kind quantized
    # (Kimi-K2-Thinking's INT4 checkpoint).
    experts_only: bool = False

    def weight_bytes(self, rows: int, cols: int, scale_bytes: int) -> int:
        """Bytes of ``rows`` x ``cols`` of a quantized layer's weight with
        their scales (INT4's in the model dtype, ``scale_bytes`` each;
        FP8's fp32, one a row)."""
        if self.name == FP8_W8A8:
            return rows * cols + rows * 4
        if self.name == FP8_BLOCK:  # an fp32 scale a 128x128 block
            return rows * cols + -(-rows // BLOCK) * -(-cols // BLOCK) * 4
        groups = 1 if self.group_size < 0 else -(-cols // self.group_size)
        return rows * cols * self.bits // 8 + rows * groups * scale_bytes


INT4_W4A16 = "int4-w4a16"
# compressed-tensors' INT4 checkpoints: the one format whose mixtures the
# backend reads (``int4_experts``).
PACK_QUANTIZED = "compressed-tensors pack-quantized"
FP8_W8A8 = "fp8-w8a8"
FP8_BLOCK = "fp8-block128"  # DeepSeek-V3's: 128x128 weight blocks
# How activations are quantized as they enter a quantized layer.
PER_TOKEN = "fp8-per-token"
PER_TOKEN_GROUP = "fp8-per-token-group-128"
BLOCK = 128
# Kinds of decoder projections a checkpoint may leave in the model dtype.
ATTENTION = "attention"
DENSE_MLP = "dense MLPs"
SHARED_EXPERTS = "shared experts"
ROUTED_EXPERTS = "routed experts"
# Each kind's module names as vLLM names its layers (compressed-tensors
# matches ``ignore`` entries against them: a ``re:`` pattern by
# ``re.match``, any other by equality), under a few layers' prefixes: an
# entry matching a kind at some of them, or some of its modules, leaves
# some of that kind unquantized.
_KIND_MODULES = {
    ATTENTION: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                "self_attn.o_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",
                "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"),
    DENSE_MLP: ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    SHARED_EXPERTS: ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                     "mlp.shared_experts.down_proj"),
    ROUTED_EXPERTS: ("mlp.experts.0.gate_proj", "mlp.experts.0.up_proj",
                     "mlp.experts.0.down_proj", "block_sparse_moe.experts.0.w1",
                     "block_sparse_moe.experts.0.w2", "block_sparse_moe.experts.0.w3"),
}  # fmt: skip
_LAYER_PREFIXES = ("model.layers.0.", "model.layers.1.", "model.layers.60.")


def quant_format(hf_quant_config: Any) -> QuantFormat | None:
    """The format of a checkpoint's ``quantization_config`` (None: not
    quantized). Raises ``ValueError`` naming a format the backend refuses."""
    if hf_quant_config is None:
        return None
    try:
        return _format(hf_quant_config)
    except ValueError as refused:
        raise ValueError(f"quantization {refused}") from None


def _format(hf_quant_config: Any) -> QuantFormat:
    cfg = dict(hf_quant_config)
    method = cfg.get("quant_method")
    if method == "gptq":
        return _gptq(cfg)
    if method == "compressed-tensors":
        return _compressed_tensors(cfg)
    if method == "fp8" and cfg.get("weight_block_size"):
        return _fp8_blocks(cfg)
    names = {
        "fp8": "FP8 with per-tensor scales",
        "awq": "AWQ (asymmetric, zero points)",
        "mxfp4": "MXFP4",
        "modelopt_fp4": "NVFP4",
        "modelopt": "ModelOpt FP8",
        "bitsandbytes": "bitsandbytes",
        "gguf": "GGUF",
    }
    raise ValueError(names.get(method, f"quant_method {method!r}"))


def _fp8_blocks(cfg: dict) -> QuantFormat:
    """DeepSeek-V3's and Kimi-K2's FP8: e4m3 weights with an fp32 scale a
    128x128 block (``weight_scale_inv``), activations quantized per token
    in groups of 128 as they enter each layer."""
    block = list(cfg["weight_block_size"])
    if block != [BLOCK, BLOCK]:
        raise ValueError(f"FP8 with {block} weight blocks")
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("FP8 blocks with static activation scales")
    return QuantFormat(FP8_BLOCK, "fp8", 8, BLOCK, PER_TOKEN_GROUP)


def _gptq(cfg: dict) -> QuantFormat:
    bits, sym = cfg.get("bits"), cfg.get("sym", True)
    if bits != 4:
        raise ValueError(f"GPTQ with {bits}-bit weights")
    if not sym:
        raise ValueError("GPTQ with zero points (sym: false)")
    if cfg.get("desc_act"):
        raise ValueError("GPTQ with act-order (desc_act: true)")
    return QuantFormat(INT4_W4A16, "gptq", 4, int(cfg.get("group_size", -1)))


def _compressed_tensors(cfg: dict) -> QuantFormat:
    fmt = cfg.get("format")
    groups = list((cfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups")
    (group,) = groups
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    kind = (weights.get("type"), weights.get("num_bits"))
    if kind == ("float", 8):
        return _compressed_tensors_fp8(cfg, weights, acts)
    if kind == ("float", 4):
        raise ValueError(f"compressed-tensors {fmt or 'FP4'} (NVFP4/MXFP4)")
    if kind == ("int", 8):
        raise ValueError("compressed-tensors INT8 (W8A8/W8A16)")
    if kind != ("int", 4) or fmt != "pack-quantized" or acts:
        raise ValueError(f"compressed-tensors {fmt} {kind}")
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors INT4 with zero points (asymmetric)")
    if weights.get("actorder"):
        raise ValueError("compressed-tensors INT4 with act-order")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors INT4 with strategy {strategy!r}")
    size = int(weights.get("group_size") or -1) if strategy == "group" else -1
    left = _ignored_kinds(cfg.get("ignore") or [])
    return QuantFormat(INT4_W4A16, PACK_QUANTIZED, 4, size, unquantized=left)


def _ignored_kinds(ignore: list[str]) -> frozenset[str]:
    """The kinds of projections ``ignore`` leaves in the model dtype (the
    LM head and a mixture's router are not among the kinds): a kind whose
    every module it names, or "some <kind>"."""
    left = set()
    for kind, modules in _KIND_MODULES.items():
        names = [p + m for p in _LAYER_PREFIXES for m in modules]
        hits = sum(any(_ignores(entry, n) for entry in ignore) for n in names)
        if hits == len(names):
            left.add(kind)
        elif hits:
            left.add(f"some {kind}")
    return frozenset(left)


def _ignores(entry: str, name: str) -> bool:
    """Whether an ``ignore`` entry names module ``name``, as compressed-
    tensors matches them."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


def for_model(quant: QuantFormat | None, kinds: set[str]) -> QuantFormat | None:
    """``quant`` in a model whose projections are of ``kinds``: its
    ``unquantized`` those of them the checkpoint leaves in the model dtype,
    and ``experts_only`` where that is every kind but the routed experts."""
    if quant is None:
        return None
    left = frozenset(k for k in quant.unquantized if k.removeprefix("some ") in kinds)
    experts_only = (
        bool(left) and ROUTED_EXPERTS in kinds and left == (kinds - {ROUTED_EXPERTS})
    )
    return dataclasses.replace(quant, unquantized=left, experts_only=experts_only)


def _compressed_tensors_fp8(cfg: dict, weights: dict, acts: dict | None):
    """FP8 e4m3 weights with a scale per output channel, activations
    quantized per token as they enter each layer (Llama/Qwen FP8
    checkpoints: compressed-tensors ``float-quantized``)."""
    strategy = weights.get("strategy")
    if strategy != "channel":
        raise ValueError(f"compressed-tensors FP8 with {strategy} weight scales")
    if not acts:
        raise ValueError("compressed-tensors FP8 weight-only (W8A16)")
    act = (acts.get("type"), acts.get("num_bits"), acts.get("strategy"))
    if act != ("float", 8, "token") or not acts.get("dynamic"):
        raise ValueError(f"compressed-tensors FP8 with {act} activations")
    # The program quantizes every decoder layer's inputs alike (the LM head
    # and a mixture's router excepted: both stay in the model dtype).
    ignored = [
        name
        for name in cfg.get("ignore") or []
        if "lm_head" not in name and not _names_router(name)
    ]
    if ignored:
        raise ValueError(f"compressed-tensors FP8 leaving {ignored} unquantized")
    return QuantFormat(FP8_W8A8, "compressed-tensors float-quantized", 8, -1, PER_TOKEN)


def _names_router(name: str) -> bool:
    """Whether an ``ignore`` entry names a mixture's router (``mlp.gate``),
    as a module name or compressed-tensors' ``re:`` pattern (the FP8
    mixtures' ``re:.*mlp.gate$``)."""
    plain = name.removeprefix("re:").removesuffix("$")
    return plain.replace("[.]", ".").replace("\\.", ".").endswith("mlp.gate")


def quantize_input(x: torch.Tensor, quant: QuantFormat | None) -> torch.Tensor:
    """A quantized layer's input as its GEMM sees it: unchanged, or for
    FP8 each row (or each group of 128 of a row) scaled to the e4m3 range
    (amax / 448, at least 1 / (448 * 512)), rounded to e4m3 and scaled
    back, in fp32 (vLLM's ``QuantFP8``; the scales are then applied before
    the sum, not after: fp32 rounding apart)."""
    if quant is None or quant.activations is None:
        return x
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max
    if quant.activations == PER_TOKEN_GROUP:
        # vLLM's group path divides by the scale (the per-token one
        # multiplies by its reciprocal), and pads a partial last group
        # with zeros (its scale: its own elements').
        k = x.shape[-1]
        padded = torch.nn.functional.pad(x, (0, -k % BLOCK))
        groups = padded.view(*x.shape[:-1], -1, BLOCK)
        amax = groups.abs().amax(dim=-1, keepdim=True).float()
        scale = (amax / top).clamp(min=1.0 / (top * 512.0))
        q = (groups / scale).clamp(-top, top).to(fp8)
        return (q.float() * scale).view(padded.shape)[..., :k]
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / top).clamp(min=1.0 / (top * 512.0))
    q = (x.float() * scale.reciprocal()).clamp(-top, top).to(fp8)
    return q.float() * scale


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 layer's weight as the kernel reads it: e4m3 codes ``[N, K]``
    row-major and fp32 scales: one an output row ``[N]`` (FP8 W8A8: the
    storage under vLLM's ``[K, N]`` weight, read in place) or one a 128 x
    128 block ``[N / 128, K / 128]`` (FP8 blocks: vLLM's ``weight`` and
    ``weight_scale_inv``)."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's ``[N, K]`` (``[E, N, K]``)."""
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32: each code times its row's or block's scale
        (exact; vLLM's ``block_dequant`` for blocks). A mixture's experts
        are ``[E, N, K]`` with scales ``[E, N]`` or ``[E, N / 128, K / 128]``."""
        if self.scale.dim() == self.codes.dim():
            return _dequantize_blocks(self.codes, self.scale)
        return self.codes.float() * self.scale.float()[..., None]


def quantize_rows(w: torch.Tensor) -> Fp8Weight:
    """A weight ``[N, K]`` quantized as compressed-tensors' per-channel FP8
    checkpoints are: each row's amax over 448 its scale, codes rounded to
    e4m3 (random-weight models and the GPU check)."""
    top = torch.finfo(torch.float8_e4m3fn).max
    scale = (w.float().abs().amax(dim=1) / top).clamp(min=1e-12)
    codes = (w.float() / scale[:, None]).clamp(-top, top).to(torch.float8_e4m3fn)
    return Fp8Weight(codes.contiguous(), scale.contiguous())


def quantize_blocks(w: torch.Tensor) -> Fp8Weight:
    """A weight ``[N, K]`` (whole blocks along K; a partial last block of
    rows, as DeepSeek-V3's fused q_a/kv_a ends in, scaled by its own rows)
    quantized as FP8-block checkpoints are: each 128 x 128 block's amax
    over 448 its scale (random-weight models and the GPU check)."""
    top = torch.finfo(torch.float8_e4m3fn).max
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, 0, 0, -n % BLOCK))
    blocks = padded.view(-1, BLOCK, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / top).clamp(min=1e-12)
    codes = (blocks / scale[:, None, :, None]).clamp(-top, top)
    codes = codes.to(torch.float8_e4m3fn).view(-1, k)[:n]
    return Fp8Weight(codes.contiguous(), scale.contiguous())


def fp8_codes(layer: torch.nn.Module, shape: tuple[int, int]) -> Fp8Weight:
    """An FP8 layer's codes and scales as the kernel reads them, from
    vLLM's layer in place. Per channel: vLLM keeps the weight ``[K, N]`` as
    the transposed view of row-major ``[N, K]`` codes (CUTLASS's operand on
    a GPU) and ``weight_scale`` ``[N, 1]`` fp32; a weight stored ``[K, N]``
    row-major instead is copied once (a byte a weight). Blocks: ``weight``
    ``[N, K]`` and ``weight_scale_inv`` ``[N / 128, K / 128]`` fp32, as
    loaded (a layout a kernel repacked is refused)."""
    n, k = shape
    blocks = getattr(layer, "weight_scale_inv", None)
    if blocks is not None:
        weight, scale = layer.weight.detach(), blocks.detach()
        grid = (-(-n // BLOCK), -(-k // BLOCK))
        if (
            weight.dtype != torch.float8_e4m3fn
            or tuple(weight.shape) != (n, k)
            or not weight.is_contiguous()
            or scale.dtype != torch.float32
            or tuple(scale.shape) != grid
        ):
            raise ValueError(
                f"megakernel: {type(layer).__name__} {tuple(shape)}: vLLM keeps "
                f"its FP8 blocks as {weight.dtype} {tuple(weight.shape)} with "
                f"scales {scale.dtype} {tuple(scale.shape)} (repacked?); the "
                f"kernel reads row-major e4m3 codes and fp32 scales {grid}"
            )
        return Fp8Weight(weight, scale.contiguous())
    weight, scale = layer.weight.detach(), layer.weight_scale.detach()
    if (
        weight.dtype != torch.float8_e4m3fn
        or tuple(weight.shape) != (k, n)
        or scale.dtype != torch.float32
        or scale.numel() != n
    ):
        raise ValueError(
            f"megakernel: {type(layer).__name__} {tuple(shape)}: vLLM keeps its "
            f"FP8 weight as {weight.dtype} {tuple(weight.shape)} with scales "
            f"{scale.dtype} {tuple(scale.shape)} (per tensor? repacked?); the "
            "kernel reads e4m3 codes with a scale an output row"
        )
    return Fp8Weight(weight.t().contiguous(), scale.reshape(n).contiguous())


def fp8_weight(layer: torch.nn.Module, shape: tuple[int, int]) -> torch.Tensor:
    """An FP8 layer's weight ``[N, K]`` in fp32: e4m3 codes times their
    scales: a 128x128 block's (``weight_scale_inv``, codes ``[N, K]`` as
    loaded) or an output channel's (codes ``[K, N]``, as vLLM keeps
    them)."""
    n, k = shape
    weight = layer.weight.detach()
    blocks = getattr(layer, "weight_scale_inv", None)
    if blocks is not None and weight.dtype == torch.float8_e4m3fn:
        scale = blocks.detach().float()
        if tuple(weight.shape) != (n, k) or scale.shape != (
            -(-n // BLOCK),
            -(-k // BLOCK),
        ):
            raise ValueError(
                f"megakernel: {type(layer).__name__} {tuple(shape)}: vLLM keeps "
                f"its FP8 blocks as {tuple(weight.shape)} with scales "
                f"{tuple(scale.shape)} (repacked?); the backend cannot read them"
            )
        return _dequantize_blocks(weight, scale)
    scale = layer.weight_scale.detach()
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (k, n):
        raise ValueError(
            f"megakernel: {type(layer).__name__} {tuple(shape)}: vLLM keeps its "
            f"FP8 weight as {weight.dtype} {tuple(weight.shape)} (repacked?); "
            "the backend cannot read it"
        )
    return weight.t().float() * scale.float().view(n, 1)


@dataclass(frozen=True)
class Int4Weight:
    """A W4A16 linear layer's weight: ``codes`` ``[N, K]`` uint8 in
    [0, 15] (the value plus 8), ``scales`` ``[N, K / group]`` in the model
    dtype. The layout the backend keeps of vLLM's (docs/design.md)."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.codes.shape[-1] // self.scales.shape[-1]

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` in the scales' dtype: ``(q - 8) * s`` rounded once
        (Marlin's dequantization)."""
        s = self.scales.repeat_interleave(self.group_size, dim=-1)
        return (self.codes.to(torch.int16) - 8).to(s.dtype) * s


@dataclass(frozen=True)
class PackedInt4:
    """A W4A16 layer's weight as the kernel reads it: ``codes`` ``[N, K /
    2]`` uint8, two codes a byte, code ``2j`` in the low nibble of byte
    ``j`` (compressed-tensors' eight a 32-bit word, low bits first, read as
    bytes); ``scale`` ``[N, K / group]`` bf16 (a mixture's experts: ``[E,
    N, K / 2]`` and ``[E, N, K / group]``)."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's ``[N, K]`` (two codes a byte; ``[E, N, K]``)."""
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    def unpacked(self) -> Int4Weight:
        c = self.codes
        codes = torch.stack([c & 0xF, c >> 4], dim=-1).view(*c.shape[:-1], -1)
        return Int4Weight(codes.contiguous(), self.scale)

    def dequantize(self) -> torch.Tensor:
        return self.unpacked().dequantize()


def pack_int4(w: Int4Weight) -> PackedInt4:
    """``w``'s codes two a byte, low nibble first (``PackedInt4``)."""
    c = w.codes
    return PackedInt4((c[..., 0::2] | (c[..., 1::2] << 4)).contiguous(), w.scales)


def quantize_int4(w: torch.Tensor, group: int) -> PackedInt4:
    """A weight ``[N, K]`` quantized as symmetric W4A16 checkpoints are:
    each group's absmax over 7 its scale (in ``w``'s dtype), codes the
    value plus 8 (random-weight models and the GPU check)."""
    n, k = w.shape
    groups = w.float().view(n, k // group, group)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-8).to(w.dtype)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7) + 8
    return pack_int4(Int4Weight(q.to(torch.uint8).view(n, k), scale.contiguous()))


def int4_scales(layer: torch.nn.Module, n: int) -> torch.Tensor:
    """A W4A16 layer's group scales ``[N, K / group]`` in the model dtype
    (``weight_scale`` or GPTQ's ``scales``; ``[K / group, N]`` after vLLM's
    CPU kernel transposed them)."""
    scales = getattr(layer, "weight_scale", None)
    if scales is None:
        scales = layer.scales
    scales = scales.detach()
    return (scales if scales.shape[0] == n else scales.t()).contiguous()


def int4_weight(
    layer: torch.nn.Module, dense: torch.Tensor, scales: torch.Tensor
) -> Int4Weight:
    """A W4A16 layer's codes and scales, from ``dense`` ``[N, K]``, what it
    multiplies by (read back through its own ``quant_method.apply``), and
    its group scales."""
    k = dense.shape[1]
    full = scales.repeat_interleave(k // scales.shape[1], dim=1).float()
    values = torch.round(dense.float() / full.where(full != 0, 1.0))
    weight = Int4Weight((values.clamp(-8, 7) + 8).to(torch.uint8), scales)
    if not torch.equal(weight.dequantize(), dense):
        raise ValueError(
            f"megakernel: {type(layer).__name__} {tuple(dense.shape)}: vLLM's INT4 "
            "weights are not (q - 8) * scale of its group scales; the backend "
            "cannot read them"
        )
    return weight


# Where a method keeps its INT4 experts' words and group scales, each
# ``[E, N, K / 8]`` int32 and ``[E, N, K / group]``: compressed-tensors'
# as loaded; GPTQ's once vLLM's AutoGPTQMoEMethod transposed its K-first
# ``qweight`` and ``scales`` to that layout (before any kernel repack).
INT4_EXPERT_NAMES = (("weight_packed", "weight_scale"), ("qweight", "scales"))


def int4_experts(
    experts: torch.nn.Module, num_experts: int, hidden: int, inter: int
) -> tuple[PackedInt4, PackedInt4]:
    """A W4A16 mixture's experts as the kernel reads them (``PackedInt4``,
    two codes a byte), in place: ``w13`` (gate rows, then up rows; ``[E,
    2I, H / 2]`` bytes) and ``w2`` (``[E, H, I / 2]``), from the packed
    words (``[E, N, K / 8]`` int32, code ``i`` of a word in bits ``4i`` to
    ``4i + 3``, the value plus 8: on a little-endian machine the same bytes
    as ``PackedInt4``'s) or vLLM's Triton WNA16 experts' view of them as
    bytes (``[E, N, K / 2]`` uint8, what ``--moe-backend triton`` keeps), and
    group scales (``[E, N, K / group]``), compressed-tensors' or GPTQ's
    (``INT4_EXPERT_NAMES``). A layout other than that (Marlin's repacked
    tiles, vLLM's default on a GPU) is refused by name, and so are expert
    biases."""
    out = []
    for name, n, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        packed = scales = None
        for words, scale in INT4_EXPERT_NAMES:
            packed = getattr(experts, f"{name}_{words}", None)
            scales = getattr(experts, f"{name}_{scale}", None)
            if packed is not None:
                break
        layouts = {torch.int32: (num_experts, n, k // 8),
                   torch.uint8: (num_experts, n, k // 2)}  # fmt: skip
        if (
            packed is None
            or scales is None
            or layouts.get(packed.dtype) != tuple(packed.shape)
            or not packed.is_contiguous()
            or scales.dim() != 3
            or tuple(scales.shape[:2]) != (num_experts, n)
            or k % scales.shape[2]
        ):
            layout = (
                "no packed weights" if packed is None
                else f"{packed.dtype} {tuple(packed.shape)}"
            )  # fmt: skip
            raise ValueError(
                f"megakernel: {type(experts).__name__}'s INT4 {name} experts are "
                f"held as {layout} (repacked by vLLM's "
                f"{type(experts.quant_method).__name__} for its kernel?); the "
                "backend reads [E, N, K / 8] int32 words as loaded, or their "
                "bytes as vLLM's Triton experts keep them (--moe-backend triton)"
            )
        if getattr(experts, f"{name}_bias", None) is not None:
            raise ValueError(
                f"megakernel: {type(experts).__name__}'s INT4 {name} experts "
                "have biases, which the backend does not add"
            )
        # (Words as bytes: code 2j in byte j's low nibble, little-endian.)
        assert sys.byteorder == "little"
        out.append(
            PackedInt4(packed.detach().view(torch.uint8), scales.detach().contiguous())
        )
    return out[0], out[1]


def fp8_experts(
    experts: torch.nn.Module, num_experts: int, hidden: int, inter: int
) -> tuple[Fp8Weight, Fp8Weight]:
    """An FP8 mixture's experts as vLLM holds them, read in place: ``w13``
    ``[E, 2I, H]`` e4m3 (gate rows, then up rows) and ``w2`` ``[E, H, I]``,
    with the scales of their 128x128 blocks (``w13_weight_scale_inv``
    ``[E, 2I / 128, H / 128]``) or of their output channels
    (``w13_weight_scale`` ``[E, 2I, 1]``, compressed-tensors per-channel,
    read as ``[E, 2I]``). A layout a kernel repacked is refused by name."""
    out = []
    for name, n, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        codes = getattr(experts, f"{name}_weight", None)
        scale = getattr(experts, f"{name}_weight_scale_inv", None)
        blocks = scale is not None
        if not blocks:
            scale = getattr(experts, f"{name}_weight_scale", None)
        scales = (
            (num_experts, -(-n // BLOCK), -(-k // BLOCK)) if blocks
            else (num_experts, n, 1)
        )  # fmt: skip
        if (
            codes is None
            or scale is None
            or codes.dtype != torch.float8_e4m3fn
            or tuple(codes.shape) != (num_experts, n, k)
            or tuple(scale.shape) != scales
        ):
            layout = (
                "no FP8 weights" if codes is None or scale is None
                else f"{codes.dtype} {tuple(codes.shape)}, scales "
                f"{tuple(scale.shape)}"
            )  # fmt: skip
            raise ValueError(
                f"megakernel: {type(experts).__name__}'s FP8 {name} experts are "
                f"held as {layout} (repacked for vLLM's kernel?); the backend "
                f"reads [E, N, K] e4m3 with {list(scales)} scales"
            )
        codes, scale = codes.detach(), scale.detach()
        out.append(Fp8Weight(codes, scale if blocks else scale.view(num_experts, n)))
    return out[0], out[1]


def _dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[..., N, K]`` times the scale of its 128x128 block
    (``[..., N / 128, K / 128]``, the last blocks possibly partial), fp32."""
    n, k = codes.shape[-2:]
    full = scale.float().repeat_interleave(BLOCK, -2)[..., :n, :]
    return codes.float() * full.repeat_interleave(BLOCK, -1)[..., :k]

# SPDX-License-Identifier: Apache-2.0
"""QK-norm and NeoX RoPE of a q or k head spread over a group of lanes
(reference: ``ops/qkv.finish``): ATTN's, where QKV split the heads into
parts and left them (isa.py, ``KernelShape.qk_in_attn``).

The lanes of a group hold the head's dims in order, the first RoPE half in
the group's first half: dim j's partner j + d/2 is in the lane ``lanes / 2``
away, one butterfly shuffle."""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from vllm_ext.megakernel.kernel.ops.common import round_bf16
from vllm_ext.megakernel.kernel.shape import KernelShape


@cute.jit
def norm_rope(
    s: cutlass.Constexpr,
    x: cute.Tensor,  # registers [n] fp32: bf16 values, finished in place
    n: cutlass.Constexpr,
    first,
    lanes: cutlass.Constexpr,
    norm: cute.Tensor,  # [head_dim] bf16: q_norm or k_norm
    position,
    cos_sin: cute.Tensor,  # [positions, head_dim] fp32: cos half, sin half
):
    """This lane's dims ``[first, first + n)`` of the head: RMS-normed by
    ``norm``, rounded to bf16, rotated, rounded again (the reference's
    roundings). Every lane of the group calls it (the sum and the shuffle
    span the group)."""
    shape: KernelShape = s
    d, half = shape.head_dim, shape.head_dim // 2
    ss = Float32(0.0)
    for e in cutlass.range_constexpr(n):
        ss = ss + x[e] * x[e]
    ss = cute.arch.warp_reduction(ss, operator.add, threads_in_group=lanes)
    r = cute.math.rsqrt(ss / Float32(d) + Float32(shape.rms_norm_eps))
    # First half: y = x c - x' s; second half: y = x c + x' s (x' the
    # partner's dim, s and c those of the first half's dim).
    sign, j0 = Float32(1.0), first
    if first < half:
        sign = Float32(-1.0)
    else:
        j0 = first - half
    for e in cutlass.range_constexpr(n):
        xn = round_bf16(x[e] * r * norm[first + e].to(Float32))
        other = cute.arch.shuffle_sync_bfly(xn, offset=lanes // 2)
        c, sn = cos_sin[position, j0 + e], cos_sin[position, j0 + e + half]
        x[e] = round_bf16(xn * c + (sign * other) * sn)

# SPDX-License-Identifier: Apache-2.0
"""Weight prefetch into L2 (no reference: a hint with no effect on results).

Weights never depend on activations, so an instruction's weight tile can
start streaming from HBM before the instruction's wait is met. Before
waiting on instruction pc, the CTA asks for instruction pc + 1's weight
rows (and pc's own, for the first one) with one bulk prefetch per matrix:
a tile's rows are contiguous in a row-major weight. At most
``PREFETCH_BYTES`` per matrix, so the lookahead of all SMs together stays
within part of the L2 (132 x 2 x 96 KiB = 25 MiB of the H200's 50 MiB).

A mixture's expert weights are the exception: which expert a slot holds is
data (the routing), unknown before the instruction's wait, so a routed
EXPERT_UP tile's consumers hint the rows once they have computed the
routing (ops/expert_up.py's ``hint_routed``), and the controller lane an
EXPERT_DOWN tile's that none hinted, once its wait has made TOPK's table
visible (control.py's ``prefetch_routed``), never from an unrouted
address. The router's rows
and the shared expert's are static and stream here like any weight."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.ops.gemv_quant import row_bytes
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot
from vllm_ext.megakernel.kernel.sync import prefetch_l2

PREFETCH_BYTES = 96 * 1024


@cute.jit
def prefetch_rows(base: Int64, row_bytes: cutlass.Constexpr, lo, hi):
    size = (hi - lo) * row_bytes
    if size > PREFETCH_BYTES:
        size = Int32(PREFETCH_BYTES)
    if size > 0:
        prefetch_l2(base + Int64(lo) * row_bytes, size)


@cute.jit
def prefetch_weights(s: cutlass.Constexpr, ptrs: cute.Tensor, glob, op, layer, lo, hi):
    """Prefetch the weight rows instruction (op, layer, lo, hi) will read."""
    shape: KernelShape = s
    h, d, inter = shape.hidden, shape.head_dim, shape.intermediate
    if op == Op.QKV:
        if cutlass.const_expr(shape.qkv_parts > 1):
            # The first unit's two blocks of rows (a unit per SM, as planned).
            n, half = d // (2 * shape.qkv_parts), d // 2
            first = (lo // shape.qkv_parts) * d + (lo % shape.qkv_parts) * n
            prefetch_rows(ptrs[layer, LayerSlot.QKV], h * 2, first, first + n)
            prefetch_rows(
                ptrs[layer, LayerSlot.QKV], h * 2, first + half, first + half + n
            )
        else:
            prefetch_rows(ptrs[layer, LayerSlot.QKV], d * h * 2, lo, hi)
    elif op == Op.O_PROJ:
        prefetch_rows(ptrs[layer, LayerSlot.O_PROJ], shape.q_size * 2, lo, hi)
    elif op == Op.GATE_UP:
        base = ptrs[layer, LayerSlot.GATE_UP]
        prefetch_rows(base, h * 2, lo, hi)
        prefetch_rows(base, h * 2, lo + inter, hi + inter)
    elif op == Op.DOWN:
        prefetch_rows(ptrs[layer, LayerSlot.DOWN], inter * 2, lo, hi)
    elif op == Op.LM_HEAD:
        prefetch_rows(ptrs[glob, GlobalSlot.LM_HEAD], h * 2, lo, hi)
    if cutlass.const_expr(shape.moe):
        _static_moe_rows(shape, ptrs, op, layer, lo, hi)
    if cutlass.const_expr(shape.mla):
        _mla_rows(shape, ptrs, op, layer, lo, hi)


@cute.jit
def _mla_rows(s: cutlass.Constexpr, ptrs: cute.Tensor, op, layer, a0, a1):
    """The latent attention's weight rows: MLA_QKV_A's of the fused down
    projection, MLA_Q's first head's q_b rows, MLA_COMBINE's W_UV rows."""
    shape: KernelShape = s
    h, lora, rank = shape.hidden, shape.q_lora_rank, shape.kv_lora_rank
    # (A quantized kernel's rows are codes: row_bytes.)
    if op == Op.MLA_QKV_A:
        if cutlass.const_expr(lora > 0):
            prefetch_rows(ptrs[layer, LayerSlot.MLA_Q_A], row_bytes(shape, h), a0,
                          cutlass.min(a1, lora))  # fmt: skip
        prefetch_rows(ptrs[layer, LayerSlot.MLA_KV_A], row_bytes(shape, h),
                      cutlass.max(a0, lora) - lora, a1 - lora)  # fmt: skip
    elif op == Op.MLA_Q:
        d = shape.qk_head_dim
        k = lora if lora > 0 else h
        prefetch_rows(ptrs[layer, LayerSlot.MLA_Q_B], d * row_bytes(shape, k), a0,
                      a0 + 1)  # fmt: skip
    elif op == Op.MLA_COMBINE:
        v = shape.v_head_dim
        cols = v // shape.mla_v_parts
        # Row r of head a0's W_UV is row a0 * (nope + v) + r of the W_UV view.
        row0 = a0 * (shape.qk_nope + v) + a1 * cols
        prefetch_rows(ptrs[layer, LayerSlot.MLA_W_UV], rank * 2, row0, row0 + cols)


@cute.jit
def _static_moe_rows(s: cutlass.Constexpr, ptrs: cute.Tensor, op, layer, a0, a1):
    """The mixture's weights that do not depend on the routing: the
    router's rows of ROUTE, and the shared expert's of its EXPERT_UP."""
    shape: KernelShape = s
    h = shape.hidden
    if op == Op.ROUTE:
        prefetch_rows(ptrs[layer, LayerSlot.ROUTER], h * 2, a0, a1)
    if cutlass.const_expr(shape.shared_intermediate > 0):
        if op == Op.EXPERT_UP:
            if a0 == shape.num_slots:
                lo, hi = a1 >> 16, a1 & 0xFFFF
                base = ptrs[layer, LayerSlot.SHARED_GATE_UP]
                prefetch_rows(base, row_bytes(shape, h), lo, hi)
                s_i = shape.shared_intermediate
                prefetch_rows(base, row_bytes(shape, h), lo + s_i, hi + s_i)

# SPDX-License-Identifier: Apache-2.0
"""Weight prefetch into L2 (no reference: a hint with no effect on results).

Weights never depend on activations, so an instruction's weight tile can
start streaming from HBM before the instruction's wait is met. Before
waiting on instruction pc, the CTA asks for instruction pc + 1's weight
rows (and pc's own, for the first one) with one bulk prefetch per matrix:
a tile's rows are contiguous in a row-major weight. At most
``PREFETCH_BYTES`` per matrix, so the lookahead of all SMs together stays
within part of the L2 (132 x 2 x 96 KiB = 25 MiB of the H200's 50 MiB)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.kernel.shape import GlobalSlot, KernelShape, LayerSlot
from vllm_ext.megakernel.kernel.sync import prefetch_l2

PREFETCH_BYTES = 96 * 1024


@cute.jit
def _rows(base: Int64, row_bytes: cutlass.Constexpr, lo, hi):
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
            _rows(ptrs[layer, LayerSlot.QKV], h * 2, first, first + n)
            _rows(ptrs[layer, LayerSlot.QKV], h * 2, first + half, first + half + n)
        else:
            _rows(ptrs[layer, LayerSlot.QKV], d * h * 2, lo, hi)
    elif op == Op.O_PROJ:
        _rows(ptrs[layer, LayerSlot.O_PROJ], shape.q_size * 2, lo, hi)
    elif op == Op.GATE_UP:
        base = ptrs[layer, LayerSlot.GATE_UP]
        _rows(base, h * 2, lo, hi)
        _rows(base, h * 2, lo + inter, hi + inter)
    elif op == Op.DOWN:
        _rows(ptrs[layer, LayerSlot.DOWN], inter * 2, lo, hi)
    elif op == Op.LM_HEAD:
        _rows(ptrs[glob, GlobalSlot.LM_HEAD], h * 2, lo, hi)

# SPDX-License-Identifier: Apache-2.0
"""INT4 W4A16 on the tensor-core GEMV (KernelShape.int4_group; the page
loop is gemv_paged._paged_mma, the MMA gemv_mma.mma_bf16): the same
contract as ``gemv.gemv`` (rows [lo, hi) of ``W @ x[b]`` for every request,
fp32 accumulation, the caller's ``epilogue``), W a weight of 4-bit codes
with a bf16 scale per row and group of k. Reference: the projections'
references over ``quant.Int4Weight.dequantize`` (Marlin's numerics:
``(q - 8) * s`` rounded once to bf16, activations in bf16, fp32 sums).

Codes are packed two a byte, low nibble first (compressed-tensors' eight a
32-bit word, low bits first, read as bytes), each the value plus 8. A page
holds 128 rows (64 of each of gate and up) by 512 codes. Per k block of
128 a lane loads 16 bytes (32 codes) of rows g and g + 8, and unpacks each
32-bit word w of 8 codes into four bf16 pairs, pair s the codes s and s + 4
of the word: ``((w >> 4s) & 0x000F000F) | 0x43004300`` is the pair (128 +
q, 128 + q') in bf16, exact; less 136 it is (q - 8, q' - 8), exact; times
the group's scale it rounds once, as Marlin does. The staged inputs
(``stage_chunk_int4``) are permuted the same way within each 8 (x0, x4, x1,
x5, x2, x6, x3, x7), so B's registers pair with A's with no shuffle, and
eight bf16 MMAs take the lane's 32 codes, two registers of each row and of
B each (a sum over k does not depend on its order). Groups of at least 32
codes keep a lane's 32 codes (aligned) in one group: one scale a row and k
block. The index arithmetic and numerics: tests/megakernel/
test_gemv_int4_mapping.py (float64).
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from vllm_ext.megakernel.kernel.ops.common import NUM_THREADS, VEC, load_f32, thread_ids
from vllm_ext.megakernel.kernel.ops.gemv_mma import (
    K_BLOCK4,
    K_CHUNK4,
    N_BLOCK,
    ROWS,
    VEC4,
    lane_vector,
    load_frag,
    mma_bf16,
    n_pad,
)

# A staged row's 128-bit vectors (8 bf16 each) of a 512-code chunk.
STAGE_VECS4 = K_CHUNK4 // VEC
# bf16 128.0 in both halves, and 136.0: (128 + q) - 136 = q - 8.
BF16X2_128 = 0x43004300
BF16X2_136 = 0x43084308


def permuted(e: int) -> int:
    """Where input ``e`` (0-7) of an 8-vector is staged: the bf16 pairs
    (x0, x4), (x1, x5), (x2, x6), (x3, x7), as ``unpack`` pairs codes."""
    return 2 * (e % 4) + e // 4


@dsl_user_op
def unpack(w, shift: int, scale2, *, loc=None, ip=None) -> Int32:
    """Pair ``shift`` (0-3) of the 8 codes in ``w``, dequantized: two bf16
    ``(q - 8) * s`` (codes ``shift`` and ``shift + 4``; ``scale2`` the
    group's scale in both halves), rounded once."""
    args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (w, scale2)]
    out = llvm.inline_asm(
        T.i32(), args,
        "{ .reg .b32 t, c; "
        f"shr.b32 t, $1, {4 * shift}; "
        f"lop3.b32 t, t, 0x000F000F, {BF16X2_128:#x}, 0xEA; "
        f"mov.b32 c, {BF16X2_136:#x}; "
        "sub.rn.bf16x2 t, t, c; "
        "mul.rn.bf16x2 $0, t, $2; }",
        "=r,r,r",
        has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return Int32(out)


@cute.jit
def stage_chunk_int4(
    x: cute.Tensor, norm: cute.Tensor, rstd: cute.Tensor, k0, k_len,
    stage: cute.Tensor, normed: cutlass.Constexpr,
):  # fmt: skip
    """Every request's inputs k0 .. k0 + k_len (normed and rounded as the
    reference hands them on when asked) into ``stage`` in bf16, each
    8-vector permuted (``permuted``); a vector per thread. The caller's
    barrier publishes them."""
    tidx, _, _ = thread_ids()
    batch = x.shape[0]
    v0 = k0 // VEC
    for idx in cutlass.range(tidx, batch * STAGE_VECS4, NUM_THREADS):
        n, v = idx // STAGE_VECS4, idx % STAGE_VECS4
        if v * VEC < k_len:
            y = load_f32(cute.zipped_divide(x[n, None], (VEC,)), v0 + v)
            if cutlass.const_expr(normed):
                nv = load_f32(cute.zipped_divide(norm, (VEC,)), v0 + v)
                y = y * rstd[n] * nv
            r = cute.make_rmem_tensor((VEC,), BFloat16)
            for e in cutlass.range_constexpr(VEC):
                r[permuted(e)] = y[e].to(BFloat16)
            cute.autovec_copy(r, cute.zipped_divide(stage[n, None], (VEC,))[None, v])


@cute.jit
def int4_chunk(
    w: cute.Tensor, w2: cute.Tensor, dual: cutlass.Constexpr, stage: cute.Tensor,
    rb, sl, ks, kblocks, batch: cutlass.Constexpr, acc: cute.Tensor,
    ws: cute.Tensor, ws2: cute.Tensor, row0, k0, group: cutlass.Constexpr,
):  # fmt: skip
    """``gemv_mma.mma_chunk`` for INT4 pages: this warp's rows ``16 rb`` ..
    ``16 rb + 15`` of ``w`` (and ``w2``), k blocks ``sl``, ``sl + ks``, ..
    below ``kblocks`` (of 128 codes), against every staged request, into
    ``acc``; ``row0`` and ``k0``: the page's first matrix row and
    column."""
    _, _, lane = thread_ids()
    g, q = lane // 4, lane % 4
    n_blocks = n_pad(batch) // N_BLOCK
    for kb in cutlass.range(sl, kblocks, ks):
        int4_step(w, w2, 2 if dual else 1, stage, lane_vector(kb, q),
                  rb * ROWS + g, g, n_blocks, acc, ws, ws2, row0 + rb * ROWS + g,
                  k0 + kb * K_BLOCK4 + q * VEC4, group)  # fmt: skip


@cute.jit
def int4_step(
    w: cute.Tensor, w2: cute.Tensor, n_mats: cutlass.Constexpr, stage: cute.Tensor,
    j, prow, g, n_blocks: cutlass.Constexpr, acc: cute.Tensor, ws: cute.Tensor,
    ws2: cute.Tensor, row, kcode, group: cutlass.Constexpr,
):  # fmt: skip
    """One k block of 128 codes (``gemv_mma.mma_chunk`` with INT4): this
    lane's vector ``j`` (32 codes) of page rows ``prow`` and ``prow + 8``
    (matrix rows ``row`` and ``row + 8``; ``kcode`` the matrix column of
    its first code), dequantized with the rows' group scales (``ws`` /
    ``ws2`` ``[N, K / group]``, bf16 read as their bits; rows past the
    matrix read its last), against every request block's staged inputs
    (request ``nb * 8 + g``'s), into ``acc``."""
    a = cute.make_rmem_tensor((2, 2, 16), Int32)
    last = ws.shape[0] - 1
    for m in cutlass.range_constexpr(n_mats):
        mat = w if m == 0 else w2
        sc = ws if m == 0 else ws2
        for h in cutlass.range_constexpr(2):
            words = cute.make_rmem_tensor((4,), Int32)
            load_frag(cute.zipped_divide(mat[prow + 8 * h, None], (16,)), j, words)
            s = Int32(sc[cutlass.min(row + 8 * h, last), kcode // group])
            s2 = s | (s << 16)
            for t in cutlass.range_constexpr(4):
                for p in cutlass.range_constexpr(4):
                    a[m, h, 4 * t + p] = unpack(words[t], p, s2)
    for nb in cutlass.range_constexpr(n_blocks):
        b = cute.make_rmem_tensor((4, 4), Int32)
        vecs = cute.zipped_divide(stage[nb * N_BLOCK + g, None], (VEC,))
        for t in cutlass.range_constexpr(4):
            load_frag(vecs, 4 * j + t, b[t, None])
        for m in cutlass.range_constexpr(n_mats):
            for i in cutlass.range_constexpr(8):
                t, p = i // 2, 2 * (i % 2)  # word t's pairs p, p + 1
                d = mma_bf16(
                    a[m, 0, 4 * t + p], a[m, 1, 4 * t + p],
                    a[m, 0, 4 * t + p + 1], a[m, 1, 4 * t + p + 1],
                    b[t, p], b[t, p + 1],
                    acc[m, nb, 0], acc[m, nb, 1], acc[m, nb, 2], acc[m, nb, 3],
                )  # fmt: skip
                for c in cutlass.range_constexpr(4):
                    acc[m, nb, c] = d[c]
